"""Sampling on the logits' device: logit processors (min_tokens, penalties), then greedy at temperature
0, else temperature with top-k, top-p and min-p; and the raw log-probabilities of the logits.

Randomness comes from a counter-based hash of (request seed, output index, token id), not from a
generator's state, so a request's tokens depend only on its own seed and logits: the same seed gives
the same output whatever else is in the batch, and after a preemption the recomputed step draws the
same noise again. Sampling is Gumbel-max: argmax(logits / T + G) with G = -log(-log U) picks token i
with probability softmax(logits / T)_i; with top-k/top-p/min-p the argmax runs over the kept set, which
picks a token with its probability renormalised over that set. Ties of logit values are kept or
dropped together (ops/sampling_reference.kept_mask). On CUDA both are Triton kernels that never sort
the vocabulary (ops/sampling.py); on CPU the PyTorch references.

Order, as vLLM's: log-probabilities come from the raw logits (log_softmax before any processing);
then EOS and stop ids are banned (-inf) for rows with fewer than min_tokens outputs, then the
repetition, presence and frequency penalties (ops.apply_penalties), then temperature and truncation.
A batch that uses none of the processors or logprobs pays nothing for them: SamplingTensors.build
leaves their tensors None and sample() goes straight to the samplers.
"""
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter

import numpy as np
import torch

import ops
from engine.kernel_compiles import CompilePool, run_compiled_ahead
from engine.sequence import SamplingParams, Sequence, Status
from engine.staging import aligned_rows, upload, upload_all
from engine.structured import bitmask_words

MAX_LOGPROBS = 20  # the largest logprobs / prompt_logprobs k a request may ask for (OpenAI's and vLLM's)
_PENALISED = attrgetter("sampling.penalised")
_FIELDS = attrgetter("temperature", "top_k", "top_p", "min_p", "noise_seed", "min_tokens", "logprobs")  # SamplingTensors.build's


@dataclass
class Penalties:
    """The penalised rows of a batch (device tensors [R]); their tokens are TokenHistory rows `slots`."""

    rows: torch.Tensor  # int64: rows of the batch
    slots: torch.Tensor  # int64: rows of token_ids
    prompt_lens: torch.Tensor  # int64
    num_tokens: torch.Tensor  # int64: tokens before the one being drawn (prompt + outputs, placeholder included)
    repetition: torch.Tensor  # float32
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    token_ids: torch.Tensor  # int32 [S, W]: TokenHistory.token_ids
    width: int  # max(num_tokens): the columns of token_ids that hold tokens of these rows


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B], vocab size when off
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    seed: torch.Tensor  # int64 [B]: SamplingParams.noise_seed, in [0, 2^32)
    step: torch.Tensor  # int64 [B] index of the token being drawn
    all_greedy: bool
    any_truncation: bool  # some top_k, top_p or min_p is active
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) [N] int64 whose logits are -inf
    penalties: Penalties | None
    num_logprobs: int | None  # the largest logprobs k among the rows; None: no row asks

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], vocab_size: int, device,
              eos_token_ids=(), penalised: "PenaltyRows | None" = None) -> "SamplingTensors":
        """The batch's tensors in one host-to-device copy, which never waits for the device (staged, then
        upload_all). eos_token_ids: banned with a row's stop_token_ids while it has fewer than min_tokens
        outputs (unless it ignores EOS); penalised: TokenHistory.rows of this batch."""
        arrays, finish = cls.staged(params, steps, vocab_size, eos_token_ids, penalised)
        return finish(upload_all(arrays, device))

    @classmethod
    def staged(cls, params: list[SamplingParams], steps: list[int], vocab_size: int, eos_token_ids=(),
               penalised: "PenaltyRows | None" = None
               ) -> "tuple[list[np.ndarray], Callable[[list[torch.Tensor]], SamplingTensors]]":
        """build's host arrays, for a step to upload with its other inputs, and the function that makes the
        SamplingTensors from their device copies (in order). The fields are read in one pass over the rows
        (columns of _FIELDS), the rest is numpy; each field's row is padded to a multiple of 4 values, so it
        starts 16-byte aligned (staging.aligned_rows)."""
        temperature, top_k, top_p, min_p, seeds, min_tokens, logprobs = list(zip(*map(_FIELDS, params))) or [()] * 7
        rows = len(params)
        top_k = np.array(top_k, dtype=np.int64)
        top_k[(top_k <= 0) | (top_k >= vocab_size)] = vocab_size
        floats, ints = aligned_rows([temperature, top_p, min_p], np.float32), aligned_rows([top_k, seeds, steps], np.int64)
        banning = np.flatnonzero(ints[2, :rows] < np.array(min_tokens, dtype=np.int64)).tolist()  # step < min_tokens
        banned = [(row, t) for row in banning for p in (params[row],)
                  for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids)]
        arrays = [floats, ints, np.array(banned, dtype=np.int64).T.reshape(2, -1)]  # banned as [2, N]: rows, ids
        if penalised:
            arrays += penalised.arrays(params)
        asked = set(logprobs)
        asked.discard(None)
        all_greedy = not floats[0].any()
        any_truncation = bool((top_k < vocab_size).any() or (floats[1, :rows] < 1).any() or (floats[2] > 0).any())

        def finish(on_device: list[torch.Tensor]) -> "SamplingTensors":
            f, i = on_device[0][:, :rows], on_device[1][:, :rows]
            return cls(temperature=f[0], top_k=i[0], top_p=f[1], min_p=f[2], seed=i[1], step=i[2],
                       all_greedy=all_greedy, any_truncation=any_truncation,
                       banned=tuple(on_device[2]) if banned else None,
                       penalties=penalised.on_device(*on_device[3:5]) if penalised else None,
                       num_logprobs=max(asked, default=None))
        return arrays, finish

    def rows(self) -> dict[str, torch.Tensor]:
        """The per-row tensors the samplers take, by name (a stalled step's record: engine/watchdog.py)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "seed": self.seed, "output_index": self.step}


def sample(logits: torch.Tensor, t: SamplingTensors, fallbacks: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [B] from logits [B, V] in the model's dtype (sampling math in float32). The logits are
    not modified (the processors work on a copy). fallbacks: see draw."""
    return draw(processed_logits(logits, t), t, fallbacks)


def draw(logits: torch.Tensor, t: SamplingTensors, fallbacks: torch.Tensor | None = None,
         gumbel: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The samplers on processed logits (processed_logits); fallbacks: int32 [1] on the device, increased
    by the rows the truncating kernel drew through its exact fallback (ops/sampling.py); gumbel: what runs
    ops.gumbel_sample's draw (its arguments; default: it)."""
    if t.all_greedy:
        return logits.argmax(dim=-1)
    if not t.any_truncation:  # one pass over the logits; rows at temperature 0 take the argmax
        return (gumbel or ops.gumbel_sample)(logits, t.temperature, t.seed, t.step)
    return ops.top_k_top_p_sample(logits, t.temperature, t.top_k, t.top_p, t.seed, t.step, min_p=t.min_p,
                                  fallbacks=fallbacks)


def start_compiling_samplers(vocab_size: int, dtype: torch.dtype, device,
                             compiles: CompilePool | None = None) -> list[concurrent.futures.Future]:
    """On CUDA: draws once through each sampler (plain, and with truncation), takes MAX_LOGPROBS logprobs and
    applies a structured-output mask, for each logits dtype they can be handed (the model's; float32 once a
    row has a penalty), each case on a thread of its own; returns at once, its Futures done when the cases
    are. Triton compiles a kernel at its first call, which inside a run stalls it (a top-p run's first step
    took 3.7 s on the H200, a constrained run's 0.47 s: benchmarks/NOTES.md); a compilation spends part of
    its time without the GIL (ptxas, LLVM), so the cases compile side by side and beside the caller's own
    work, with compiles in its worker processes first (a dry pass of each case). Wait for them before a CUDA
    graph capture, during which no other thread may use the device."""
    plain, truncated = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05)
    cases = [(logits_dtype, params) for logits_dtype in {dtype, torch.float32} for params in (plain, truncated, None)]
    pool = concurrent.futures.ThreadPoolExecutor(len(cases), thread_name_prefix="compile-samplers")
    futures = [pool.submit(run_compiled_ahead, compiles, _draw_once, vocab_size, logits_dtype, params, device)
               for logits_dtype, params in cases]
    pool.shutdown(wait=False)  # its threads end with their case
    return futures


def _draw_once(vocab_size: int, logits_dtype: torch.dtype, params: SamplingParams | None, device) -> None:
    """A draw of 2 rows with params, or (None) a mask applied and logprobs taken, then synchronised."""
    with torch.cuda.device(device):
        logits = torch.zeros(2, vocab_size, dtype=logits_dtype, device=device)
        if params is not None:
            sample(logits, SamplingTensors.build([params] * 2, [0, 0], vocab_size, device))
        else:
            everything = torch.full((2, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device)
            ops.apply_token_bitmask(logits, everything, torch.arange(2, device=device))
            ops.logprobs(logits, torch.zeros(2, dtype=torch.int64, device=device), MAX_LOGPROBS)
        torch.cuda.current_stream().synchronize()


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits the samplers draw from: after min_tokens' bans and the penalties, a copy (float32 with
    penalties), or the logits themselves when no row uses either."""
    if t.banned is None and t.penalties is None:
        return logits
    logits = logits.to(torch.float32, copy=True) if t.penalties is not None else logits.clone()
    if t.banned is not None:
        logits.index_put_(t.banned, logits.new_full((), float("-inf")))  # a device scalar: no copy
    if t.penalties is not None:
        p = t.penalties
        logits[p.rows] = ops.apply_penalties(logits[p.rows], p.token_ids[p.slots, :p.width], p.prompt_lens,
                                             p.num_tokens, p.repetition, p.presence, p.frequency)
    return logits


@dataclass
class PenaltyRows:
    """The host's side of Penalties: the penalised rows of a batch, their slots and prompt lengths."""

    rows: list[int]
    slots: list[int]
    prompt_lens: list[int]
    num_tokens: list[int]
    token_ids: torch.Tensor  # TokenHistory.token_ids

    def arrays(self, params: list[SamplingParams]) -> list[np.ndarray]:
        """The host arrays of on_device: int64 [4, R'] rows, slots, prompt lengths and token counts, float32
        [3, R'] the three penalties (R' >= R: rows padded as aligned_rows does)."""
        chosen = [params[r] for r in self.rows]
        return [aligned_rows([self.rows, self.slots, self.prompt_lens, self.num_tokens], np.int64),
                aligned_rows([[p.repetition_penalty for p in chosen], [p.presence_penalty for p in chosen],
                              [p.frequency_penalty for p in chosen]], np.float32)]

    def on_device(self, ints: torch.Tensor, floats: torch.Tensor) -> Penalties:
        """Penalties from the device copies of arrays()."""
        rows = len(self.rows)
        return Penalties(*ints[:, :rows], *floats[:, :rows], token_ids=self.token_ids, width=max(self.num_tokens))


class TokenHistory:
    """The token ids of the sequences that draw with a penalty, on the device: token_ids int32 [slots,
    width] holds one sequence per row (slot), its prompt then its outputs. A sequence takes a slot at
    its first penalised draw, when its known tokens are copied (a placeholder's from the device tokens
    of the step before), and keeps it until it has finished: each draw writes its token into the slot
    on the device (record), so outputs never travel from the host and tokens still in flight count.
    Slots of finished sequences are reclaimed when one is needed; rows grow by doubling. width: at
    least max_model_len."""

    def __init__(self, width: int, device):
        self.width, self.device = width, device
        self.token_ids = torch.zeros((0, width), dtype=torch.int32, device=device)
        self._slots: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (sequence, slot)
        self._free: list[int] = []

    def rows(self, seqs: list[Sequence], previous) -> PenaltyRows | None:
        """The penalised rows among seqs (a batch's drawing sequences), admitting those new to it;
        previous: the InFlight step before (its device tokens fill placeholders)."""
        rows = list(compress(range(len(seqs)), map(_PENALISED, seqs)))
        if not rows:
            return None
        new = [seqs[i] for i in rows if seqs[i].seq_id not in self._slots]
        if new:
            self._admit(new, previous)
        chosen = [seqs[i] for i in rows]
        return PenaltyRows(rows, [self._slots[s.seq_id][1] for s in chosen], [len(s.prompt_token_ids) for s in chosen],
                           [s.num_tokens for s in chosen], self.token_ids)

    def record(self, penalties: Penalties, tokens: torch.Tensor) -> None:
        """Write the tokens just drawn [B] at their positions."""
        self.token_ids[penalties.slots, penalties.num_tokens] = tokens[penalties.rows].int()

    def _admit(self, seqs: list[Sequence], previous) -> None:
        if len(self._free) < len(seqs):
            self._reclaim()
        if len(self._free) < len(seqs):
            self._grow(len(seqs) - len(self._free))
        for seq in seqs:
            self._slots[seq.seq_id] = (seq, self._free.pop())
        known = [np.asarray(s.token_slice(0, s.num_known_tokens), dtype=np.int64) for s in seqs]
        where = [self._slots[s.seq_id][1] * self.width + np.arange(len(k)) for s, k in zip(seqs, known)]
        pairs = upload(np.stack([np.concatenate(where), np.concatenate(known)]), self.device)
        self.token_ids.view(-1)[pairs[0]] = pairs[1].int()
        waiting = [s for s in seqs if s.has_placeholder]
        if waiting:
            pairs = upload(np.array([[self._slots[s.seq_id][1] * self.width + s.num_tokens - 1 for s in waiting],
                                     [previous.rows[s.seq_id] for s in waiting]], dtype=np.int64), self.device)
            self.token_ids.view(-1)[pairs[0]] = previous.device_tokens[pairs[1]].int()

    def _reclaim(self) -> None:
        for seq_id in [i for i, (s, _) in self._slots.items() if s.status is Status.FINISHED]:
            self._free.append(self._slots.pop(seq_id)[1])

    def _grow(self, need: int) -> None:
        old = self.token_ids.shape[0]
        grown = torch.zeros((max(2 * old, old + need, 8), self.width), dtype=torch.int32, device=self.device)
        grown[:old] = self.token_ids
        self._free.extend(range(grown.shape[0] - 1, old - 1, -1))  # pop() takes the lowest first
        self.token_ids = grown


@dataclass
class PromptSegment:
    """Rows of one prefill chunk whose logits score prompt tokens: row r of the segment (position
    start + r of the sequence) scores prompt token start + r + 1."""

    seq: Sequence
    start: int  # the chunk's first position
    row: int  # the segment's first row in the step's logprobs
    length: int
    batch_row: int  # the chunk's first row in the step's tokens (hidden states)


class StepLogprobs:
    """A step's log-probabilities on their way to the host (ops.logprobs rows of one k): one row per
    sequence that drew, in the step's order, then the rows of the prompt segments. The engine fills
    the sequences' fields when it resolves the step: add_prompts, then add_output per drawn token."""

    def __init__(self, device_rows: torch.Tensor, segments: list[PromptSegment]):
        self.host = to_host(device_rows)
        self.segments = segments
        self._targets = self._ranks = self._tops = None

    def _lists(self) -> tuple[list[float], list[int], list[tuple[tuple[int, float], ...]]]:
        """Per row: the target's logprob and rank, and the top (id, logprob) pairs; made once, for all rows,
        by one tolist per field and zips that run in C (no Python per row: 0.50 -> 0.21 ms a step at 256
        rows, k=5, on the CPU). Tuples, not lists: the cyclic GC stops tracking tuples of numbers, while a
        list per token made its full collections stall the host for ~0.1 s in a run of nano's size."""
        if self._targets is None:
            targets, ranks, top, ids = (x.numpy() for x in ops.unpack_logprobs(self.host))
            pairs = zip(ids.ravel().tolist(), top.ravel().tolist())  # the whole step's pairs, row after row
            self._targets, self._ranks = targets.tolist(), ranks.tolist()
            self._tops = list(zip(*[pairs] * top.shape[1]))  # k pairs a row
        return self._targets, self._ranks, self._tops

    def add_output(self, seq: Sequence, row: int) -> None:
        k = seq.sampling.logprobs
        if k is not None:
            targets, ranks, tops = self._lists()
            seq.output_logprobs.append(targets[row])
            seq.output_ranks.append(ranks[row])
            if k:
                seq.top_logprobs.append(tops[row][:k])

    def add_prompts(self) -> None:
        """Fill the prompt logprobs of the segments (positions already filled, by a chunk computed
        again after a preemption, are left as they are)."""
        for seg in self.segments:
            seq, k = seg.seq, seg.seq.sampling.prompt_logprobs
            if seg.start == 0 and not seq.prompt_logprobs:  # the first token has no logprob
                seq.prompt_logprobs.append(None)
                seq.prompt_ranks.append(None)
                if k:
                    seq.prompt_top_logprobs.append(None)
            done = len(seq.prompt_logprobs) - 1 - seg.start  # rows of this segment already filled
            if done < 0:
                raise AssertionError(f"request {seq.request_id}: prompt logprobs from position {seg.start} "
                                     f"but only {len(seq.prompt_logprobs)} filled (a prefix-cache hit?)")
            targets, ranks, tops = self._lists()
            rows = slice(seg.row + done, seg.row + seg.length)
            seq.prompt_logprobs.extend(targets[rows])
            seq.prompt_ranks.extend(ranks[rows])
            if k:
                seq.prompt_top_logprobs.extend(top[:k] for top in tops[rows])


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in pinned host memory, without waiting (the CPU tensor itself on CPU)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host

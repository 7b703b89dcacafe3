"""One engine step on the data plane: per-step tensors from a ScheduledBatch, the model call, sampling.

Per-step metadata is built on the CPU with numpy (no per-token Python loops), staged in pinned memory
on CUDA and copied without blocking (engine/staging.py); every layer reads the same AttentionMetadata. On
CUDA, decode-only steps replay CUDA graphs of the forward and the logits, and of the Gumbel-max draw where it
applies (engine/cuda_graphs.py); steps with prefill chunks replay graphs
of the pieces between attention calls (model.piecewise_graphs, on by default there), else run eagerly;
decode batches above the largest graph run eagerly. With a CascadePolicy, decode rows that share a
prefix of blocks take cascade attention (engine/prefix_groups.py); a step without such groups starts its
decode rows longest first.
Only the last position of each sequence that draws a token gets logits, and the prompt positions of the
chunks of sequences that ask for prompt_logprobs (PROMPT_ROWS at a time). The samples forked from a
sequence in a step draw from its logits row, each with its own seed.
"""
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from operator import attrgetter

import numpy as np
import torch

import ops
from engine.attention import AttentionMetadata, CascadeMetadata, PrefillMetadata
from engine.block_manager import KVBlockManager, new_token_positions
from engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs, smallest_bucket
from engine.kernel_compiles import CompilePool
from engine.kv_cache import PagedKVCache
from engine.models.decoder import DecoderForCausalLM
from engine.prefix_groups import CascadePolicy, PrefixGroups, find_prefix_groups
from engine.sampler import PromptSegment, SamplingTensors, StepLogprobs, TokenHistory, draw, processed_logits, to_host
from engine.scheduler import Fork, ScheduledBatch
from engine.sequence import PLACEHOLDER, Sequence
from engine.staging import upload, upload_all
from engine.structured import FILL_THREADS, bitmask_words, start_fill_bitmasks
from engine.watchdog import StepInputs, StepTimeout

PROMPT_ROWS = 256  # prompt positions whose logits exist at once (prompt_logprobs): [PROMPT_ROWS, vocab]
FILL_CHUNK_ROWS = 128  # a step's masks fill in chunks of at least this many rows, one chunk per fill thread
_SEQ_ID, _SAMPLING = attrgetter("seq_id"), attrgetter("sampling")


def padded_to_bucket(rows: np.ndarray, buckets: list[int] | None) -> np.ndarray:
    """rows, then its first entry repeated up to the smallest of the ascending buckets that holds them (rows as
    they are without buckets, rows or such a bucket). An eager step's lm_head then multiplies a row count whose
    cuBLAS kernel the decode graphs' captures have run: at a count that picked a kernel not run before, the call
    held the host until the device had drained (benchmarks/NOTES.md, session 48)."""
    size = smallest_bucket(buckets, rows.size) if buckets and rows.size else None
    return rows if size is None else np.concatenate([rows, np.full(size - rows.size, rows[0], dtype=rows.dtype)])


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: PagedKVCache, block_manager: KVBlockManager,
                 device: torch.device, max_blocks_per_seq: int, max_graph_batch: int = 0, eos_token_ids=(),
                 cascade: CascadePolicy | None = None, max_piece_tokens: int = 0, fill_timeout_s: float | None = None,
                 compiles: CompilePool | None = None):
        """fill_timeout_s: how long a step's grammar masks may take to fill (None: no limit); compiles: where the
        graphs' kernels compile before their captures (None: at their launches)."""
        self.model, self.kv_cache, self.block_manager, self.device = model, kv_cache, block_manager, device
        self.fill_timeout_s = fill_timeout_s
        self.cascade = cascade
        self.cascade_rows = 0  # decode rows of the last prepared step that read a shared prefix
        self.eos_token_ids = tuple(eos_token_ids)  # banned before min_tokens
        self.history = TokenHistory(max_blocks_per_seq * block_manager.block_size, device)
        self.sampler_fallbacks = torch.zeros(1, dtype=torch.int32, device=device)  # rows drawn by the exact fallback
        self.graphs = None
        if device.type == "cuda" and max_graph_batch > 0:
            self.graphs = DecodeGraphs(model, kv_cache, max_graph_batch, max_blocks_per_seq, device, cascade, compiles)
        self.pieces = None  # steps with prompt chunks: graphs of the pieces around attention (eager pieces on CPU)
        if max_piece_tokens > 0:
            self.pieces = PiecewiseGraphs(model, kv_cache, max_piece_tokens, device, device.type == "cuda", compiles)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return upload(array, self.device)

    def step_arrays(self, batch: ScheduledBatch, starts: np.ndarray, tables: np.ndarray, seq_lens: np.ndarray,
                    previous: "InFlight | None") -> dict[str, np.ndarray]:
        """The host arrays of a step's inputs by name, for its one upload: input_ids int64 [T], positions
        int64 [T], slot_mapping int32 [T]; the decode rows' block_tables int32 [n, M] and seq_lens int32 [n],
        with decode_order int32 [n] (plain decode) or the cascade's groups (cu_group_rows, group_prefix_lens,
        plan); the prefill chunks' prefill_tables, prefill_seq_lens and cu_seqlens int32 [C + 1];
        sampled_rows int64 [>= D] (the last row of each sequence that draws, padded_to_bucket); placeholders
        int64 [2, P] (input rows, rows of the previous step's device tokens) for the rows whose token the previous
        step drew.
        starts: int64 [S], the tokens each sequence had computed before the step; tables int32 [S, M] and
        seq_lens int32 [S]: its block tables and lengths with the step's tokens
        (KVBlockManager.block_tables_and_seq_lens)."""
        counts = np.array(batch.num_new_tokens, dtype=np.int64)
        cu_seqlens = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        last_rows = cu_seqlens[1:].astype(np.int64) - 1  # each sequence's last input row
        draws = np.array(batch.draws, dtype=bool)
        n = batch.num_decode_seqs
        arrays = {
            "input_ids": np.concatenate([np.array([s.last_token for s in batch.seqs[:n]], dtype=np.int64)] + [
                s.token_slice(a, a + c) for s, a, c in zip(batch.seqs[n:], starts[n:].tolist(), counts[n:].tolist())
            ]).astype(np.int64),
            "positions": new_token_positions(starts, counts), "slot_mapping": batch.slot_mapping,
            "block_tables": tables[:n], "seq_lens": seq_lens[:n],
            "sampled_rows": padded_to_bucket(last_rows[draws], self.graphs.buckets if self.graphs else None)}
        if n < len(batch.seqs):
            arrays |= {"prefill_tables": tables[n:], "prefill_seq_lens": seq_lens[n:], "cu_seqlens": cu_seqlens[n:] - n}
        arrays |= self._decode_layout(tables[:n], seq_lens[:n])
        if previous is not None:
            arrays |= placeholder_rows(previous, batch.seqs, last_rows, draws)
        return arrays

    def _decode_layout(self, tables: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """The decode rows' order (plain decode starts its rows longest first: decode_order) or their shared-
        prefix groups (cu_group_rows, group_prefix_lens, plan)."""
        groups = self._prefix_groups(tables, seq_lens)
        if groups is None:
            return {"decode_order": longest_first(seq_lens)}
        # over short own contexts (the cascade's suffix pass) the order only cost time: benchmarks/NOTES.md
        arrays = {"cu_group_rows": groups.cu_group_rows, "group_prefix_lens": groups.group_prefix_lens}
        return arrays if groups.plan is None else arrays | {"plan": groups.plan}

    def _prefix_groups(self, tables: np.ndarray, seq_lens: np.ndarray) -> PrefixGroups | None:
        """The decode rows' shared-prefix groups that the policy takes (None: none); sets cascade_rows."""
        if self.cascade is None:
            return None
        groups = find_prefix_groups(tables, seq_lens, self.block_manager.block_size, self.cascade)
        self.cascade_rows = 0 if groups is None else groups.shared_rows
        return groups

    @staticmethod
    def attention_metadata(inputs: dict[str, torch.Tensor]) -> AttentionMetadata:
        """The AttentionMetadata of step_arrays' device copies."""
        prefill = cascade = None
        if "cu_seqlens" in inputs:
            prefill = PrefillMetadata(inputs["prefill_tables"], inputs["prefill_seq_lens"], inputs["cu_seqlens"])
        if "cu_group_rows" in inputs:
            cascade = CascadeMetadata(inputs["cu_group_rows"], inputs["group_prefix_lens"], inputs.get("plan"))
        return AttentionMetadata(inputs["slot_mapping"], inputs["block_tables"], inputs["seq_lens"], prefill, cascade,
                                 inputs.get("decode_order"))

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(final hidden states [T, hidden], None) of a step, or (None, logits [T, vocab]) where a decode graph
        ran, which computes every row's (each row of a decode step is one that draws)."""
        if meta.prefill is None:
            if self.graphs is not None and self.graphs.fits(input_ids.shape[0], meta.cascade is not None):
                return None, self.graphs.run(input_ids, positions, meta)
        elif self.pieces is not None and self.pieces.fits(input_ids.shape[0]):
            return self.pieces.run(input_ids, positions, meta), None
        return self.model(input_ids, positions, self.kv_cache, meta), None

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: "InFlight | None", step: int,
               previous_tokens: Callable[["InFlight"], list[int]]) -> "InFlight | None":
        """Enqueue the batch's forward and sampling without waiting for the device; None when no sequence
        draws a token in this step. The step's host arrays (inputs, forks, sampling tensors) go up in one
        copy. Tokens that are still placeholders on the host come from the previous step's device output
        (its draw enqueued first, if it waited for masks). step: the engine's number for it (the watchdog's
        reports); previous_tokens: waits for a step's tokens on the host (the engine's, under its watchdog),
        which the masks of constrained sequences need. A step with masks returns with its draw still to
        enqueue (InFlight.drawn): they are filled on a worker thread while the host resolves the step before
        and prepares the next. A decode run (batch.num_steps > 1) enqueues all its steps (_launch_run)."""
        tables, seq_lens = self.block_manager.block_tables_and_seq_lens(list(map(_SEQ_ID, batch.seqs)))
        starts = seq_lens - np.array(batch.num_new_tokens, dtype=np.int64)  # int64 [S]
        if batch.num_steps > 1:
            return self._launch_run(batch, previous, step, starts, tables)
        arrays = self.step_arrays(batch, starts, tables, seq_lens, previous)
        drawing = list(compress(batch.seqs, batch.draws))
        num_sampled = len(drawing)
        arrays |= self._fork_arrays(drawing, batch.forks)
        drawing += [child for fork in batch.forks for child in fork.children]
        segments = self._prompt_segments(batch, starts, len(drawing))
        if previous is not None:
            previous.drawn()
        sampling_arrays, to_sampling, output_index = [], None, None
        if drawing or segments:
            output_index = [len(s.output_token_ids) for s in drawing]  # the index of the token each draws
            sampling_arrays, to_sampling = SamplingTensors.staged(
                list(map(_SAMPLING, drawing)), output_index, self.model.arch.vocab_size, self.eos_token_ids,
                self.history.rows(drawing, previous))
        uploaded = upload_all([*arrays.values(), *sampling_arrays], self.device)
        inputs = dict(zip(arrays, uploaded))
        fill_placeholders(inputs, previous)
        hidden, logits = self.forward(inputs["input_ids"], inputs["positions"], self.attention_metadata(inputs))
        if "block_copies" in inputs:  # after the forward that wrote them, before any later step reads them
            self.kv_cache.copy_blocks(*inputs["block_copies"])
        if to_sampling is None:  # only prefill chunks that end before their prompt does
            return None
        if logits is None:
            logits = self.model.compute_logits(hidden[inputs["sampled_rows"]])[:num_sampled]
        if "logit_rows" in inputs:
            logits = logits[inputs["logit_rows"]]
        params = to_sampling(uploaded[len(arrays):])
        processed = processed_logits(logits, params)
        masks = None
        if any(s.constraint is not None for s in drawing):
            masks = self._start_masks(drawing, output_index, previous, previous_tokens, step)

        def sample() -> "tuple[torch.Tensor, StepInputs, StepLogprobs | None]":
            drawn_from = processed if masks is None else self._masked(processed, logits, step, *masks)
            inputs = StepInputs(step, batch, starts, drawing, drawn_from, params, recorded_event(self.device))
            return self._sample(inputs, logits, hidden, segments)
        step_in_flight = InFlight(drawing, output_index, sample)
        return step_in_flight.drawn() if masks is None else step_in_flight

    def _launch_run(self, batch: ScheduledBatch, previous: "InFlight | None", step: int, starts: np.ndarray,
                    tables: np.ndarray) -> "InFlight":
        """Enqueue a decode run's batch.num_steps steps: step j feeds each row the token step j - 1 drew, at
        position starts + j, with its slot from batch.slot_mapping; a row past its num_new_tokens repeats its
        last position with slot -1 (nothing written, its draws dropped by the engine), so it never reads past
        its own tokens. Every row draws from its own logits with no processor (Sequence.draws_ahead), so the
        draws are those of as many single steps: the noise follows each row's output index. The inputs of all
        the steps go up in one copy; between the steps the host only enqueues (the decode graphs' replays on
        CUDA). The InFlight's tokens are int64 [num_steps, B]."""
        seqs, num_steps = batch.seqs, batch.num_steps
        counts = np.array(batch.num_new_tokens, dtype=np.int64)
        positions = starts + np.minimum(np.arange(num_steps)[:, None], counts - 1)  # int64 [K, B]
        slots = np.full((len(seqs), num_steps), -1, dtype=np.int32)
        slots[np.arange(num_steps) < counts[:, None]] = batch.slot_mapping
        arrays = {"input_ids": np.array([s.last_token for s in seqs], dtype=np.int64), "positions": positions,
                  "seq_lens": (positions + 1).astype(np.int32), "slot_mapping": np.ascontiguousarray(slots.T),
                  "block_tables": tables} | self._decode_layout(tables, (starts + 1).astype(np.int32))
        if previous is not None:
            arrays |= placeholder_rows(previous, seqs, np.arange(len(seqs)), np.ones(len(seqs), dtype=bool))
            previous.drawn()
        output_index = [len(s.output_token_ids) for s in seqs]
        sampling_arrays, to_sampling = SamplingTensors.staged(
            list(map(_SAMPLING, seqs)), output_index, self.model.arch.vocab_size, self.eos_token_ids)
        uploaded = upload_all([*arrays.values(), *sampling_arrays], self.device)
        inputs = dict(zip(arrays, uploaded))
        params = to_sampling(uploaded[len(arrays):])
        fill_placeholders(inputs, previous)
        input_ids = inputs["input_ids"]
        tokens = torch.empty((num_steps, len(seqs)), dtype=torch.int64, device=self.device)
        for j in range(num_steps):
            meta = self.attention_metadata(inputs | {"slot_mapping": inputs["slot_mapping"][j],
                                                     "seq_lens": inputs["seq_lens"][j]})
            hidden, logits = self.forward(input_ids, inputs["positions"][j], meta)
            logits = self.model.compute_logits(hidden) if logits is None else logits
            at_step = params if j == 0 else replace(params, step=params.step + j)
            tokens[j] = draw(logits, at_step, self.sampler_fallbacks, self._gumbel)
            input_ids = tokens[j]
        record = StepInputs(step, batch, starts, seqs, logits, at_step, recorded_event(self.device))
        return InFlight(seqs, output_index, lambda: (tokens, record, None), steps=batch.num_new_tokens).drawn()

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, hidden: torch.Tensor | None,
                segments: list[PromptSegment]) -> "tuple[torch.Tensor, StepInputs, StepLogprobs | None]":
        """Enqueue the draw from the inputs' logits (processed, masked; a decode graph's own logits drawn by its
        draw graph where the sampler is the Gumbel-max one), the penalties' record of it and the logprobs (of the
        raw logits): (tokens int64 [B] on the device, the inputs, the logprobs or None). hidden: None where a
        decode graph ran (no prompt segment then)."""
        params = inputs.sampling
        tokens = draw(inputs.logits, params, self.sampler_fallbacks, self._gumbel)
        if params.penalties is not None:
            self.history.record(params.penalties, tokens)
        asked = [params.num_logprobs] + [s.seq.sampling.prompt_logprobs for s in segments]
        k = max((a for a in asked if a is not None), default=None)
        logprobs = None if k is None else StepLogprobs(self._logprobs(logits, tokens, hidden, segments, k), segments)
        return tokens, inputs, logprobs

    def _gumbel(self, logits, temperature, seed, step) -> torch.Tensor:
        """ops.gumbel_sample's draw, by the decode graphs' draw graph where the logits are their own."""
        tokens = None if self.graphs is None else self.graphs.draw(logits, temperature, seed, step)
        return ops.gumbel_sample(logits, temperature, seed, step) if tokens is None else tokens

    def _start_masks(self, drawing: list[Sequence], output_index: list[int], previous: "InFlight | None",
                     previous_tokens: Callable[["InFlight"], list[int]], step: int
                     ) -> "tuple[list[concurrent.futures.Future], torch.Tensor, torch.Tensor] | None":
        """Start filling the grammar masks of the constrained rows (None when none applies yet): the fills,
        their bitmask int32 [R, W] (pinned on CUDA) and the logits rows it masks (int64 [R] on the device).
        Each matcher first reads the outputs it has not read, one by one (llguidance's parallel
        consume_token_par was slower at every batch size on the H200's host: benchmarks/NOTES.md); the
        newest may be the previous step's, waited for here: this step's forward is enqueued already, so
        the device runs it while the host fills the masks. The rows go in at most FILL_THREADS chunks of
        FILL_CHUNK_ROWS or more, each filled as soon as its matchers have read, while the next chunk's read."""
        rows = [row for row, seq in enumerate(drawing) if seq.constraint is not None]
        known, fills, masked, bitmask = None, [], [], None
        chunk = max(FILL_CHUNK_ROWS, -(-len(rows) // FILL_THREADS))
        for start in range(0, len(rows), chunk):
            pairs = []
            for row in rows[start:start + chunk]:
                seq, end, newest = drawing[row], output_index[row], None
                if end and seq.output_token_ids[end - 1] == PLACEHOLDER:  # drawn in the previous step
                    known = previous_tokens(previous) if known is None else known
                    newest = known[previous.rows[seq.seq_id]]
                seq.constraint.advance(seq.output_token_ids, end, newest)
                if seq.constraint.active:
                    pairs.append((seq.constraint.matcher, len(masked)))
                    masked.append(row)
            if pairs:
                if bitmask is None:
                    bitmask = torch.empty((len(rows) - start, bitmask_words(pairs[0][0].vocab_size)),
                                          dtype=torch.int32, pin_memory=self.device.type == "cuda")
                try:
                    fills.append(start_fill_bitmasks(pairs, bitmask, self.fill_timeout_s))
                except TimeoutError:
                    raise self._stalled_grammar(step, len(rows)) from None
        if not fills:
            return None
        return fills, bitmask[:len(masked)], self._to_device(np.array(masked, dtype=np.int64))

    def _stalled_grammar(self, step: int, rows: int) -> StepTimeout:
        return StepTimeout(f"step {step}: the grammar masks of its {rows} constrained rows were not filled "
                           f"within {self.fill_timeout_s} s (scheduler.step_timeout_s)")

    def _masked(self, processed: torch.Tensor, logits: torch.Tensor, step: int,
                fills: "list[concurrent.futures.Future]", bitmask: torch.Tensor, masked_rows: torch.Tensor
                ) -> torch.Tensor:
        """The processed logits with the masks applied once filled (a copy when they are the logits
        themselves, whose logprobs stay the raw distribution's); StepTimeout if the fills take longer
        than fill_timeout_s. The masks go up in one copy from pinned memory (the caching host allocator
        keeps the buffer until the copy is done) and one kernel applies them to the constrained rows only."""
        try:
            for fill in concurrent.futures.as_completed(fills, timeout=self.fill_timeout_s):
                fill.result()
        except concurrent.futures.TimeoutError:
            raise self._stalled_grammar(step, bitmask.shape[0]) from None
        processed = processed.clone() if processed is logits else processed
        return ops.apply_token_bitmask(processed, bitmask.to(self.device, non_blocking=True), masked_rows)

    @staticmethod
    def _fork_arrays(drawing: list[Sequence], forks: list[Fork]) -> dict[str, np.ndarray]:
        """The host arrays of a step's forked samples, none when nothing was forked: block_copies int64
        [2, K] (the partial blocks to copy, source and destination; when any), and logit_rows int64 [D + F],
        the logits row each sequence that draws takes, the forked samples after the others (a forked
        sample's is its parent's)."""
        if not forks:
            return {}
        arrays = {}
        copies = [pair for fork in forks for pair in fork.copies]
        if copies:
            arrays["block_copies"] = np.array(copies, dtype=np.int64).T
        row_of = {s.seq_id: row for row, s in enumerate(drawing)}
        arrays["logit_rows"] = np.array(list(range(len(drawing))) + [row_of[f.parent.seq_id] for f in forks
                                                                     for _ in f.children], dtype=np.int64)
        return arrays

    @staticmethod
    def _prompt_segments(batch: ScheduledBatch, starts: np.ndarray, num_drawing: int) -> list[PromptSegment]:
        """The rows of the step's prefill chunks that score prompt tokens, for sequences that ask for
        prompt_logprobs (starts: where each chunk begins); a chunk at position 0 has a segment even
        without rows (the first token's None). Segment rows follow the drawing sequences' rows in the
        step's logprobs."""
        asking = [i for i in range(batch.num_decode_seqs, len(batch.seqs))
                  if batch.seqs[i].sampling.prompt_logprobs is not None]
        segments, row = [], num_drawing
        batch_rows = np.cumsum([0] + batch.num_new_tokens[:-1]).tolist() if asking else []
        for i in asking:
            seq, start = batch.seqs[i], int(starts[i])
            length = max(min(start + batch.num_new_tokens[i], len(seq.prompt_token_ids) - 1) - start, 0)
            if length > 0 or start == 0:
                segments.append(PromptSegment(seq, start, row, length, batch_rows[i]))
                row += length
        return segments

    def _logprobs(self, logits, tokens, hidden, segments: list[PromptSegment], k: int) -> torch.Tensor:
        """ops.logprobs of the drawn tokens, then of the prompt tokens that the segments' rows score
        (their logits made PROMPT_ROWS rows at a time)."""
        parts = [ops.logprobs(logits, tokens, k)]
        if any(s.length for s in segments):
            rows = np.concatenate([np.arange(s.batch_row, s.batch_row + s.length) for s in segments])
            targets = np.concatenate([s.seq.prompt_token_ids[s.start + 1:s.start + 1 + s.length] for s in segments])
            rows, targets = self._to_device(rows.astype(np.int64)), self._to_device(targets.astype(np.int64))
            parts += [ops.logprobs(self.model.compute_logits(hidden[rows[i:i + PROMPT_ROWS]]),
                                   targets[i:i + PROMPT_ROWS], k) for i in range(0, rows.shape[0], PROMPT_ROWS)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def placeholder_rows(previous: "InFlight", seqs: list[Sequence], input_rows: np.ndarray,
                     draws: np.ndarray) -> dict[str, np.ndarray]:
    """placeholders int64 [2, P] (input rows, rows of the previous step's device tokens) for the sequences among
    seqs that draw (bool [S]) and whose last token the previous step drew (input_rows int64 [S]: each one's
    last input row); none when there are none."""
    src = np.fromiter(map(previous.rows.get, map(_SEQ_ID, seqs), repeat(-1)), np.int64, len(seqs))
    waiting = np.flatnonzero((src >= 0) & draws)
    return {"placeholders": np.stack([input_rows[waiting], src[waiting]])} if len(waiting) else {}


def fill_placeholders(inputs: dict[str, torch.Tensor], previous: "InFlight | None") -> None:
    """Write into the uploaded input_ids the previous step's device tokens at its placeholders rows (if any)."""
    if "placeholders" in inputs:
        dst, src = inputs["placeholders"]
        inputs["input_ids"][dst] = previous.device_tokens[src]


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """The decode rows by seq_len, longest first, ties in batch order: int32 [Bd]. The decode kernel
    starts its programs in this order, so over mixed lengths its last wave holds the shortest rows
    rather than a long row that happened to come last."""
    return np.argsort(-seq_lens.astype(np.int64), kind="stable").astype(np.int32)


@dataclass
class InFlight:
    """A launched step: the sequences that draw a token in it, and where those tokens are once drawn()."""

    seqs: list[Sequence]  # seqs[i] draws device_tokens[i]
    output_index: list[int]  # where each sequence's (first) token goes in its output_token_ids
    draw: "Callable[[], tuple[torch.Tensor, StepInputs, StepLogprobs | None]] | None"  # None once enqueued
    steps: list[int] | None = None  # a decode run's: the tokens each sequence draws, one a step; None: one
    rows: dict[int, int] = field(init=False)  # seq_id -> row of device_tokens
    device_tokens: torch.Tensor | None = None  # int64 [len(seqs)] (a run's last step's), once drawn
    host_tokens: torch.Tensor | None = None  # int64 [len(seqs)] (a run's [num_steps, len(seqs)]), valid once done()
    inputs: StepInputs | None = None
    logprobs: StepLogprobs | None = None  # its host copy is enqueued before `copied` is recorded
    copied: "torch.cuda.Event | None" = None

    def __post_init__(self):
        self.rows = dict(zip(map(_SEQ_ID, self.seqs), range(len(self.seqs))))

    def drawn(self) -> "InFlight":
        """This step with its draw enqueued, and the copy of its tokens to the host: a step with masks
        enqueues it once they are filled, before the next step's forward (which reads its tokens) or when
        its tokens are read, whichever comes first."""
        if self.draw is not None:
            draw, self.draw = self.draw, None
            with torch.inference_mode():  # launch's tensors are inference tensors, and a draw may come after it
                tokens, self.inputs, self.logprobs = draw()
            self.device_tokens = tokens if self.steps is None else tokens[-1]  # a run's: its last step's
            self.host_tokens, self.copied = to_host(tokens), recorded_event(tokens.device)
        return self

    def done(self) -> bool:
        """Whether the device has computed the step and copied its tokens (and logprobs) to the host (asked
        once drawn())."""
        return self.copied is None or self.copied.query()


def recorded_event(device: torch.device) -> "torch.cuda.Event | None":
    """An event recorded on the current stream now (None on the CPU, where launches run as they return)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def trial_layout(num_tokens: int, num_seqs: int, block_size: int) -> tuple[np.ndarray, ...]:
    """The KV pool's trial step: num_tokens prompt tokens in num_seqs sequences of near-equal lengths, each in
    blocks of its own after the one before's -> int32 (lengths [S], block_tables [S, most blocks] (-1 past a
    sequence's), slot_mapping [T]) and int64 positions [T]."""
    counts = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
    counts[: num_tokens % num_seqs] += 1
    blocks = -(-counts // block_size)
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    positions = np.arange(num_tokens) - np.repeat(np.cumsum(counts) - counts, counts)
    columns = np.arange(int(blocks.max()))
    tables = np.where(columns < blocks[:, None], first_block[:, None] + columns, -1).astype(np.int32)
    slots = (np.repeat(first_block, counts) * block_size + positions).astype(np.int32)
    return counts, tables, slots, positions


def trial_step(model: DecoderForCausalLM, cache: PagedKVCache, num_tokens: int, num_seqs: int, device) -> None:
    """The forward of trial_layout(num_tokens, num_seqs, the cache's block size) in cache (token ids 0), and
    the logits of num_seqs rows."""
    counts, tables, slots, positions = trial_layout(num_tokens, num_seqs, cache.block_size)
    cu_seqlens = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    no_decodes = torch.zeros(0, dtype=torch.int32, device=device)
    meta = AttentionMetadata(torch.from_numpy(slots).to(device), no_decodes.reshape(0, tables.shape[1]), no_decodes,
                             PrefillMetadata(torch.from_numpy(tables).to(device), torch.from_numpy(counts).to(device),
                                             torch.from_numpy(cu_seqlens).to(device)))
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(input_ids, torch.from_numpy(positions).to(device), cache, meta)
    model.compute_logits(hidden[:num_seqs].contiguous())


@torch.inference_mode()
def kv_bytes_left(model: DecoderForCausalLM, device, utilization: float, max_tokens: int, max_seqs: int,
                  block_size: int, kv_dtype: torch.dtype, compiles: CompilePool | None = None) -> int:
    """Device memory left for KV blocks: utilization * total, minus the peak of a trial step at the largest
    token budget (weights, activations, logits of max_seqs rows). Its cache has the run's block size and
    dtype, so that the kernels it compiles are the run's (a block size is a compiled constant); compiles: a
    dry pass first of two sequences of the trial's length (its kernels' variants in a few launches), so that
    they compile side by side (engine/kernel_compiles.py)."""
    num_seqs = min(max_seqs, max_tokens)
    _, tables, _, _ = trial_layout(max_tokens, num_seqs, block_size)
    torch.cuda.empty_cache()
    warm_cache = PagedKVCache(model.kv_cache_spec, int(tables.max()) + 1, block_size, kv_dtype, device)
    if compiles is not None:
        with compiles.ahead():
            trial_step(model, warm_cache, 2 * -(-max_tokens // num_seqs), 2, device)
    torch.cuda.reset_peak_memory_stats(device)  # the peak from here on: the warm cache, allocated, counts in it
    trial_step(model, warm_cache, max_tokens, num_seqs, device)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - warm_cache.bytes
    del warm_cache
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    return max(int(total * utilization) - peak, 0)

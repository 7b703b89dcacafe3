"""One scheduling loop for prefill and decode, over the block manager.

Each step spends a token budget (max_num_batched_tokens): one token for every running sequence that
decodes, then chunks of the sequences still being prefilled (continuing chunks first, in admission
order), then new admissions, first come first served. So no step runs prefill alone while admitted
sequences wait to decode, unless the budget is full of decodes. A batch lists its decode rows first
(engine/attention.py routes them to the decode kernel) and its prefill chunks after. With
order_decodes_by_prefix (cascade attention) the decode rows are sorted by the physical id of their first
block (stably), so sequences that share a prefix of blocks are adjacent (engine/prefix_groups.py).

While sequences decode, new ones are admitted a batch at a time: only once admission_batch
(max_num_seqs // 8) sequence slots are free, or the waiting queue is shorter than that. A step with
prefill chunks cannot replay a decode CUDA graph, and its eager forward costs the host ~20 ms whatever
its size (H200, Qwen3-0.6B: benchmarks/NOTES.md), so one such step for many admissions beats one for each.

A decode-only batch can become a run of several device steps (extend_decodes: the engine asks, when every row
draws on the device alone and nothing waits): each row's slots for up to num_steps tokens are allocated at
once, all or nothing, and the rows decode one token a step without the host in between.

A sequence's tokens count as computed once their slots are allocated (Sequence.num_computed_tokens
reads the block manager's sequence_length), so a batch's rows are past their chunks when it is built.

Admission: a waiting sequence takes the longest run of its full blocks that the prefix cache holds
(never its last token, whose logits are needed: KVBlockManager.cached_prefix), and is admitted when
the rest of it fits in the free blocks (cached blocks count as free), the budget has room for (a chunk
of) it and fewer than max_num_seqs sequences run. With admission_headroom H > 0 the free blocks must also
cover, besides, what every running sequence and every one admitted before it in the step needs to reach
min(its tokens + H, its max_num_tokens) (its held samples: their growth and a partial block's copy each), so
that admissions do not fill the pool and leave the running rows to preempt one another as they grow; with
nothing running, a sequence is admitted on its tokens alone (a pool of one max_model_len must progress).
When a decoding sequence needs a block and none is
free, the newest running sequence is preempted by recompute: its blocks are released (those holding a
hash stay cached, so the recompute usually hits them) and it waits, first in line, to be prefilled again
from its prompt and the outputs it already has. A step that preempted admits nothing, so a victim is not re-admitted at once.

The other samples of a request (n > 1) are held by its first until the step that computes the first's
last prompt chunk, and forked from it then (ScheduledBatch.forks): they share its table, with a copy of
its partial last block, draw their first token from its logits row and decode from the next step. When
the pool has no block for the copies, or max_num_seqs no room for them, they are queued first in line
instead, to take the prompt's full blocks from the prefix cache.
"""
import contextlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.block_manager import KVBlockManager, OutOfBlocksError, blocks_needed
from engine.sequence import Sequence, Status


@dataclass
class Fork:
    """Samples forked from `parent` in a step that computes the parent's last prompt chunk: they are
    running, their block tables holding its prompt, and draw their first token from its logits.
    copies: (parent's block, child's block) for the partial last block, to copy on the device after
    the step's forward has written it."""

    parent: Sequence
    children: list[Sequence]
    copies: list[tuple[int, int]]


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decode rows first, then prefill chunks
    num_new_tokens: list[int]  # tokens each sequence computes in this step
    slot_mapping: np.ndarray  # int32 [sum(num_new_tokens)]
    num_decode_seqs: int  # the leading sequences that decode (one token each)
    num_preempted: int = 0
    prefix_cache_hit_tokens: int = 0  # tokens the admissions of this step found in the prefix cache
    admitted_tokens: int = 0  # tokens (prompt + earlier outputs) of the sequences admitted in this step
    forks: list[Fork] = field(default_factory=list)  # samples that join in this step, past their prefill
    num_steps: int = 1  # device steps: > 1 for a decode run (Scheduler.extend_decodes), row i decoding one
    # token a step for its first num_new_tokens[i] steps
    draws: list[bool] = field(init=False)

    def __post_init__(self):
        # which sequences draw a token in this step: those whose chunk (computed once allocated) reaches their
        # last token, as every decode row's does
        self.draws = [True] * self.num_decode_seqs + [s.num_uncomputed_tokens == 0
                                                      for s in self.seqs[self.num_decode_seqs:]]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_new_tokens[self.num_decode_seqs:])

    @property
    def phase(self) -> str:
        if self.num_decode_seqs == len(self.seqs):
            return "decode"
        return "prefill" if self.num_decode_seqs == 0 else "mixed"


class Scheduler:
    def __init__(self, block_manager: KVBlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 order_decodes_by_prefix: bool = False, admission_headroom: int = 0):
        self.block_manager = block_manager
        self.order_decodes_by_prefix = order_decodes_by_prefix
        self.admission_headroom = admission_headroom
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission_batch = max(1, max_num_seqs // 8)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_first(self, seqs: list[Sequence]) -> None:
        """Queue seqs first in line, in their order (the other samples of a request being prefilled)."""
        self.waiting.extendleft(reversed(seqs))

    def is_saturated(self) -> bool:
        """Whether the next step's admissions are decided whatever joins the back of the queue: it admits
        at most max_num_seqs sequences, first come first served, so a caller that queues more only
        while this is False gets the schedule it would get by queueing everything first."""
        return len(self.waiting) >= self.max_num_seqs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The next step's batch; empty when nothing can run until in-flight tokens are resolved."""
        preemptions_before = self.num_preemptions
        while True:
            batch = self._schedule_step(preemptions_before)
            if batch.seqs or not any(s.num_uncomputed_tokens > 1 for s in self.running):
                batch.forks = self._fork_held_samples(batch)
                return batch
            self._preempt(self._victim())  # only stalled prefill chunks are left: free the newest

    def _schedule_step(self, preemptions_before: int) -> ScheduledBatch:
        decoding, prefilling = self._partition_running()
        seqs, counts, slots = self._schedule_decodes(decoding)
        num_decodes = len(seqs)
        budget = self.max_num_batched_tokens - num_decodes
        budget = self._schedule_chunks(budget, prefilling, seqs, counts, slots)
        hits = admitted = 0
        if self.num_preemptions == preemptions_before:
            hits, admitted = self._admit(budget, seqs, counts, slots)
        return ScheduledBatch(seqs, counts, _concat(slots), num_decodes, self.num_preemptions - preemptions_before,
                              hits, admitted)

    def extend_decodes(self, batch: ScheduledBatch, num_steps: int) -> None:
        """Make a decode-only batch a run of up to num_steps device steps: row i decodes min(num_steps, the
        tokens it may still draw) tokens, one a step, their slots allocated now; slot_mapping holds them row
        after row. A run takes no block that a single step would leave to admissions or other rows: when the
        pool is short, the batch stays one step (nothing is preempted for a run)."""
        seqs = batch.seqs
        left = np.fromiter((s.max_num_tokens - s.num_tokens for s in seqs), np.int64, len(seqs))
        counts = np.minimum(left, num_steps)  # >= 1: a decoding row is not capped
        if len(seqs) == 0 or counts.max() < 2:
            return
        try:
            more = self.block_manager.slot_mapping_for_append([s.seq_id for s in seqs], counts - 1)
        except OutOfBlocksError:
            return
        more_starts = np.cumsum(counts - 1) - (counts - 1)  # where each row's further slots begin in `more`
        batch.slot_mapping = np.insert(more, more_starts, batch.slot_mapping)  # each row's first slot, then its more
        batch.num_new_tokens, batch.num_steps = counts.tolist(), int(counts.max())

    def _fork_held_samples(self, batch: ScheduledBatch) -> list[Fork]:
        """Fork the held samples of each sequence that draws its first token in this batch (all of a
        request's or none); queue them first in line where they do not fit."""
        forks = []
        for seq, draws in zip(batch.seqs, batch.draws):
            if not (draws and seq.held_samples):
                continue
            children, seq.held_samples, copies = seq.held_samples, [], None
            if len(self.running) + len(children) <= self.max_num_seqs:
                with contextlib.suppress(OutOfBlocksError):
                    copies = self.block_manager.fork(seq.seq_id, [c.seq_id for c in children])
            if copies is None:
                self.add_first(children)
                continue
            for child in children:
                child.status, child.block_state = Status.RUNNING, self.block_manager.state(child.seq_id)
                self.running.append(child)
            forks.append(Fork(seq, children, copies))
        return forks

    def _victim(self) -> Sequence:
        """The newest running sequence that still draws tokens (a capped one frees its blocks when its
        last token is resolved)."""
        return next(s for s in reversed(self.running) if not s.is_capped)

    def _partition_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that decode (their next token is their only uncomputed one, and they may
        draw it) and those still prefilling, in running order: one pass over the properties."""
        decoding, prefilling = [], []
        for seq in self.running:  # the properties' arithmetic inlined: this runs for every row of every step
            num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            left = num_tokens - seq.block_state.sequence_length  # a running sequence has its block state
            if left == 1:
                if num_tokens < seq.max_num_tokens:  # not is_capped
                    decoding.append(seq)
            elif left > 1:
                prefilling.append(seq)
        return decoding, prefilling

    def _schedule_decodes(self, pending: list[Sequence]) -> tuple[list[Sequence], list[int], list[np.ndarray]]:
        """One slot for each decoding sequence, oldest first; where the pool is short, preempts the newest
        running sequences until the next one fits (never one already scheduled: they are older).
        Allocates a run of fitting sequences at a time."""
        manager, scheduled, slots = self.block_manager, [], []
        while pending:
            ids = [s.seq_id for s in pending]
            try:  # the common case: the pool has a block for each that needs one
                slots.append(manager.slot_mapping_for_append(ids))
                scheduled += pending
                break
            except OutOfBlocksError:
                fit = manager.num_appendable(ids)
            scheduled += pending[:fit]
            slots.append(manager.slot_mapping_for_append(ids[:fit]))
            victim = self._victim()  # pending[fit] needs a block and none is left
            self._preempt(victim)
            pending = [s for s in pending[fit:] if s is not victim]
        slots = _concat(slots)
        if self.order_decodes_by_prefix and len(scheduled) > 1:  # after allocating, which must go oldest first
            order = np.argsort([s.block_state.block_table[0] for s in scheduled], kind="stable")
            scheduled, slots = [scheduled[i] for i in order.tolist()], slots[order]
        return scheduled, [1] * len(scheduled), [slots]

    def _schedule_chunks(self, budget: int, prefilling: list, seqs: list, counts: list, slots: list) -> int:
        """Continuing prefill chunks, in admission order, while the budget and the pool allow (a sequence
        preempted for the decodes of this step no longer runs)."""
        manager = self.block_manager
        for seq in (s for s in prefilling if s.status is Status.RUNNING):
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0 or not manager.can_append(seq.seq_id, n):
                break
            self._add_chunk(seq, n, seqs, counts, slots)
            budget -= n
        return budget

    def _admit(self, budget: int, seqs: list, counts: list, slots: list) -> tuple[int, int]:
        """New admissions, first come first served; returns (prefix-cache hit tokens, admitted tokens)."""
        manager, hits, admitted = self.block_manager, 0, 0
        free_slots = self.max_num_seqs - len(self.running)
        if self.running and free_slots < min(self.admission_batch, len(self.waiting)):
            return hits, admitted
        reserved = None  # the running rows' headroom, summed once the first in line fits without it
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = manager.cached_prefix(seq, seq.held_samples)
            if not manager.can_admit(seq.num_tokens, prefix):
                break
            if self.admission_headroom:
                reserved = self._headroom_blocks() if reserved is None else reserved
                growth = self._growth_blocks(seq)
                if self.running and not manager.can_admit(seq.num_tokens, prefix, reserved + growth):
                    break
                reserved += growth
            seq.block_state = manager.create_sequence(seq.seq_id, prefix)
            hits += seq.num_computed_tokens
            admitted += seq.num_tokens
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            n = min(seq.num_uncomputed_tokens, budget)
            self._add_chunk(seq, n, seqs, counts, slots)
            budget -= n
        return hits, admitted

    def _headroom_blocks(self) -> int:
        """Blocks the running sequences still need to hold their uncomputed tokens and admission_headroom
        tokens more (each at most its max_num_tokens), beyond the blocks they hold."""
        bs, headroom = self.block_manager.block_size, self.admission_headroom
        return sum(max(0, blocks_needed(min(s.max_num_tokens, s.num_tokens + headroom), bs)
                       - len(s.block_state.block_table)) for s in self.running)

    def _growth_blocks(self, seq: Sequence) -> int:
        """Blocks a waiting sequence takes beyond its tokens' to grow by admission_headroom tokens, with its held
        samples' (each, once forked, the same growth and a copy of the partial last block)."""
        bs, headroom = self.block_manager.block_size, self.admission_headroom
        own = blocks_needed(min(seq.max_num_tokens, seq.num_tokens + headroom), bs) - blocks_needed(seq.num_tokens, bs)
        return own + len(seq.held_samples) * (own + 1)

    def _add_chunk(self, seq: Sequence, n: int, seqs: list, counts: list, slots: list) -> None:
        seqs.append(seq), counts.append(n), slots.append(self.block_manager.append_tokens(seq.seq_id, n))
        self.block_manager.register_full_blocks(seq.seq_id, seq.block_hashes)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release_sequence(seq.seq_id)
        seq.status, seq.block_state = Status.WAITING, None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence, running or (preempted) waiting, and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.release_sequence(seq.seq_id)
        else:
            self.waiting.remove(seq)
        seq.status, seq.block_state, seq.finish_reason = Status.FINISHED, None, reason

    def abort_all(self) -> None:
        """Retire every queued and running sequence (finish_reason "abort") and free every sequence's blocks,
        whatever step was stopped half-way: the block manager's sequences are released, not the running
        list's, which such a step may have left out of step with them."""
        for seq in (*self.running, *self.waiting):
            seq.status, seq.block_state, seq.finish_reason = Status.FINISHED, None, "abort"
        self.running.clear()
        self.waiting.clear()
        for seq_id in list(self.block_manager.sequences):
            self.block_manager.release_sequence(seq_id)


def _concat(slots: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(slots) if slots else np.zeros(0, dtype=np.int32)

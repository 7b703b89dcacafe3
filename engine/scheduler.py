"""Admission, batching and preemption over the block manager.

Every step is either a prefill step (chunks of prompts, under the token budget) or a decode step
(one token for each running sequence). Admission is first come, first served: a waiting sequence is
admitted when its whole prompt fits in the free blocks, the step's token budget has room for (a
chunk of) it and fewer than max_num_seqs sequences run. A finished sequence frees its blocks at
once. When a decoding sequence needs a block and none is free, the newest running sequence is
preempted by recompute: its blocks are freed and it waits, first in line, to be prefilled again from
its prompt and the outputs it already has.
"""
from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.block_manager import KVBlockManager, blocks_needed
from engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes in this step
    slot_mapping: np.ndarray  # int32 [sum(num_new_tokens)]
    is_prefill: bool
    num_preempted: int = 0

    def __post_init__(self):
        # which sequences draw a token in this step: their chunk reaches their last token
        self.draws = [n == s.num_uncomputed_tokens for s, n in zip(self.seqs, self.num_new_tokens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: KVBlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The next step's batch; empty when nothing can run until in-flight tokens are resolved."""
        preemptions_before = self.num_preemptions
        while True:
            batch = self._schedule_prefill()
            if not batch.seqs:
                batch = self._schedule_decode()
            stalled = [s for s in self.running if s.num_uncomputed_tokens > 1]
            if batch.seqs or not stalled:
                batch.num_preempted = self.num_preemptions - preemptions_before
                return batch
            self._preempt(self._victim())  # only stalled prefill chunks are left: free the newest

    def _victim(self) -> Sequence:
        """The newest running sequence that still draws tokens (a capped one frees its blocks when its
        last token is resolved)."""
        return next(s for s in reversed(self.running) if not s.is_capped)

    def _schedule_prefill(self) -> ScheduledBatch:
        seqs, counts, slots, budget = [], [], [], self.max_num_batched_tokens
        manager = self.block_manager
        for seq in (s for s in self.running if s.num_uncomputed_tokens > 1):
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0 or not manager.can_append(seq.seq_id, n):
                break
            seqs.append(seq), counts.append(n), slots.append(manager.append_tokens(seq.seq_id, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if blocks_needed(seq.num_tokens, manager.block_size) > manager.num_free_blocks:
                break
            n = min(seq.num_tokens, budget)
            manager.create_sequence(seq.seq_id)
            seqs.append(seq), counts.append(n), slots.append(manager.append_tokens(seq.seq_id, n))
            budget -= n
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
        return ScheduledBatch(seqs, counts, _concat(slots), is_prefill=True)

    def _schedule_decode(self) -> ScheduledBatch:
        manager, scheduled, slots = self.block_manager, [], []
        pending = deque(s for s in self.running if s.num_uncomputed_tokens == 1 and not s.is_capped)
        while pending:
            seq = pending.popleft()
            while not manager.can_append(seq.seq_id, 1):
                victim = self._victim()  # newest first; never one already scheduled
                self._preempt(victim)
                if victim is seq:
                    break
                if victim in pending:
                    pending.remove(victim)
            else:
                scheduled.append(seq)
                slots.append(manager.append_token(seq.seq_id))
        return ScheduledBatch(scheduled, [1] * len(scheduled), np.array(slots, dtype=np.int32), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release_sequence(seq.seq_id)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
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
        seq.status, seq.finish_reason = Status.FINISHED, reason


def _concat(slots: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(slots) if slots else np.zeros(0, dtype=np.int32)

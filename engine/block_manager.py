"""The CPU metadata plane: a pool of fixed-size KV blocks and the block table of every live sequence.

Address map (DESIGN.md): for token position p of a sequence with block table T and block size B,
    slot = T[p // B] * B + p % B.

Invariants (checked by invariants_ok):
  * allocated = union of all live block tables; allocated and free are disjoint;
    |allocated| + |free| = num_physical_blocks; no block appears twice.
  * len(block_table) == ceil(sequence_length / block_size) for every live sequence.
  * once every sequence is released, every block is free again.
Every public method either completes or raises before changing anything, so the pool is never
left half-updated.
"""
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class OutOfBlocksError(BlockManagerError):
    """Not enough free blocks for the request; nothing was changed."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """The sequence id is not live (never created, or already released)."""


class DuplicateSequenceError(BlockManagerError):
    """create_sequence was called with an id that is already live."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def internal_waste(sequence_length: int, block_size: int) -> int:
    """Unused slots in the last block of a sequence of this length: 0 if L % B == 0 else B - L % B."""
    return -sequence_length % block_size


@dataclass
class SequenceState:
    """Block-level state of one live sequence: its length in stored tokens and its block table."""

    sequence_id: int
    sequence_length: int = 0
    block_table: list[int] = field(default_factory=list)


class KVBlockManager:
    def __init__(self, num_physical_blocks: int, block_size: int):
        if num_physical_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_physical_blocks >= 1 and block_size >= 1, got {num_physical_blocks}, {block_size}")
        self.num_physical_blocks = num_physical_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_physical_blocks))
        self.sequences: dict[int, SequenceState] = {}

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_physical_blocks - len(self.free_blocks)

    def state(self, sequence_id: int) -> SequenceState:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {sequence_id} is not live") from None

    def new_blocks_for(self, sequence_id: int, num_tokens: int) -> int:
        """Blocks that appending num_tokens to this sequence would take from the pool."""
        state = self.state(sequence_id)
        return blocks_needed(state.sequence_length + num_tokens, self.block_size) - len(state.block_table)

    def can_append(self, sequence_id: int, num_tokens: int) -> bool:
        return self.new_blocks_for(sequence_id, num_tokens) <= len(self.free_blocks)

    def stored_tokens(self) -> int:
        return sum(s.sequence_length for s in self.sequences.values())

    def internal_fragmentation_tokens(self) -> int:
        """Allocated but unused slots, summed over live sequences (each wastes part of its last block)."""
        return sum(internal_waste(s.sequence_length, self.block_size) for s in self.sequences.values())

    # -- lifecycle -------------------------------------------------------------------------
    def create_sequence(self, sequence_id: int) -> SequenceState:
        if sequence_id in self.sequences:
            raise DuplicateSequenceError(f"sequence {sequence_id} is already live")
        state = self.sequences[sequence_id] = SequenceState(sequence_id)
        return state

    def allocate_block(self) -> int:
        if not self.free_blocks:
            raise OutOfBlocksError("no free KV block left in the pool")
        return self.free_blocks.popleft()

    def append_token(self, sequence_id: int) -> int:
        """Store one more token for this sequence; returns its slot (the decode path: plain Python)."""
        state = self.state(sequence_id)
        pos = state.sequence_length
        if pos == len(state.block_table) * self.block_size:
            state.block_table.append(self.allocate_block())
        state.sequence_length = pos + 1
        return state.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def append_tokens(self, sequence_id: int, num_tokens: int) -> np.ndarray:
        """Store num_tokens more tokens for this sequence, allocating blocks as boundaries are crossed.

        Returns their slots (int32 [num_tokens]). Raises OutOfBlocksError, changing nothing, when
        the pool cannot hold them.
        """
        state = self.state(sequence_id)
        missing = self.new_blocks_for(sequence_id, num_tokens)
        if missing > len(self.free_blocks):
            raise OutOfBlocksError(
                f"sequence {sequence_id} needs {missing} more blocks, {len(self.free_blocks)} free"
            )
        state.block_table.extend(self.allocate_block() for _ in range(missing))
        positions = np.arange(state.sequence_length, state.sequence_length + num_tokens)
        state.sequence_length += num_tokens
        table = np.asarray(state.block_table, dtype=np.int64)
        return (table[positions // self.block_size] * self.block_size + positions % self.block_size).astype(np.int32)

    def slot_mapping_for_append(self, sequence_ids: list[int], num_tokens: list[int] | None = None) -> np.ndarray:
        """Slots of the new tokens of a batch (one each for decode, several each for prefill), concatenated.

        All or nothing: if the batch does not fit, OutOfBlocksError is raised before any change.
        """
        counts = num_tokens if num_tokens is not None else [1] * len(sequence_ids)
        needed = sum(self.new_blocks_for(s, n) for s, n in zip(sequence_ids, counts))
        if needed > len(self.free_blocks):
            raise OutOfBlocksError(f"the batch needs {needed} more blocks, {len(self.free_blocks)} free")
        if not sequence_ids:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([self.append_tokens(s, n) for s, n in zip(sequence_ids, counts)])

    def release_sequence(self, sequence_id: int) -> None:
        """Return every block of the sequence to the free list and forget it."""
        state = self.state(sequence_id)
        self.free_blocks.extend(state.block_table)
        del self.sequences[sequence_id]

    # -- tensors for the data plane ----------------------------------------------------------
    def get_block_table_tensor(self, sequence_ids: list[int], width: int | None = None) -> torch.Tensor:
        """block_tables [len(sequence_ids), width] int32, padded with -1."""
        tables = [self.state(s).block_table for s in sequence_ids]
        width = max((len(t) for t in tables), default=0) if width is None else width
        out = np.full((len(tables), width), -1, dtype=np.int32)
        for row, table in zip(out, tables):
            row[: len(table)] = table
        return torch.from_numpy(out)

    def get_seq_lens_tensor(self, sequence_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.state(s).sequence_length for s in sequence_ids], dtype=torch.int32)

    # -- checks ------------------------------------------------------------------------------
    def invariants_ok(self) -> bool:
        allocated = [b for s in self.sequences.values() for b in s.block_table]
        free = list(self.free_blocks)
        return (
            len(allocated) == len(set(allocated))
            and len(free) == len(set(free))
            and not set(allocated) & set(free)
            and len(allocated) + len(free) == self.num_physical_blocks
            and all(0 <= b < self.num_physical_blocks for b in allocated + free)
            and all(
                len(s.block_table) == blocks_needed(s.sequence_length, self.block_size)
                for s in self.sequences.values()
            )
        )

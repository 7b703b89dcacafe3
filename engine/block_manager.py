"""The CPU metadata plane: a pool of fixed-size KV blocks, the block table of every live sequence and
the prefix cache that lets sequences share the blocks of a common prompt prefix.

Address map (docs/design.md): for token position p of a sequence with block table T and block size B,
    slot = T[p // B] * B + p % B.
Worked example: B = 4, T = [5, 2, 9, 1]; position 6 is in logical block 1 at offset 2, physical
block 2, so slot 2 * 4 + 2 = 10.

Prefix caching: a full block is named by the 128-bit blake2b of its parent block's hash (none for a
sequence's first block) then its token ids as little-endian int64 (extend_block_hashes): chained over
the sequence, so equal hashes mean equal whole prefixes. cached_block_of maps a
hash to the one block holding it. A block's reference count is the number of live block tables that
hold it; a block released to ref 0 keeps its hash (cached, evictable) and is reused by the next
sequence whose prompt hits it. Allocation takes free blocks first and evicts the least recently used
cached block only when none are left.

Where the hashes live: on each sequence (Sequence.block_hashes, its logical blocks' from block 0), not
in its SequenceState; only this manager computes, matches and registers them (hash_known_blocks,
cached_prefix, register_full_blocks, register_known_blocks). On the sequence, because a sequence is
matched while it waits, when this manager holds no state for it (before its first admission, and after
a preemption, when its own blocks are usually still cached), and the n samples of a prompt share its
hashes: so each full block is hashed once, when the host learns its last token id (a prompt's when
the scheduler first considers it for admission, a decode token's one step after its slot is allocated),
and the hashes survive a preemption. Kept here, they would go
with the state at a preemption, and a waiting prompt would be hashed again at each admission attempt.
A prompt takes the hashes of the full blocks it shares with the prompt hashed before it
(RecentPromptHashes) and hashes only the rest.
The methods that take a seq read only its block_hashes, token ids and scores_prompt; this module does
not import engine/sequence.py, which imports it (for SequenceState).

Forking (the n samples of one prompt): a new table shares every full block of its parent's (ref + 1),
with or without prefix caching, and takes a private block for the parent's partial last block, whose
K/V the caller copies on the device (copy-on-write done at the fork: the last block is the one that
both would write next).

Invariants (checked by invariants_ok):
  * the pool is partitioned: free (ref 0, no hash) + cached (ref 0, a hash, in LRU order)
    + referenced (ref > 0) = range(num_physical_blocks), each block in exactly one part.
  * ref_counts[b] == the number of live block tables holding b; no table holds a block twice.
  * cached_block_of maps each hash to a block holding exactly that hash, and every block holding a
    hash is in it (so no two blocks hold the same hash).
  * len(block_table) == ceil(sequence_length / block_size) for every live sequence; sequence_length
    is the one count of its stored tokens (a Sequence's num_computed_tokens reads it). Only its first
    num_hashed_blocks blocks, all full, can hold a hash (prefix blocks and registered full blocks).
  * a block held by two tables is full in each: prefix hits and forks share only full blocks, so
    every partial block is one sequence's own last block.
  * once every sequence is released, no block is referenced: each is free or cached.
  * table_rows[state.row] holds each live sequence's block table, then -1; every other row is all -1
    (the data plane's block_tables are one gather of these rows: block_tables_and_seq_lens).
Every public method either completes or raises before changing anything, so the pool is never
left half-updated.
"""
import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch

HASH_BYTES = 16  # 128 bits: two different prefixes do not share KV by collision


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class OutOfBlocksError(BlockManagerError):
    """Not enough free or evictable blocks for the request; nothing was changed."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """The sequence id is not live (never created, or already released)."""


class DuplicateSequenceError(BlockManagerError):
    """create_sequence was called with an id that is already live."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def internal_waste(sequence_length: int, block_size: int) -> int:
    """Unused slots in the last block of a sequence of this length: 0 if L % B == 0 else B - L % B."""
    return -sequence_length % block_size


def extend_block_hashes(hashes: list[bytes], new_token_ids, block_size: int) -> list[bytes]:
    """Append to hashes (in place; also returned) the chained hashes of the full blocks that follow
    them: blake2b-128 of the previous hash (b"" for the first block) then the block's ids as little-endian
    int64. new_token_ids are a sequence's known tokens (prompt and resolved outputs) from position
    len(hashes) * block_size on; a partial block at their end is left for a later call."""
    packed, width = np.asarray(new_token_ids, dtype="<i8").tobytes(), 8 * block_size  # one conversion, sliced
    parent = hashes[-1] if hashes else b""
    for start in range(0, len(packed) - width + 1, width):
        parent = hashlib.blake2b(parent + packed[start:start + width], digest_size=HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


def leading_equal_blocks(a: list[int], b: list[int], block_size: int, limit: int) -> int:
    """How many leading full blocks (at most `limit`) two token lists agree on: the first block alone, then
    one slice comparison when they agree on all, else a bisection over slices (about twice the tokens)."""
    agree, disagree = 0, min(limit, len(a) // block_size, len(b) // block_size)
    if disagree == 0 or a[:block_size] != b[:block_size]:
        return 0
    if a[:disagree * block_size] == b[:disagree * block_size]:
        return disagree
    while disagree - agree > 1:  # a and b agree on blocks [0, agree) and differ within [0, disagree)
        mid = (agree + disagree) // 2
        if a[agree * block_size:mid * block_size] == b[agree * block_size:mid * block_size]:
            agree = mid
        else:
            disagree = mid
    return agree


class RecentPromptHashes:
    """The token ids and block hashes of the last sequence hashed from its first block. A block's hash
    names the whole prefix up to its end, so the next sequence that begins with the same full blocks (a
    shared system prompt or few-shot block, the rows of a shared-prefix batch) takes their hashes as they
    are and hashes only the blocks after them. Invariant: len(hashes) == len(token_ids) // block_size."""

    def __init__(self, block_size: int):
        self.block_size, self.token_ids, self.hashes = block_size, [], []

    def hashes_of(self, token_ids: list[int]) -> list[bytes]:
        """extend_block_hashes([], token_ids, block_size), reusing the blocks shared with the last call's: the
        memo's own list, to be copied, not changed."""
        shared = leading_equal_blocks(token_ids, self.token_ids, self.block_size, len(self.hashes))
        self.hashes = extend_block_hashes(self.hashes[:shared], token_ids[shared * self.block_size:], self.block_size)
        self.token_ids = token_ids
        return self.hashes


@dataclass
class SequenceState:
    """Block-level state of one live sequence: its length in stored tokens (the one count of them: a
    Sequence's num_computed_tokens reads it), its block table, and how many leading blocks of the table
    have been through the prefix cache (taken from it at creation or offered to it by
    register_full_blocks)."""

    sequence_id: int
    sequence_length: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    row: int = -1  # its row of KVBlockManager.table_rows


_LENGTH, _ROW, _TABLE = attrgetter("sequence_length"), attrgetter("row"), attrgetter("block_table")


def new_token_positions(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Positions of a batch's new tokens, sequence after sequence: starts[i] .. starts[i] + counts[i] - 1
    for sequence i (int64 [sum(counts)])."""
    first = np.cumsum(counts) - counts  # each sequence's first new token in the batch
    return np.arange(int(counts.sum())) - np.repeat(first - starts, counts)


class KVBlockManager:
    def __init__(self, num_physical_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_physical_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_physical_blocks >= 1 and block_size >= 1, got {num_physical_blocks}, {block_size}")
        self.num_physical_blocks = num_physical_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_physical_blocks))  # ref 0, no hash
        self.cached_blocks: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash; least recently used first
        self.ref_counts: list[int] = [0] * num_physical_blocks
        self.block_hash: list[bytes | None] = [None] * num_physical_blocks
        self.cached_block_of: dict[bytes, int] = {}
        self.recent_prompt = RecentPromptHashes(block_size)  # hashing's memo: a prompt's blocks shared with the last one
        self.sequences: dict[int, SequenceState] = {}
        # every live block table as a numpy row, -1 padded (grown by doubling): block_tables are one gather
        self.table_rows = np.full((0, 0), -1, dtype=np.int32)
        self._free_rows: list[int] = []

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.cached_blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable cached blocks: ref 0, holding a hash."""
        return len(self.cached_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one live block table, each counted once."""
        return self.num_physical_blocks - self.num_free_blocks

    def state(self, sequence_id: int) -> SequenceState:
        try:
            return self.sequences[sequence_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {sequence_id} is not live") from None

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Physical blocks of the longest leading run of hashes in the cache index (read-only)."""
        if not self.enable_prefix_caching:
            return []
        blocks = list(map(self.cached_block_of.get, hashes))  # one C loop; a shared prompt has hundreds
        return blocks[:blocks.index(None)] if None in blocks else blocks

    def cached_prefix(self, seq, samples=()) -> list[int]:
        """The cached blocks an admission of seq starts with: match_prefix of its hashes, short of the
        block of its last token (whose logits are needed, so it is computed). Hashes its known full
        blocks first (hash_known_blocks, with `samples`), so a prompt is hashed when it is first
        considered for admission: in the step loop, while the device runs the step before."""
        self.hash_known_blocks(seq, *samples)
        return self.match_prefix(seq.block_hashes[: (seq.num_tokens - 1) // self.block_size])

    def can_admit(self, num_tokens: int, prefix_blocks, reserved: int = 0) -> bool:
        """Whether a new sequence of num_tokens tokens starting with prefix_blocks would fit, with `reserved`
        blocks left free besides."""
        taken_from_cache = list(map(self.ref_counts.__getitem__, prefix_blocks)).count(0)
        new_blocks = blocks_needed(num_tokens, self.block_size) - len(prefix_blocks)
        return new_blocks + reserved <= self.num_free_blocks - taken_from_cache

    def new_blocks_for(self, sequence_id: int, num_tokens: int) -> int:
        """Blocks that appending num_tokens to this sequence would take from the pool."""
        state = self.state(sequence_id)
        return blocks_needed(state.sequence_length + num_tokens, self.block_size) - len(state.block_table)

    def can_append(self, sequence_id: int, num_tokens: int) -> bool:
        return self.new_blocks_for(sequence_id, num_tokens) <= self.num_free_blocks

    def internal_fragmentation_tokens(self) -> int:
        """Allocated but unused slots, summed over live sequences (each wastes part of its last block)."""
        return sum(internal_waste(s.sequence_length, self.block_size) for s in self.sequences.values())

    # -- lifecycle -------------------------------------------------------------------------
    def create_sequence(self, sequence_id: int, prefix_blocks=()) -> SequenceState:
        """A new live sequence whose table starts with prefix_blocks, cached blocks from match_prefix
        (their KV is already computed: sequence_length starts at len(prefix_blocks) * block_size)."""
        if sequence_id in self.sequences:
            raise DuplicateSequenceError(f"sequence {sequence_id} is already live")
        prefix_blocks = list(prefix_blocks)
        if len(set(prefix_blocks)) != len(prefix_blocks):
            raise ValueError(f"sequence {sequence_id}: prefix_blocks {prefix_blocks} repeat a block")
        if prefix_blocks and (min(prefix_blocks) < 0 or max(prefix_blocks) >= self.num_physical_blocks
                              or None in map(self.block_hash.__getitem__, prefix_blocks)):
            block = next(b for b in prefix_blocks if not 0 <= b < self.num_physical_blocks or self.block_hash[b] is None)
            raise ValueError(f"sequence {sequence_id}: prefix block {block} is not a cached block")
        ref_counts = self.ref_counts
        for block in prefix_blocks:
            if ref_counts[block] == 0:  # cached: it leaves the evictable set
                self.cached_blocks.pop(block)
            ref_counts[block] += 1
        return self._add_state(SequenceState(sequence_id, len(prefix_blocks) * self.block_size, prefix_blocks,
                                             len(prefix_blocks)))

    def fork(self, parent_id: int, child_ids: list[int]) -> list[tuple[int, int]]:
        """New live sequences, one per child id, holding what the parent holds: each shares the parent's
        full blocks (ref + 1 each) and gets a fresh block for its partial last block, if it has one.

        Returns the copies the device must make, (parent's last block, child's block) per child; none when
        the parent's length is a multiple of block_size. All or nothing: DuplicateSequenceError, or
        OutOfBlocksError when the pool has fewer free blocks than copies, before any change.
        """
        parent = self.state(parent_id)
        if len(set(child_ids)) != len(child_ids) or any(c in self.sequences for c in child_ids):
            raise DuplicateSequenceError(f"fork of {parent_id}: child ids {child_ids} repeat or are live")
        num_full = parent.sequence_length // self.block_size
        partial = parent.block_table[num_full:]  # [] or [the partial last block]
        if len(partial) * len(child_ids) > self.num_free_blocks:
            raise OutOfBlocksError(f"fork of {parent_id} needs {len(child_ids)} blocks, {self.num_free_blocks} free")
        copies = []
        for child_id in child_ids:
            table = parent.block_table[:num_full]
            for block in table:
                self.ref_counts[block] += 1
            if partial:
                table.append(self.allocate_block())
                copies.append((partial[0], table[-1]))
            self._add_state(SequenceState(child_id, parent.sequence_length, table, parent.num_hashed_blocks))
        return copies

    def _add_state(self, state: SequenceState) -> SequenceState:
        """Make state live, its block table copied into a free row of table_rows."""
        old = self.table_rows.shape[0]
        self._resize_rows(old if self._free_rows else max(2 * old, 8), len(state.block_table))
        self._free_rows.extend(range(self.table_rows.shape[0] - 1, old - 1, -1))  # pop() takes the lowest first
        state.row = self._free_rows.pop()
        self.table_rows[state.row, :len(state.block_table)] = state.block_table
        self.sequences[state.sequence_id] = state
        return state

    def _resize_rows(self, num_rows: int, width: int) -> None:
        """Grow table_rows to num_rows rows and at least width columns, keeping its contents. Columns double
        only when a table outgrows them: fewer than twice the longest table held (and at least 8)."""
        old_rows, old_width = self.table_rows.shape
        if num_rows > old_rows or width > old_width:
            new_width = old_width if width <= old_width else max(width, 2 * old_width, 8)
            grown = np.full((max(num_rows, old_rows), new_width), -1, dtype=np.int32)
            grown[:old_rows, :old_width] = self.table_rows
            self.table_rows = grown

    def allocate_block(self) -> int:
        """A block at ref 1: a free one, else the least recently used cached one (its hash leaves
        the index)."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.cached_blocks:
            block, _ = self.cached_blocks.popitem(last=False)
            del self.cached_block_of[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise OutOfBlocksError("no free or cached KV block left in the pool")
        self.ref_counts[block] = 1
        return block

    def append_token(self, sequence_id: int) -> int:
        """Store one more token for this sequence; returns its slot (OutOfBlocksError, changing nothing,
        when it needs a block and none is left)."""
        return int(self.slot_mapping_for_append([sequence_id])[0])

    def append_tokens(self, sequence_id: int, num_tokens: int) -> np.ndarray:
        """Store num_tokens more tokens for this sequence, allocating blocks as boundaries are crossed.

        Returns their slots (int32 [num_tokens]). Raises OutOfBlocksError, changing nothing, when
        the pool cannot hold them.
        """
        return self.slot_mapping_for_append([sequence_id], [num_tokens])

    def slot_mapping_for_append(self, sequence_ids: list[int], num_tokens: list[int] | None = None) -> np.ndarray:
        """Store num_tokens more tokens for each sequence (default one each: a decode step), allocating
        blocks, sequence after sequence, as boundaries are crossed; returns the slots of the new tokens
        (int32 [sum(num_tokens)], sequence after sequence): slot = T[p // B] * B + p % B for each new
        position p. Per-sequence Python only for the sequences that take a block.

        All or nothing: if the batch does not fit, OutOfBlocksError is raised before any change.
        """
        states = self._states(sequence_ids)
        counts = np.ones(len(states), np.int64) if num_tokens is None else np.asarray(num_tokens, np.int64)
        if counts.shape != (len(states),) or len(set(sequence_ids)) != len(states):
            raise ValueError(f"need distinct sequence_ids and one count each, got {sequence_ids}, {num_tokens}")
        if (counts < 0).any():
            bad = [sequence_ids[i] for i in np.flatnonzero(counts < 0)]
            raise ValueError(f"sequences {bad}: num_tokens must be >= 0, got {num_tokens}")
        starts = np.fromiter(map(_LENGTH, states), np.int64, len(states))
        ends = starts + counts
        missing = -(-ends // self.block_size) + starts // -self.block_size  # blocks_needed(ends) - blocks_needed(starts)
        needed = int(missing.sum())
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(f"the batch needs {needed} more blocks, {self.num_free_blocks} free")
        for i in np.flatnonzero(missing).tolist():
            self._append_blocks(states[i], int(missing[i]))
        for state, end in zip(states, ends.tolist()):
            state.sequence_length = end
        positions, rows = starts, np.fromiter(map(_ROW, states), np.intp, len(states))
        if num_tokens is not None:  # per new token: its position and its sequence's row
            positions, rows = new_token_positions(starts, counts), np.repeat(rows, counts)
        return self.table_rows[rows, positions // self.block_size] * self.block_size + (
            positions % self.block_size).astype(np.int32)

    def num_appendable(self, sequence_ids: list[int]) -> int:
        """How many leading sequences of sequence_ids could each store one more token, in order, with the
        blocks the pool has now (each one whose length is a multiple of block_size takes a block)."""
        states = self._states(sequence_ids)
        at_boundary = np.fromiter(map(_LENGTH, states), np.int64, len(states)) % self.block_size == 0
        return int(np.searchsorted(np.cumsum(at_boundary), self.num_free_blocks, side="right"))

    def _append_blocks(self, state: SequenceState, num_blocks: int) -> None:
        """Allocate num_blocks blocks onto the end of this sequence's table (its list and its row)."""
        start = len(state.block_table)
        state.block_table.extend(self.allocate_block() for _ in range(num_blocks))
        self._resize_rows(self.table_rows.shape[0], len(state.block_table))
        self.table_rows[state.row, start:len(state.block_table)] = state.block_table[start:]

    def _states(self, sequence_ids) -> list[SequenceState]:
        try:
            return list(map(self.sequences.__getitem__, sequence_ids))
        except KeyError as err:
            raise UnknownSequenceError(f"sequence {err.args[0]} is not live") from None

    def register_full_blocks(self, sequence_id: int, hashes: list[bytes]) -> None:
        """Offer this sequence's newly full blocks to the cache; hashes[i] names its logical block i.

        A block whose hash is already indexed (another block holds the same prefix) stays unhashed.
        A block is full once its slots are allocated, before the device writes them: a later hit
        reads them in a later step, and steps run in stream order.
        """
        state = self.state(sequence_id)
        if not self.enable_prefix_caching:
            return
        last = min(len(hashes), state.sequence_length // self.block_size)
        for i in range(state.num_hashed_blocks, last):
            if hashes[i] not in self.cached_block_of:
                block = state.block_table[i]
                self.block_hash[block] = hashes[i]
                self.cached_block_of[hashes[i]] = block
        state.num_hashed_blocks = max(state.num_hashed_blocks, last)

    def hash_known_blocks(self, seq, *samples) -> None:
        """Extend seq.block_hashes over its full blocks whose token ids are all known; `samples`, the other
        samples of its prompt (no outputs yet), take copies. Nothing while prefix caching is off or seq
        scores its prompt (a hit would skip prompt positions whose logits it needs)."""
        if not self.enable_prefix_caching or seq.scores_prompt:
            return
        num_hashed = len(seq.block_hashes)
        known = seq.token_slice(num_hashed * self.block_size, seq.num_known_tokens)
        if num_hashed:
            extend_block_hashes(seq.block_hashes, known, self.block_size)
        else:
            seq.block_hashes.extend(self.recent_prompt.hashes_of(known))
        if len(seq.block_hashes) > num_hashed:
            for sample in samples:
                sample.block_hashes = list(seq.block_hashes)

    def register_known_blocks(self, seq) -> None:
        """A block of seq completed by a resolved output: hash_known_blocks, then register_full_blocks if
        seq is live (a preempted one offers its blocks when it is admitted again and computes them)."""
        self.hash_known_blocks(seq)
        if seq.seq_id in self.sequences:
            self.register_full_blocks(seq.seq_id, seq.block_hashes)

    def release_sequence(self, sequence_id: int) -> None:
        """Drop the sequence's references and forget it (finish or preemption). Visits the table from
        the tail, so a prompt's tail blocks enter the LRU before its head and are evicted first; a
        block reaching ref 0 becomes cached if it holds a hash, else free."""
        state = self.state(sequence_id)
        for block in reversed(state.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free_blocks.append(block)
                else:
                    self.cached_blocks[block] = None
        self.table_rows[state.row] = -1
        self._free_rows.append(state.row)
        del self.sequences[sequence_id]

    def reset_prefix_cache(self) -> None:
        """Every cached (evictable) block drops its hash and becomes free."""
        for block in self.cached_blocks:
            del self.cached_block_of[self.block_hash[block]]
            self.block_hash[block] = None
        self.free_blocks.extend(self.cached_blocks)
        self.cached_blocks.clear()

    # -- arrays for the data plane -----------------------------------------------------------
    def block_tables_and_seq_lens(self, sequence_ids: list[int], width: int | None = None
                                  ) -> tuple[np.ndarray, np.ndarray]:
        """block_tables int32 [len(sequence_ids), width], padded with -1 (width: the longest table's, or
        more), one gather of table_rows; and seq_lens int32 [len(sequence_ids)], the stored tokens of each.
        Numpy, for one copy to the device."""
        states = self._states(sequence_ids)
        longest = max(map(len, map(_TABLE, states)), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width {width} is less than the longest block table, {longest} blocks")
        rows = np.fromiter(map(_ROW, states), np.intp, len(states))
        tables = self.table_rows[rows, :width]
        if tables.shape[1] < width:
            tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])), constant_values=-1)
        return tables, np.fromiter(map(_LENGTH, states), np.int32, len(states))

    def get_block_table_tensor(self, sequence_ids: list[int], width: int | None = None) -> torch.Tensor:
        return torch.from_numpy(self.block_tables_and_seq_lens(sequence_ids, width)[0])

    def get_seq_lens_tensor(self, sequence_ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.block_tables_and_seq_lens(sequence_ids)[1])

    # -- checks ------------------------------------------------------------------------------
    def invariants_ok(self) -> bool:
        return self._tables_ok() and self._rows_ok() and self._pool_partition_ok() and self._hash_index_ok()

    def _rows_ok(self) -> bool:
        """Each live sequence has its own row of table_rows, holding its table then -1; the other rows
        are free and all -1."""
        expected = np.full(self.table_rows.shape, -1, dtype=np.int32)
        rows = [s.row for s in self.sequences.values()]
        for s in self.sequences.values():
            if not 0 <= s.row < expected.shape[0] or len(s.block_table) > expected.shape[1]:
                return False
            expected[s.row, :len(s.block_table)] = s.block_table
        return (sorted(rows + self._free_rows) == list(range(expected.shape[0]))
                and np.array_equal(expected, self.table_rows))

    def _tables_ok(self) -> bool:
        """Each table: the right length, no block twice, in range, hashes only in its leading full
        blocks; ref_counts[b] equals the number of tables holding b; a partial last block has one holder."""
        holders, partial = [0] * self.num_physical_blocks, []
        for s in self.sequences.values():
            table = s.block_table
            if (
                len(table) != blocks_needed(s.sequence_length, self.block_size)
                or len(set(table)) != len(table)
                or not all(0 <= b < self.num_physical_blocks for b in table)
                or not 0 <= s.num_hashed_blocks <= s.sequence_length // self.block_size
                or any(self.block_hash[b] is not None for b in table[s.num_hashed_blocks :])
            ):
                return False
            for b in table:
                holders[b] += 1
            if s.sequence_length % self.block_size:
                partial.append(table[-1])
        return holders == self.ref_counts and all(holders[b] == 1 for b in partial)

    def _pool_partition_ok(self) -> bool:
        """free + cached + referenced = range(num_physical_blocks), disjoint; free blocks hold no
        hash, cached ones hold one; with caching off nothing is ever cached."""
        free, cached = list(self.free_blocks), list(self.cached_blocks)
        referenced = [b for b, ref in enumerate(self.ref_counts) if ref > 0]
        return (
            sorted(free + cached + referenced) == list(range(self.num_physical_blocks))
            and all(self.block_hash[b] is None for b in free)
            and all(self.block_hash[b] is not None for b in cached)
            and (self.enable_prefix_caching or not self.cached_block_of)
        )

    def _hash_index_ok(self) -> bool:
        """The index and the blocks' hashes are one bijection."""
        hashed = {b: h for b, h in enumerate(self.block_hash) if h is not None}
        return (
            all(len(h) == HASH_BYTES for h in hashed.values())
            and len(hashed) == len(self.cached_block_of)
            and all(hashed.get(b) == h for h, b in self.cached_block_of.items())
        )

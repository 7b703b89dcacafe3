"""Groups of a step's decode rows that share a prefix of physical KV blocks, for cascade attention
(ops.cascade_attention_decode reads such a prefix once per group instead of once per row).

The scheduler orders decode rows by the physical id of their first block, so sequences whose block
tables start alike (the prefix cache makes a shared prompt prefix share blocks) are adjacent. A
candidate group is a maximal run of >= 2 adjacent rows with the same first block; its prefix is the
number of leading block-table columns equal across all its rows, counted only within its shortest
member's full blocks, times block_size. CascadePolicy decides which candidates take the cascade path.
"""
from dataclasses import dataclass

import numpy as np
import torch

# cache.cascade_attention=auto takes a group only where it pays off. On the H200, benchmarks/cascade.py
# --break-even (one group among 256 decode rows, the others unshared) has cascade win everywhere with
# >= 128 rows sharing >= 1,024 tokens, and a 64-row group lose 2-10% (plain decode reads a shared prefix of a
# few MB from L2, and the cascade path's partials cost every row); but in shared_prefix, where every row
# shares, plain steps of 64-127 rows took 6.45 ms against 4.25 ms for cascade steps of 128-191 rows.
CASCADE_MIN_ROWS = 64
CASCADE_MIN_PREFIX_TOKENS = 1024
MAX_CASCADE_GROUPS = 8  # sharing groups per step: those that save the most K/V reads


@dataclass(frozen=True)
class CascadePolicy:
    """Which candidate groups take cascade attention: those of >= min_rows rows whose prefix is >=
    min_prefix_tokens, at most max_groups a step (the largest (rows - 1) * prefix: K/V tokens not read)."""

    min_rows: int
    min_prefix_tokens: int
    max_groups: int = MAX_CASCADE_GROUPS

    @classmethod
    def for_mode(cls, mode: str, device: torch.device) -> "CascadePolicy | None":
        """cache.cascade_attention: off never; on every group of >= 2 rows sharing >= 1 block (the CPU runs
        the op's torch reference); auto only on CUDA, with the break-even thresholds above. None: never."""
        if mode == "off" or (mode == "auto" and device.type != "cuda"):
            return None
        return cls(2, 1) if mode == "on" else cls(CASCADE_MIN_ROWS, CASCADE_MIN_PREFIX_TOKENS)

    @property
    def max_entries(self) -> int:
        """Most groups a step can have in the op's layout: the sharing groups and a run of plain rows
        before each."""
        return 2 * self.max_groups


@dataclass
class PrefixGroups:
    """The op's group layout: rows cu_group_rows[g]:cu_group_rows[g + 1] (int32 [G + 1], from 0,
    increasing) share their first group_prefix_lens[g] tokens (int32 [G]); rows after cu_group_rows[G]
    share nothing. shared_rows: the rows of the groups with a prefix > 0."""

    cu_group_rows: np.ndarray
    group_prefix_lens: np.ndarray
    shared_rows: int


def find_prefix_groups(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                       policy: CascadePolicy) -> PrefixGroups | None:
    """Groups of the decode rows (block_tables int32 [n, M], -1 padded; seq_lens [n], >= 1) that the
    policy takes, or None when it takes none.

    Invariant of the result: every g with group_prefix_lens[g] = p > 0 is a run of >= policy.min_rows
    adjacent rows with the same first block whose tables agree on their first p / block_size columns;
    p is a multiple of block_size, >= policy.min_prefix_tokens and <= the full blocks of every member
    (so <= its seq_len). Groups with p = 0 are the rows between two sharing groups (the op needs its
    groups contiguous from row 0; such a group takes the plain path). At most policy.max_groups groups
    share, so G <= policy.max_entries. Cost: numpy over the rows and the columns of the shortest
    member's full blocks of the largest candidate, no loop over rows or tokens."""
    n = seq_lens.shape[0]
    if n < max(policy.min_rows, 2):
        return None
    first = block_tables[:, 0]
    run_starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])
    run_ends = np.r_[run_starts[1:], n]
    full_blocks = np.minimum.reduceat(seq_lens // block_size, run_starts)  # the shortest member's
    candidate = (run_ends - run_starts >= max(policy.min_rows, 2)) & (full_blocks > 0)
    starts, ends, full_blocks = run_starts[candidate], run_ends[candidate], full_blocks[candidate]
    if starts.size == 0:
        return None
    width = int(full_blocks.max())
    same = block_tables[1:, :width] == block_tables[:-1, :width]  # [n - 1, width]: row i + 1 agrees with row i
    leading = np.r_[np.where(same.all(axis=1), width, same.argmin(axis=1)), width]  # per adjacent pair
    equal = np.minimum.reduceat(leading, np.stack([starts, ends - 1], axis=1).ravel())[::2]  # pairs of each run
    prefixes = np.minimum(equal, full_blocks) * block_size
    keep = prefixes >= max(policy.min_prefix_tokens, 1)
    starts, ends, prefixes = starts[keep], ends[keep], prefixes[keep]
    if starts.size > policy.max_groups:
        best = np.argsort(-(ends - starts - 1) * prefixes, kind="stable")[:policy.max_groups]
        starts, ends, prefixes = (x[np.sort(best)] for x in (starts, ends, prefixes))
    if starts.size == 0:
        return None
    return _layout(starts, ends, prefixes)


def _layout(starts: np.ndarray, ends: np.ndarray, prefixes: np.ndarray) -> PrefixGroups:
    """Sharing groups [starts, ends) (in row order) -> the op's layout, with a prefix-0 group for
    each nonempty run of rows before a sharing group."""
    bounds = np.r_[0, np.stack([starts, ends], axis=1).ravel()]  # 0, s0, e0, s1, e1, ...
    lens = np.stack([np.zeros_like(prefixes), prefixes], axis=1).ravel()  # the run before s0, group 0, ...
    nonempty = np.diff(bounds) > 0
    return PrefixGroups(np.r_[0, bounds[1:][nonempty]].astype(np.int32), lens[nonempty].astype(np.int32),
                        int((ends - starts).sum()))

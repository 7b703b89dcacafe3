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

from ops.cascade import PrefixPass

# cache.cascade_attention=auto weighs each step with StepCost, on decode steps of at least CASCADE_MIN_ROWS rows
# (the buckets that get a cascade graph: fewer rows rarely pay for the op's extra kernels, and each graph costs
# start-up).
CASCADE_MIN_ROWS = 64
# Sharing groups per step (those that save the most K/V reads) where the engine's step size is not given; an
# engine's policy takes as many as its max_num_seqs rows can hold (groups of >= 2 rows). The prefix pass walks a
# work list of the groups' items, so a group costs its items, not a slot of its own; a cap of 32 left half of the
# rollout's 64 groups of 16 samples at 1,024 rows reading their prompts once a row (benchmarks/NOTES.md, session
# 41). The graphs' static group buffers hold twice as many.
MAX_CASCADE_GROUPS = 32


@dataclass(frozen=True)
class StepCost:
    """One layer's decode attention, in microseconds, as linear in what a step's rows read:
        plain   = plain[0] + plain[1] rows + plain[2] unique tokens + plain[3] repeated tokens
        cascade = cascade[0] + cascade[1] prefix-pass items + cascade[2] own tokens + cascade[3] prefix tokens
                  + cascade[4] groups
    A group of r rows sharing p tokens has p prefix tokens, which plain decode reads r times (r - 1 of them
    repeated, partly from L2); own tokens are every row's others. The prefix pass's items are its plan's
    (ops.cascade.PrefixPass.plan's count: row tiles x prefix chunks, each a query tile loaded and a partial
    written per kv head). Token terms
    are for kv_bytes_per_token bytes of K and V a token and a layer; a model with other heads scales them by
    its own bytes."""

    plain: tuple[float, float, float, float]
    cascade: tuple[float, float, float, float, float]
    kv_bytes_per_token: int

    def groups_that_pay(self, rows: np.ndarray, prefixes: np.ndarray, kv_bytes_per_token: int) -> np.ndarray:
        """Per group (rows [G], prefix tokens [G]): whether taking it shortens the cascade: its r p tokens
        leave the suffix pass for the prefix pass, which reads p of them, at the price of a group."""
        scale = kv_bytes_per_token / self.kv_bytes_per_token
        _, _, own, prefix, group = self.cascade
        return scale * (own * rows - prefix) * prefixes > group

    def cascade_pays(self, num_rows: int, tokens: int, rows: np.ndarray, prefixes: np.ndarray,
                     kv_bytes_per_token: int, prefix_items: int) -> bool:
        """Whether the cascade with these groups, whose prefix pass has prefix_items items, beats plain
        decode on a step of num_rows rows reading tokens K/V tokens in all (each row's whole context)."""
        scale = kv_bytes_per_token / self.kv_bytes_per_token
        grouped, prefix_tokens = int((rows * prefixes).sum()), int(prefixes.sum())
        repeated = grouped - prefix_tokens
        plain = self.plain[0] + self.plain[1] * num_rows + scale * (
            self.plain[2] * (tokens - repeated) + self.plain[3] * repeated)
        cascade = self.cascade[0] + self.cascade[1] * prefix_items + scale * (
            self.cascade[2] * (tokens - grouped) + self.cascade[3] * prefix_tokens) + self.cascade[4] * rows.size
        return cascade < plain


# Fitted by benchmarks/cascade.py --fit to its --groups grid on the H200 (benchmarks/NOTES.md, session 29):
# Qwen3-0.6B's heads (16 q, 8 kv of 128, bfloat16: 4,096 bytes of K and V a token and a layer). The groups
# term came out below zero (it shares its work with the items'): every candidate then pays for itself, and
# the step's own test decides.
STEP_COST = StepCost(plain=(11.47036, 0.043237, 0.000885, 0.000695),
                     cascade=(43.110948, 0.20869, 0.000971, 0.001115, -0.558342), kv_bytes_per_token=4096)


@dataclass(frozen=True)
class CascadePolicy:
    """Which candidate groups take cascade attention, on decode steps of >= min_step_rows rows: those of
    >= min_rows rows whose prefix is >= min_prefix_tokens, at most max_groups a step (the largest
    (rows - 1) * prefix: K/V tokens not read); with a cost, only the groups that shorten the cascade, and
    only where it is predicted to beat plain decode. kv_bytes_per_token: the model's K and V a token and a
    layer; prefix_pass: how the Triton op plans its prefix pass (None: the CPU's reference, which needs no
    plan)."""

    min_rows: int
    min_prefix_tokens: int
    max_groups: int = MAX_CASCADE_GROUPS
    min_step_rows: int = 2
    cost: StepCost | None = None
    kv_bytes_per_token: int = 0
    prefix_pass: PrefixPass | None = None

    @classmethod
    def for_mode(cls, mode: str, device: torch.device, kv_bytes_per_token: int = 0,
                 prefix_pass: PrefixPass | None = None, max_num_seqs: int = 0) -> "CascadePolicy | None":
        """cache.cascade_attention: off never; on every group of >= 2 rows sharing >= 1 block (the CPU runs
        the op's torch reference); auto only on CUDA, where STEP_COST predicts a gain. None: never. At most
        max_num_seqs // 2 groups a step (MAX_CASCADE_GROUPS where that is fewer or not given)."""
        if mode == "off" or (mode == "auto" and device.type != "cuda"):
            return None
        max_groups = max(MAX_CASCADE_GROUPS, max_num_seqs // 2)
        if mode == "on":
            return cls(2, 1, max_groups, prefix_pass=prefix_pass)
        return cls(2, 1, max_groups, min_step_rows=CASCADE_MIN_ROWS, cost=STEP_COST,
                   kv_bytes_per_token=kv_bytes_per_token or STEP_COST.kv_bytes_per_token, prefix_pass=prefix_pass)

    @property
    def max_entries(self) -> int:
        """Most groups a step can have in the op's layout: the sharing groups and a run of plain rows
        before each."""
        return 2 * self.max_groups


@dataclass
class PrefixGroups:
    """The op's group layout: rows cu_group_rows[g]:cu_group_rows[g + 1] (int32 [G + 1], from 0,
    increasing) share their first group_prefix_lens[g] tokens (int32 [G]); rows after cu_group_rows[G]
    share nothing. shared_rows: the rows of the groups with a prefix > 0. plan: the op's prefix pass's
    work list (PrefixPass.plan), None without a policy's prefix_pass."""

    cu_group_rows: np.ndarray
    group_prefix_lens: np.ndarray
    shared_rows: int
    plan: np.ndarray | None = None


def find_prefix_groups(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                       policy: CascadePolicy) -> PrefixGroups | None:
    """Groups of the decode rows (block_tables int32 [n, M], -1 padded; seq_lens [n], >= 1) that the
    policy takes, or None when it takes none.

    Invariant of the result: every g with group_prefix_lens[g] = p > 0 is a run of >= policy.min_rows
    adjacent rows with the same first block whose tables agree on their first p / block_size columns;
    p is a multiple of block_size, >= policy.min_prefix_tokens and <= the full blocks of every member
    (so <= its seq_len); with policy.cost, each group pays for itself and the step's cascade is predicted
    faster than plain decode. Groups with p = 0 are the rows between two sharing groups (the op needs its
    groups contiguous from row 0; such a group takes the plain path). At most policy.max_groups groups
    share, so G <= policy.max_entries. Cost: numpy over the rows and the columns of the shortest
    member's full blocks of the largest candidate, no loop over rows or tokens."""
    n = seq_lens.shape[0]
    if n < max(policy.min_step_rows, policy.min_rows, 2):
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
    if policy.cost is not None:
        pays = policy.cost.groups_that_pay(ends - starts, prefixes, policy.kv_bytes_per_token)
        starts, ends, prefixes = starts[pays], ends[pays], prefixes[pays]
    if starts.size == 0:
        return None
    groups = _layout(starts, ends, prefixes)
    if policy.prefix_pass is not None:
        groups.plan = policy.prefix_pass.plan(groups.cu_group_rows, groups.group_prefix_lens)
    if policy.cost is not None:
        items = 0 if groups.plan is None else int(groups.plan[0, 0])
        if not policy.cost.cascade_pays(n, int(seq_lens.sum()), ends - starts, prefixes,
                                        policy.kv_bytes_per_token, items):
            return None
    return groups


def _layout(starts: np.ndarray, ends: np.ndarray, prefixes: np.ndarray) -> PrefixGroups:
    """Sharing groups [starts, ends) (in row order) -> the op's layout, with a prefix-0 group for
    each nonempty run of rows before a sharing group."""
    bounds = np.r_[0, np.stack([starts, ends], axis=1).ravel()]  # 0, s0, e0, s1, e1, ...
    lens = np.stack([np.zeros_like(prefixes), prefixes], axis=1).ravel()  # the run before s0, group 0, ...
    nonempty = np.diff(bounds) > 0
    return PrefixGroups(np.r_[0, bounds[1:][nonempty]].astype(np.int32), lens[nonempty].astype(np.int32),
                        int((ends - starts).sum()))

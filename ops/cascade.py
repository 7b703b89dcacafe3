"""Cascade (shared-prefix) decode attention in Triton (contract: ops/paged_attention_reference.py).

    cascade_attention_decode(q[B,Hq,D], key_cache, value_cache, block_tables[B,M], seq_lens[B], scale,
                             cu_group_rows[G+1], group_prefix_lens[G], num_splits=None, plan=None) -> [B,Hq,D]

Rows cu_group_rows[g]:cu_group_rows[g+1] share their first group_prefix_lens[g] tokens (the same
physical blocks). Three kernels, none of which synchronises with the host:
1. prefix: a list of work items, each a tile of up to BLOCK_Q rows of one group against one chunk of the
   group's prefix, which the host plans from the groups (PrefixPass.plan) and the device reads. A fixed
   grid of programs per kv head walks the list (program p takes items p, p + programs, ...), so the grid
   holds no program without work whatever the step's groups, and the chunk length is the one whose items
   end first (PrefixPass.chunks); an item's whole key tiles run without a key mask, its last one with. A tile
   packs its rows x the Hq / Hkv query heads of one kv head into the BLOCK_M rows of tl.dot, so the
   prefix K/V is read once per tile (once per group when its rows fit one tile) instead of once per row.
   An item writes partial (out, log2-sum-exp) to its chunk's slot in [0, PREFIX_SLOTS), and the items of
   chunk 0 write each row's context start (its group's prefix) and prefix slot count to row_prefix.
2. suffix: the decode kernel over [ctx_start, seq_len) of each row, into slots PREFIX_SLOTS.. .
3. merge: the split-KV reduce over all slots; a row's prefix slots count up to its slot count.
The prefix a group's items cover is its prefix length rounded down to the suffix pass's decode tile
(BLOCK_N of decode_cfg's short contexts) when that divides the block size (the decode tile loop needs
aligned starts there); the rounded-off tokens go to the suffix pass, so results do not depend on it.
Rows outside [0, cu_group_rows[G]) and groups with prefix 0 take the plain path (ctx_start stays 0);
with G = 0 the op is plain decode.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ops import paged_attention
from ops.paged_attention import LOG2E, attend_range, dot_dtype, dot_precision, load_query_tile, store_partial

# The prefix pass's tiles. programs_per_sm: its grid's programs per SM (over all kv heads); programs: a fixed
# count per kv head instead (the interpreter, whose programs run one after another).
PREFIX_CFG = {
    "gpu": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=2),
    "gpu_large_d": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, programs_per_sm=1),  # head_dim > 128
    "gpu_fp32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, programs_per_sm=1),
    "interp": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, programs=3),
}
# Chunks of one group's prefix at most: each costs a float32 [rows, Hq, D] partial, and the merge's tile is
# next_pow2(PREFIX_SLOTS + splits) slots wide (at 8 the merge of 512 rows took 20.8 us: benchmarks/NOTES.md, session 29)
PREFIX_SLOTS = 4
CHUNK_MIN_TOKENS = 256  # a chunk writes BLOCK_M x D float32 partials: keep it well above that
PREFIX_ROUNDS = 2       # a plan's items beyond one a tile: at most this many per program (the work list's bound)
WORK_FIELDS = 8         # an item: first row, rows, chunk start, chunk end, slot, its group's slots and prefix, 0


@triton.jit(do_not_specialize=["num_q_heads", "s_rp", "s_btb"])
def _prefix_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, work_ptr, row_prefix_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, num_q_heads, s_rp,
    s_qb, s_qh, s_qd,
    s_kcb, s_kch, s_kct, s_kcd, s_vcb, s_vch, s_vct, s_vcd,
    s_btb,
    G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, FIELDS: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """work_ptr: int32 [1 + W, FIELDS], row 0 = (W, ...), rows 1.. the items (PrefixPass.plan);
    row_prefix_ptr: int32 [2, >= B] (row stride s_rp), zeros, receives each grouped row's (ctx_start,
    prefix slots)."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    num_items = tl.load(work_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * G + offs_m % G
    d_mask = offs_d < HEAD_DIM
    for i in range(pid, num_items, tl.num_programs(0)):
        item = work_ptr + (i + 1) * FIELDS
        row0 = tl.load(item)
        tile_rows = tl.load(item + 1)
        slot = tl.load(item + 4)
        rows = (row0 + offs_m // G).to(tl.int64)
        row_mask = offs_m // G < tile_rows
        q, m_i, l_i, acc = load_query_tile(q_ptr, rows, heads, row_mask, offs_d, d_mask, s_qb, s_qh, s_qd,
                                           BLOCK_M, BLOCK_D, DOT_DTYPE)
        # the tile's first row's block table: the prefix blocks are every member's
        bt_row = bt_ptr + row0.to(tl.int64) * s_btb
        start, end = tl.load(item + 2), tl.load(item + 3)
        full_end = start + (end - start) // BLOCK_N * BLOCK_N  # the tiles before it need no key mask
        acc, m_i, l_i = attend_range(
            q, acc, m_i, l_i, qk_scale, kc_ptr, vc_ptr, kvh, bt_row, start, full_end,
            s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, DOT_PREC, False,
        )
        acc, m_i, l_i = attend_range(
            q, acc, m_i, l_i, qk_scale, kc_ptr, vc_ptr, kvh, bt_row, full_end, end,
            s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, DOT_PREC, True,
        )
        store_partial(part_o_ptr, part_lse_ptr, rows * num_q_heads + heads, slot, acc, m_i, l_i, offs_d,
                      row_mask, d_mask, BLOCK_S, BLOCK_D)
        if (kvh == 0) & (slot == 0):
            first_head = row_mask & (offs_m % G == 0)
            tl.store(row_prefix_ptr + rows, tl.load(item + 6) + 0 * offs_m, mask=first_head)
            tl.store(row_prefix_ptr + s_rp + rows, tl.load(item + 5) + 0 * offs_m, mask=first_head)


def prefix_cfg(q, key_cache):
    return paged_attention.prefill_cfg(q, key_cache, PREFIX_CFG)


def prefix_programs(cfg, num_kv_heads: int, device) -> int:
    """The prefix pass's programs per kv head at launch cfg: its fixed count, or programs_per_sm of the
    device's SMs over the kv heads."""
    return cfg.get("programs") or math.ceil(paged_attention.sm_count(device) * cfg["programs_per_sm"] / num_kv_heads)


@dataclass(frozen=True)
class PrefixPass:
    """What plans a step's prefix pass: block_q rows a tile, chunks starting at multiples of block_n, each
    group's prefix rounded down to align, programs per kv head walking the items."""

    block_q: int
    block_n: int
    align: int
    programs: int

    @classmethod
    def of(cls, q, key_cache) -> "PrefixPass":
        """The prefix pass of queries like q ([*, Hq, D]: shape, dtype and device count) over key_cache."""
        Hq, Hkv, bs = q.shape[1], key_cache.shape[1], key_cache.shape[2]
        cfg = prefix_cfg(q, key_cache)
        decode_block_n = paged_attention.decode_cfg(q, key_cache, short_contexts=True)["BLOCK_N"]
        return cls(paged_attention.query_tile(cfg, Hq // Hkv, None, q.is_cuda)[1], cfg["BLOCK_N"],
                   decode_block_n if bs % decode_block_n == 0 else 1, prefix_programs(cfg, Hkv, q.device))

    def chunks(self, rows: np.ndarray, prefixes: np.ndarray):
        """Per group (rows [G], prefix tokens [G]): (aligned prefix, tiles, chunks, tokens a chunk). Of the chunk
        lengths that cut the longest prefix into 1 .. PREFIX_SLOTS chunks (>= CHUNK_MIN_TOKENS, on block_n), the
        one whose items end first (makespan), fewer items on a tie; a group with an aligned prefix of 0 has none."""
        prefixes = prefixes - prefixes % self.align
        tiles = np.where(prefixes > 0, -(-rows // self.block_q), 0)
        longest, best = int(prefixes.max(initial=0)), None
        for count in range(1, PREFIX_SLOTS + 1):
            length = -(-max(CHUNK_MIN_TOKENS, -(-longest // count)) // self.block_n) * self.block_n
            chunks = np.minimum(-(-prefixes // length), PREFIX_SLOTS)
            per = -(-(-(-prefixes // np.maximum(chunks, 1))) // self.block_n) * self.block_n
            chunks = np.where(prefixes > 0, -(-prefixes // np.maximum(per, 1)), 0)
            if best is not None and (tiles * (chunks - 1)).sum() > PREFIX_ROUNDS * self.programs:
                break  # more chunks only add items
            span = self.makespan(tiles, chunks, per, prefixes)
            if best is None or span < best[0]:
                best = (span, chunks, per)
        return prefixes, tiles, best[1], best[2]

    def makespan(self, tiles, chunks, per, prefixes) -> int:
        """The tokens (plus block_n an item: its query tile and partial) that program 0 walks, which takes the
        longest item of each round when the items are dealt largest first: the plan's time in tokens."""
        last = prefixes - (chunks - 1) * per
        lengths = np.concatenate([np.repeat(per, tiles * (chunks - 1)), np.repeat(last, tiles)])
        return int((np.sort(lengths)[::-1][::self.programs] + self.block_n).sum())

    def max_items(self, max_rows: int, max_groups: int) -> int:
        """A bound of W over steps of <= max_rows rows in <= max_groups groups: one item a tile and at most
        PREFIX_ROUNDS x programs more (chunks)."""
        return PREFIX_ROUNDS * self.programs + max_rows // self.block_q + max_groups

    def plan(self, cu_group_rows: np.ndarray, group_prefix_lens: np.ndarray) -> np.ndarray:
        """The work list of groups in the op's layout: int32 [1 + W, WORK_FIELDS], row 0 = (W, 0, ...), then
        the items, largest chunks first (program p takes items p, p + programs, ...: the long ones spread)."""
        cu = np.asarray(cu_group_rows, dtype=np.int64)
        prefixes, tiles, chunks, per = self.chunks(np.diff(cu), np.asarray(group_prefix_lens, dtype=np.int64))
        counts = tiles * chunks
        g = np.repeat(np.arange(counts.size), counts)
        k = np.arange(g.size) - np.repeat(np.cumsum(counts) - counts, counts)
        tile, chunk = k // chunks[g], k % chunks[g]
        first = cu[g] + tile * self.block_q
        start = chunk * per[g]
        end = np.minimum(start + per[g], prefixes[g])
        items = np.stack([first, np.minimum(self.block_q, cu[g + 1] - first), start, end, chunk, chunks[g],
                          prefixes[g], np.zeros_like(g)], axis=1)
        work = np.zeros((1 + g.size, WORK_FIELDS), dtype=np.int32)
        work[0, 0] = g.size
        work[1:] = items[np.argsort(start - end, kind="stable")]
        return work


def _launch_prefix(q, key_cache, value_cache, block_tables, scale, work, row_prefix, partials, programs, cfg):
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    part_o, part_lse = partials
    _prefix_kernel[(programs, Hkv)](
        q, key_cache, value_cache, block_tables, work, row_prefix, part_o, part_lse,
        float(scale) * LOG2E, Hq, row_prefix.stride(0),
        *q.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        G=Hq // Hkv, BLOCK_M=paged_attention.query_tile(cfg, Hq // Hkv, None, q.is_cuda)[0], HEAD_DIM=D,
        BLOCK_D=part_o.shape[3], BLOCK_SIZE=bs, BLOCK_N=cfg["BLOCK_N"], BLOCK_S=part_lse.shape[2],
        FIELDS=WORK_FIELDS, DOT_PREC=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q, key_cache),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def cascade_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, cu_group_rows,
                             group_prefix_lens, num_splits: Optional[int] = None, plan: Optional[torch.Tensor] = None,
                             out=None):
    """plan: the prefix pass's work list on q's device (PrefixPass.of(q, key_cache).plan of the groups,
    or a buffer whose first 1 + W rows hold it); None: planned here from the groups, which reads them on
    the host (one synchronisation). num_splits: force the suffix pass's partition count (tests,
    benchmarks); None picks it from shapes."""
    if group_prefix_lens.shape[0] == 0:  # no groups (a shape): plain decode, at no extra cost
        return paged_attention.paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                                      num_splits=num_splits, out=out)
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    cfg = prefix_cfg(q, key_cache)
    if plan is None:
        shape = PrefixPass.of(q, key_cache)
        plan = torch.from_numpy(shape.plan(cu_group_rows.cpu().numpy(), group_prefix_lens.cpu().numpy())).to(q.device)
    if num_splits is None:
        num_splits = paged_attention.decode_num_splits(B, Hkv, block_tables.shape[1] * bs, q.device, balance=False)
    num_splits = max(1, int(num_splits))
    partials = paged_attention.decode_partials(q, PREFIX_SLOTS + num_splits)
    # (ctx_start, prefix slots) a row, each row of the pair 16-byte aligned (an unaligned one compiles a variant)
    row_prefix = torch.zeros(2, -(-B // 4) * 4, dtype=torch.int32, device=q.device)
    _launch_prefix(q, key_cache, value_cache, block_tables, scale, plan, row_prefix, partials,
                   prefix_programs(cfg, Hkv, q.device), cfg)
    paged_attention.launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, num_splits,
                                  partials=partials, ctx_start=row_prefix[0, :B], first_slot=PREFIX_SLOTS,
                                  short_contexts=True)
    paged_attention.launch_reduce(partials, out, PREFIX_SLOTS + num_splits, prefix_slots=row_prefix[1, :B],
                                  num_prefix_slots=PREFIX_SLOTS)
    return out

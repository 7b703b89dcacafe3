"""Cascade (shared-prefix) decode attention in Triton (contract: ops/paged_attention_reference.py).

    cascade_attention_decode(q[B,Hq,D], key_cache, value_cache, block_tables[B,M], seq_lens[B], scale,
                             cu_group_rows[G+1], group_prefix_lens[G], max_group_rows=None,
                             num_chunks=None, num_splits=None) -> [B,Hq,D]

Rows cu_group_rows[g]:cu_group_rows[g+1] share their first group_prefix_lens[g] tokens (the same
physical blocks). Three kernels, none of which synchronises with the host:
1. prefix: one program per (row tile of a group, kv head, chunk of the group's prefix). A tile packs
   BLOCK_Q rows x the Hq / Hkv query heads of one kv head into the BLOCK_M rows of tl.dot, so the
   prefix K/V is read once per tile (once per group when its rows fit one tile) instead of once per
   row. Row tiles are enumerated as in prefill (grid B // BLOCK_Q + G, binary search over
   cu_group_rows; programs past their group's rows exit). Writes partial (out, log2-sum-exp) to slots
   [0, num_chunks) and each row's context start (its group's prefix length) to ctx_start.
2. suffix: the decode kernel over [ctx_start, seq_len) of each row, into slots num_chunks.. .
3. merge: the split-KV reduce over all slots; prefix slots count only for rows with ctx_start > 0.
The prefix a group's kernel covers is its prefix length rounded down to the suffix pass's decode tile
(BLOCK_N of decode_cfg's short contexts) when that divides the block size (the decode tile loop needs
aligned starts there); the rounded-off tokens go to the suffix pass, so results do not depend on it.
Rows outside [0, cu_group_rows[G]) and groups with prefix 0 take the plain path (ctx_start stays 0);
with G = 0 the op is plain decode.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ops import paged_attention
from ops.paged_attention import LOG2E, attend_range, dot_dtype, dot_precision, load_query_tile, store_partial, tile_owner

CHUNK_MIN_TOKENS = 256  # a prefix chunk writes BLOCK_M x D float32 partials: keep it well above that


@triton.jit(do_not_specialize=["num_groups", "num_chunks", "s_btb"])
def _prefix_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, prefix_ptr, ctx_start_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, num_groups, num_chunks, num_q_heads,
    s_qb, s_qh, s_qd,
    s_kcb, s_kch, s_kct, s_kcd, s_vcb, s_vch, s_vct, s_vcd,
    s_btb,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)
    grp, row0, num_rows, tile_start = tile_owner(cu_ptr, num_groups, pid, BLOCK_Q)
    if tile_start >= num_rows:
        return
    prefix = tl.load(prefix_ptr + grp)
    prefix = prefix - prefix % ALIGN
    if prefix <= 0:
        return
    per = tl.cdiv(tl.cdiv(prefix, num_chunks), BLOCK_N) * BLOCK_N
    start = chunk * per
    end = tl.minimum(start + per, prefix)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (row0 + tile_start + offs_m // G).to(tl.int64)
    heads = kvh * G + offs_m % G
    row_mask = (offs_m < BLOCK_Q * G) & (tile_start + offs_m // G < num_rows)
    d_mask = offs_d < HEAD_DIM
    q, m_i, l_i, acc = load_query_tile(q_ptr, rows, heads, row_mask, offs_d, d_mask, s_qb, s_qh, s_qd,
                                       BLOCK_M, BLOCK_D, DOT_DTYPE)
    # the group's first row's block table: its prefix blocks are every member's
    acc, m_i, l_i = attend_range(
        q, acc, m_i, l_i, qk_scale, kc_ptr, vc_ptr, kvh, bt_ptr + row0.to(tl.int64) * s_btb, start, end,
        s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
        BLOCK_SIZE, BLOCK_N, DOT_PREC,
    )
    store_partial(part_o_ptr, part_lse_ptr, rows * num_q_heads + heads, chunk, acc, m_i, l_i, offs_d,
                  row_mask, d_mask, BLOCK_S, BLOCK_D)
    if (kvh == 0) & (chunk == 0):
        tl.store(ctx_start_ptr + rows, prefix + 0 * offs_m, mask=row_mask & (offs_m % G == 0))


def prefix_num_chunks(batch, num_kv_heads, block_q, max_prefix, device):
    """Chunks per group prefix, from shapes only: as many as one wave of programs holds when all rows
    share one prefix (their programs then do equal work, so a partial second wave costs a whole program's
    time: benchmarks/NOTES.md, version 19), chunks of at least CHUNK_MIN_TOKENS of max_prefix (a bound).
    Not rounded to a power of two: each chunk costs a float32 [B, Hq, D] partial written and read back."""
    programs = triton.cdiv(batch, block_q) * num_kv_heads
    want = paged_attention.sm_count(device) // programs
    return max(1, min(want, max_prefix // CHUNK_MIN_TOKENS, paged_attention.SPLIT_MAX))


def prefix_grid_programs(batch, num_q_heads, num_kv_heads, max_ctx, num_groups, device) -> int:
    """Programs in the prefix pass's grid on the GPU, 16-bit queries of head_dim <= 128 (what the engine's
    decode graphs launch): (batch // BLOCK_Q + num_groups) x kv heads x chunks. Most of them find no rows when
    the groups are few and the static group buffers many; each still costs a launch (engine/prefix_groups.py)."""
    block_q = paged_attention.query_tile(paged_attention.PREFILL_CFG["gpu"], num_q_heads // num_kv_heads, None, True)[1]
    chunks = prefix_num_chunks(batch, num_kv_heads, block_q, max_ctx, device)
    return (batch // block_q + num_groups) * num_kv_heads * chunks


def _launch_prefix(q, key_cache, value_cache, block_tables, scale, cu_group_rows, group_prefix_lens,
                   ctx_start, partials, num_chunks, block_m, block_q, cfg):
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    num_groups = group_prefix_lens.shape[0]
    decode_block_n = paged_attention.decode_cfg(q, key_cache, short_contexts=True)["BLOCK_N"]
    part_o, part_lse = partials
    _prefix_kernel[(B // block_q + num_groups, Hkv, num_chunks)](
        q, key_cache, value_cache, block_tables, cu_group_rows, group_prefix_lens, ctx_start, part_o, part_lse,
        float(scale) * LOG2E, num_groups, num_chunks, Hq,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        G=Hq // Hkv, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=D, BLOCK_D=part_o.shape[3], BLOCK_SIZE=bs,
        BLOCK_N=cfg["BLOCK_N"], ALIGN=decode_block_n if bs % decode_block_n == 0 else 1,
        BLOCK_S=part_lse.shape[2], DOT_PREC=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q, key_cache),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def cascade_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, cu_group_rows,
                             group_prefix_lens, max_group_rows: Optional[int] = None,
                             num_chunks: Optional[int] = None, num_splits: Optional[int] = None, out=None):
    """max_group_rows: optional CPU-side bound of the rows per group; only picks a smaller row tile.
    num_chunks / num_splits: force the partition counts of the prefix / suffix passes (tests,
    benchmarks); None picks them from shapes."""
    if group_prefix_lens.shape[0] == 0:  # no groups (a shape): plain decode, at no extra cost
        return paged_attention.paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                                      num_splits=num_splits, out=out)
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    cfg = paged_attention.prefill_cfg(q, key_cache)
    block_m, block_q = paged_attention.query_tile(cfg, Hq // Hkv, max_group_rows, q.is_cuda)
    max_ctx = block_tables.shape[1] * bs
    if num_chunks is None:
        num_chunks = prefix_num_chunks(B, Hkv, block_q, max_ctx, q.device)
    if num_splits is None:
        num_splits = paged_attention.decode_num_splits(B, Hkv, max_ctx, q.device, balance=False)
    num_chunks, num_splits = max(1, int(num_chunks)), max(1, int(num_splits))
    partials = paged_attention.decode_partials(q, num_chunks + num_splits)
    ctx_start = torch.zeros(B, dtype=torch.int32, device=q.device)
    _launch_prefix(q, key_cache, value_cache, block_tables, scale, cu_group_rows, group_prefix_lens,
                   ctx_start, partials, num_chunks, block_m, block_q, cfg)
    paged_attention.launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, num_splits,
                                  partials=partials, ctx_start=ctx_start, first_slot=num_chunks, short_contexts=True)
    paged_attention.launch_reduce(partials, out, num_chunks + num_splits, ctx_start=ctx_start,
                                  num_prefix_slots=num_chunks)
    return out

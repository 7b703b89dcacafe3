"""Triton versions of the paged attention ops (contracts: ops/paged_attention_reference.py and docs/design.md).

    paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale,
                           max_seq_len=None, num_splits=None, row_order=None) -> out
    paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                            max_seqlen_q=None) -> out

None of them synchronises with the host: grids and split counts come from shapes (and from the
optional CPU-side hints), never from the values of seq_lens / cu_seqlens_q, so they can be captured
in CUDA graphs.

Kernels (the cache write is ops/fused.py's, inside rope_and_write_kv_cache):
- decode: one program per (sequence, kv head, split), a sequence's programs started together, the
  sequences in an optional row_order (longest first: over contexts of mixed lengths the last wave then
  holds the short ones). The G = Hq // Hkv query heads of a kv head are packed into a tile of
  max(16, next_pow2(G)) rows, so each K/V tile is read once per kv head and both products go through
  tl.dot. Online softmax over the sequence's tokens, in tiles of BLOCK_N tokens; each token's
  physical block comes from the block table (one scalar look-up per tile when the block size is a
  multiple of BLOCK_N). Over an e4m3 cache on Hopper (split_query) the products run transposed,
  tokens x heads, with the keys as stored against the query split into two e4m3 parts
  (attend_range_split_query); there a launch over whole contexts goes to the same algorithm written in
  Gluon, with the K/V tiles copied asynchronously into shared memory (ops/paged_attention_gluon.py).
  Split-KV (flash-decoding): when
  B * Hkv programs cannot fill the GPU, each sequence's tokens are cut into NUM_SPLITS balanced
  ranges (computed in the kernel from seq_len), written as partial (out, log-sum-exp) pairs, and a
  second kernel merges them (one program per row and tile of heads). Cascade decode (ops/cascade.py)
  reuses both: the decode kernel over each row's [ctx_start, seq_len) into the partial slots after its
  shared prefix's, the reduce over all.
- prefill: one program per (query tile, kv head). A query tile packs BLOCK_Q tokens x G heads
  into BLOCK_M rows; the query tiles of all sequences are enumerated without host knowledge
  (grid T // BLOCK_Q + B, each program finds its sequence by binary search over cu_seqlens_q).
  The key loop has an unmasked part (keys every row may see) and a masked diagonal part.
Every read is bounded by seq_len: no read of block-table padding, of -1 entries, or of unused
slots of a sequence's last block.
The kernels' shared pieces, which ops/cascade.py's kernels use too: tile_owner, load_query_tile,
attend_range and store_partial (Triton functions), dot_dtype, dot_precision and sm_count (their launches').
"""
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ops import paged_attention_gluon, paged_attention_reference
from ops.fused import TL_DTYPES

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# shared pieces of the attention kernels (ops/cascade.py's too)
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_kv_tile(kc_head, vc_head, bt_row, n0, kv_end, s_kcb, s_kct, s_kcd, s_vcb, s_vct, s_vcd,
                  offs_n, offs_d, d_mask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KV: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] K and V tiles of keys n0 .. n0 + BLOCK_N as the cache stores them, their
    positions and which of them lie before kv_end (MASK_KV; the others read as zeros), each key's physical
    block from the block table."""
    pos = n0 + offs_n
    if MASK_KV:
        n_mask = pos < kv_end
    else:
        n_mask = pos >= 0
    if BLOCK_SIZE % BLOCK_N == 0:
        # the whole tile lies in one block (n0 is a multiple of BLOCK_N): one scalar look-up
        blk = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = (pos % BLOCK_SIZE).to(tl.int64)
    k_off = blk * s_kcb + slot * s_kct
    v_off = blk * s_vcb + slot * s_vct
    if MASK_KV:
        mask = n_mask[:, None] & d_mask[None, :]
    else:
        mask = d_mask[None, :]
    k = tl.load(kc_head + k_off[:, None] + offs_d[None, :] * s_kcd, mask=mask, other=0.0)
    v = tl.load(vc_head + v_off[:, None] + offs_d[None, :] * s_vcd, mask=mask, other=0.0)
    return k, v, pos, n_mask


@triton.jit
def _attn_tile(
    q, acc, m_i, l_i, qk_scale, q_pos,
    kc_head, vc_head, bt_row, n0, kv_end,
    s_kcb, s_kct, s_kcd, s_vcb, s_vct, s_vcd,
    offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KV: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One step of the online softmax over keys n0 .. n0 + BLOCK_N (log2 domain).
    MASK_KV: bound keys by kv_end; CAUSAL: also mask keys after each row's q_pos."""
    k, v, pos, n_mask = _load_kv_tile(kc_head, vc_head, bt_row, n0, kv_end, s_kcb, s_kct, s_kcd, s_vcb, s_vct, s_vcd,
                                      offs_n, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, MASK_KV)
    k = k.to(q.dtype)  # the dot dtype (dot_dtype): an FP8 cache's keys widened to it
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if CAUSAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    elif MASK_KV:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if v.dtype.is_fp8():
        # widened before tl.dot's operand layout: the PV product reads v transposed, which Triton otherwise
        # does a byte at a time from shared memory (on the H200 the decode kernel took 5-6% longer so)
        v = tl.where(n_mask[:, None], v.to(q.dtype), 0.0)
    else:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def tile_owner(cu_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Tiles of BLOCK_Q rows over the row ranges cu[b]:cu[b+1] (cu[0] = 0, nondecreasing), enumerated
    without host knowledge: range b owns programs [cu[b] // BLOCK_Q + b, .. + cdiv(len(b), BLOCK_Q)),
    so a grid of cu[-1] // BLOCK_Q + num_seqs programs covers every tile. Binary search over cu.
    Returns (b, first row of b, len(b), this tile's first row within b); a program whose tile starts at
    or after len(b) has no work."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    return b, start, length, (pid - (start // BLOCK_Q + b)) * BLOCK_Q


@triton.jit
def load_query_tile(q_ptr, q_rows, heads, row_mask, offs_d, d_mask, s_qt, s_qh, s_qd,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The [BLOCK_M, BLOCK_D] query tile whose row i is query row q_rows[i], head heads[i], in DOT_DTYPE, the
    dtype tl.dot gets and the K/V tiles are read in (dot_dtype), and a fresh online-softmax state."""
    q = tl.load(q_ptr + q_rows[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    return q, m_i, l_i, acc


@triton.jit
def attend_range(
    q, acc, m_i, l_i, qk_scale, kc_ptr, vc_ptr, kvh, bt_row, start, end,
    s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, MASK_KV: tl.constexpr = True,
):
    """Online softmax of the tile q over keys [start, end) of kv head kvh, every query seeing every key
    (start: a multiple of BLOCK_N when BLOCK_SIZE % BLOCK_N == 0). MASK_KV=False: end - start is a multiple
    of BLOCK_N (no key to mask)."""
    offs_n = tl.arange(0, BLOCK_N)
    kc_head = kc_ptr + kvh.to(tl.int64) * s_kch
    vc_head = vc_ptr + kvh.to(tl.int64) * s_vch
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            q, acc, m_i, l_i, qk_scale, m_i,  # (q_pos: unused, not CAUSAL)
            kc_head, vc_head, bt_row, n0, end,
            s_kcb, s_kct, s_kcd, s_vcb, s_vct, s_vcd,
            offs_n, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, MASK_KV, False, DOT_PREC,
        )
    return acc, m_i, l_i


@triton.jit
def split_query_fp8(q):
    """q [BLOCK_M, BLOCK_D] float32 as two e4m3 parts and a scale per row: q * scale ~= hi + lo, hi the
    rounding of q * scale and lo the rounding of what hi leaves. Each row is scaled to e4m3's largest finite
    value (448), so hi + lo holds each element to about 2^-8 of itself (a bfloat16 query's rounding is
    2^-9) or 2^-19 of its row's largest, whichever is larger (a row of zeros: scale 1)."""
    amax = tl.max(tl.abs(q), 1)
    scale = tl.where(amax > 0.0, 448.0 / amax, 1.0)
    q = q * scale[:, None]
    hi = q.to(tl.float8e4nv)
    lo = (q - hi.to(tl.float32)).to(tl.float8e4nv)
    return hi, lo, scale


@triton.jit
def attend_range_split_query(
    q_hi_t, q_lo_t, qk_cols, acc_t, m_i, l_i, kc_ptr, vc_ptr, kvh, bt_row, start, end,
    s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PV_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """attend_range over an e4m3 cache with the products transposed: scores [BLOCK_N, BLOCK_M] = K q_hi^T +
    K q_lo^T (split_query_fp8's parts, transposed), so the keys go to FP8 tensor cores as stored, with no
    widening, and the tokens fill the product's 64-row side where the few query heads could not;
    acc_t [BLOCK_D, BLOCK_M] += V^T P^T in PV_DTYPE. qk_cols [BLOCK_M]: each head's qk_scale over its
    split scale. m_i, l_i: per head, as in attend_range."""
    offs_n = tl.arange(0, BLOCK_N)
    kc_head = kc_ptr + kvh.to(tl.int64) * s_kch
    vc_head = vc_ptr + kvh.to(tl.int64) * s_vch
    for n0 in range(start, end, BLOCK_N):
        k, v, pos, n_mask = _load_kv_tile(kc_head, vc_head, bt_row, n0, end, s_kcb, s_kct, s_kcd, s_vcb, s_vct,
                                          s_vcd, offs_n, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True)
        s = tl.dot(k, q_lo_t, tl.dot(k, q_hi_t)) * qk_cols[None, :]
        s = tl.where(n_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        # widened in the load's layout before the transpose (see _attn_tile)
        v_t = tl.trans(tl.where(n_mask[:, None], v.to(PV_DTYPE), 0.0))
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p.to(PV_DTYPE), input_precision=DOT_PREC)
        m_i = m_new
    return acc_t, m_i, l_i


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["s_btb", "first_slot"])
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, ctx_start_ptr, order_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, num_splits, first_slot, num_q_heads,
    s_qb, s_qh, s_qd,
    s_kcb, s_kch, s_kct, s_kcd, s_vcb, s_vch, s_vct, s_vcd,
    s_btb,
    s_ob, s_oh, s_od,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_CTX_START: tl.constexpr, HAS_ORDER: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DTYPE: tl.constexpr,
    SPLIT_QUERY: tl.constexpr,
):
    """Attention of each sequence's query over its tokens [ctx_start, seq_len) (ctx_start 0 unless
    HAS_CTX_START; then it must be a multiple of BLOCK_N when BLOCK_SIZE % BLOCK_N == 0). SPLIT writes
    partial (out, log2-sum-exp) pairs to slots first_slot + split instead of the output. A 1-D grid of
    B x Hkv x num_splits programs, row-major: the i-th row taken is row_order[i] with HAS_ORDER, else i.
    SPLIT_QUERY (an e4m3 cache, split_query): the products run transposed against the query's two e4m3
    parts, DOT_DTYPE then being V's (attend_range_split_query).
    The GPU starts programs in grid order, so a longest-first order leaves the short rows for the last
    wave."""
    pid = tl.program_id(0)
    per_row = (num_q_heads // G) * num_splits
    i = pid // per_row
    kvh = (pid % per_row) // num_splits
    split = pid % num_splits
    if HAS_ORDER:
        b = tl.load(order_ptr + i)
    else:
        b = i
    seq_len = tl.load(seqlen_ptr + b)
    if HAS_CTX_START:
        ctx_start = tl.load(ctx_start_ptr + b)
    else:
        ctx_start = 0
    if SPLIT:
        per = tl.cdiv(tl.cdiv(seq_len - ctx_start, num_splits), BLOCK_N) * BLOCK_N
        start = ctx_start + split * per
        end = tl.minimum(start + per, seq_len)
    else:
        start = ctx_start
        end = seq_len

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * G + offs_g
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    if SPLIT_QUERY:
        q, m_i, l_i, acc = load_query_tile(q_ptr, b.to(tl.int64) + 0 * offs_g, heads, g_mask, offs_d, d_mask,
                                           s_qb, s_qh, s_qd, BLOCK_G, BLOCK_D, tl.float32)
        q_hi, q_lo, q_scale = split_query_fp8(q)
        acc_t, m_i, l_i = attend_range_split_query(
            tl.trans(q_hi), tl.trans(q_lo), qk_scale / q_scale, tl.trans(acc), m_i, l_i, kc_ptr, vc_ptr, kvh, bt_row,
            start, end, s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PREC,
        )
        acc = tl.trans(acc_t)
    else:
        q, m_i, l_i, acc = load_query_tile(q_ptr, b.to(tl.int64) + 0 * offs_g, heads, g_mask, offs_d, d_mask,
                                           s_qb, s_qh, s_qd, BLOCK_G, BLOCK_D, DOT_DTYPE)
        acc, m_i, l_i = attend_range(
            q, acc, m_i, l_i, qk_scale, kc_ptr, vc_ptr, kvh, bt_row, start, end,
            s_kch, s_kcb, s_kct, s_kcd, s_vch, s_vcb, s_vct, s_vcd, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, DOT_PREC,
        )
    if SPLIT:
        rows = b.to(tl.int64) * num_q_heads + heads
        store_partial(part_o_ptr, part_lse_ptr, rows, first_slot + split, acc, m_i, l_i, offs_d,
                      g_mask, d_mask, BLOCK_S, BLOCK_D)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od,
                 (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def store_partial(part_o_ptr, part_lse_ptr, rows, slot, acc, m_i, l_i, offs_d, row_mask, d_mask,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Partial results of (row, q head) pairs rows (= row * Hq + head) in slot: o [.., BLOCK_S, BLOCK_D]
    and log2-sum-exp [.., BLOCK_S] (float32, contiguous); an empty range stores only lse = -inf (the
    reduce reads no o of such a slot)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    idx = rows * BLOCK_S + slot
    tl.store(part_o_ptr + idx[:, None] * BLOCK_D + offs_d[None, :], acc / l_safe[:, None],
             mask=(row_mask & (l_i > 0.0))[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + idx, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=row_mask)


@triton.jit(do_not_specialize=["num_slots", "num_prefix_slots"])
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, prefix_slots_ptr, out_ptr, num_slots, num_prefix_slots, num_q_heads,
    s_ob, s_oh, s_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    """Log-sum-exp merge of slots [0, num_slots) of BLOCK_H q heads of a row (a [BLOCK_H, BLOCK_S,
    BLOCK_D] tile: one program per (row, BLOCK_H heads), so a step's merge is a wave of sizeable
    programs, not one tiny program per head). HAS_PREFIX: slots [0, num_prefix_slots) hold a shared
    prefix's partials, of which a row's first prefix_slots[b] are valid."""
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_q_heads
    row = (b.to(tl.int64) * num_q_heads + offs_h)[:, None] * BLOCK_S + offs_s[None, :]
    s_mask = h_mask[:, None] & (offs_s < num_slots)[None, :]
    if HAS_PREFIX:
        s_mask = s_mask & ((offs_s >= num_prefix_slots) | (offs_s < tl.load(prefix_slots_ptr + b)))[None, :]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])
    d_mask = offs_d < HEAD_DIM
    o = tl.load(part_o_ptr + row[:, :, None] * BLOCK_D + offs_d[None, None, :],
                mask=(lse > float("-inf"))[:, :, None] & d_mask[None, None, :], other=0.0)
    den = tl.sum(w, 1)
    den = tl.where(den > 0.0, den, 1.0)
    res = tl.sum(w[:, :, None] * o, 1) / den[:, None]
    tl.store(out_ptr + b.to(tl.int64) * s_ob + offs_h[:, None] * s_oh + offs_d[None, :] * s_od,
             res.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device):
    """The device's streaming multiprocessors, which the grid heuristics fill."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # interpreter: behave as on an H200 so that CPU tests take the same paths


# Tunables (the benchmarks may override them), picked by decode_cfg.
DECODE_CFG = {
    "gpu": dict(BLOCK_N=64, num_warps=4, num_stages=3),
    # the cascade's suffix pass: each row's own context is short, so a smaller last tile wastes less
    # (benchmarks/NOTES.md, version 26)
    "gpu_short": dict(BLOCK_N=32, num_warps=4, num_stages=2),
    # head_dim <= 64 (Qwen2.5-0.5B, Llama-3.2-1B): the fastest of 12 tiles on the H200 over 4 shapes, 10-18%
    # faster than "gpu" there (benchmarks/NOTES.md, session 34)
    "gpu_small_d": dict(BLOCK_N=64, num_warps=2, num_stages=2),
    "gpu_fp32": dict(BLOCK_N=32, num_warps=4, num_stages=2),
    # an FP8 cache the split query does not take: the fastest of 24 tiles on the H200 over 3 shapes
    # (benchmarks/NOTES.md, sessions 25 and 27)
    "gpu_fp8": dict(BLOCK_N=128, num_warps=4, num_stages=3),
    # an e4m3 cache on Hopper, split query (split_query): the fastest of 18 tiles and register caps on the
    # H200 over 4 shapes (benchmarks/NOTES.md, session 28)
    "gpu_fp8_split_query": dict(BLOCK_N=128, num_warps=4, num_stages=1),
    "interp": dict(BLOCK_N=32, num_warps=4, num_stages=1),
}
SPLIT_MIN_TOKENS = 128      # never cut a sequence into pieces shorter than this (on average)
SPLIT_TARGET_WAVES = 2      # split until the GPU has this many programs per SM (it is full) ...
BALANCE_WAVES = 4           # ... and, up to BALANCE_MAX_SPLITS, until it has this many: over contexts of
BALANCE_MAX_SPLITS = 8      # mixed lengths the longest leave a wave's tail (benchmarks/NOTES.md, versions
                            # 17 and 22: with the rows longest first 4 waves suffice, not 8)
SPLIT_MAX = 64
REDUCE_TILE_ELEMENTS = 16384  # partial-output elements one merge program holds (64 per thread at 8 warps)


def decode_num_splits(batch, num_kv_heads, max_ctx, device, balance=True):
    """Power-of-two number of KV partitions, from shapes only (no device values); each at least
    SPLIT_MIN_TOKENS of max_ctx on average. balance=False: only as many as fill the GPU (cascade's
    suffix pass: its contexts are short; the Gluon kernel's launches, which were 5-15% faster with half the
    balanced count at 16-64 rows over mixed lengths on the H200: benchmarks/NOTES.md, session 32)."""
    programs = batch * num_kv_heads
    sms = sm_count(device)
    want = triton.cdiv(SPLIT_TARGET_WAVES * sms, programs)
    if balance:
        want = max(want, min(BALANCE_MAX_SPLITS, triton.cdiv(BALANCE_WAVES * sms, programs)))
    n = min(want, triton.cdiv(max_ctx, SPLIT_MIN_TOKENS), SPLIT_MAX)
    return 1 << (n - 1).bit_length() if n > 1 else 1  # round up to a power of two


def dot_dtype(q, key_cache):
    """The dtype the attention kernels multiply in (DOT_DTYPE): float32 in the interpreter, whose 16-bit tl.dot
    is wrong in Triton 3.9; float16 for bfloat16 queries over an FP8 cache, because e4m3 and e5m2 widen to
    float16 in one instruction a pair where bfloat16 takes three (it holds every FP8 value exactly, and a
    bfloat16 query too, up to float16's range of 65504); else the query's dtype."""
    if not q.is_cuda:
        return tl.float32
    if key_cache.dtype in paged_attention_reference.FP8_DTYPES and q.dtype == torch.bfloat16:
        return tl.float16
    return TL_DTYPES[q.dtype]


def dot_precision(dtype):
    """tl.dot's input_precision (DOT_PREC) for queries of this dtype (the K/V tiles are read in it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _capability(device_index):
    return torch.cuda.get_device_capability(device_index)


def split_query(q, key_cache):
    """Whether the decode kernel multiplies an e4m3 cache's keys as stored, by the query split into two e4m3
    parts (split_query_fp8, attend_range_split_query): on Hopper (compute capability 9.0), whose FP8 tensor
    cores Triton reaches from a tile of 64 tokens; elsewhere the keys widen to DOT_DTYPE."""
    if key_cache.dtype != torch.float8_e4m3fn or not q.is_cuda or q.dtype == torch.float32:
        return False
    return _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) == (9, 0)


def decode_cfg(q, key_cache, short_contexts=False, split=False):
    """The DECODE_CFG entry of a decode launch; split: the launch takes the split query (split_query)."""
    if not q.is_cuda:
        return DECODE_CFG["interp"]
    if q.dtype == torch.float32:
        return DECODE_CFG["gpu_fp32"]
    if short_contexts:
        return DECODE_CFG["gpu_short"]
    if split:
        return DECODE_CFG["gpu_fp8_split_query"]
    if key_cache.dtype in paged_attention_reference.FP8_DTYPES:
        return DECODE_CFG["gpu_fp8"]
    return DECODE_CFG["gpu_small_d" if q.shape[2] <= 64 else "gpu"]


def decode_partials(q, num_slots):
    """Buffers of partial (out, log2-sum-exp) per (row, q head, slot): [B, Hq, S, BLOCK_D], [B, Hq, S]
    with S = next_pow2(num_slots)."""
    B, Hq, D = q.shape
    S = triton.next_power_of_2(num_slots)
    return (torch.empty((B, Hq, S, triton.next_power_of_2(D)), dtype=torch.float32, device=q.device),
            torch.empty((B, Hq, S), dtype=torch.float32, device=q.device))


def launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, num_splits, out=None,
                  partials=None, ctx_start=None, first_slot=0, row_order=None, short_contexts=False):
    """The decode kernel over B x Hkv x num_splits programs: into out, or, given partials (see
    decode_partials), into their slots first_slot .. first_slot + num_splits - 1. ctx_start [B] int32
    (optional): each row attends to tokens [ctx_start, seq_len) only. row_order [B] int32 (optional):
    a permutation of the rows, the order in which their programs start. short_contexts: the tiles for
    ranges of a few hundred tokens (decode_cfg). A split-query launch over whole contexts goes to the Gluon
    kernel where it takes the shapes (ops/paged_attention_gluon.py)."""
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    split_q = split_query(q, key_cache)
    split = partials is not None
    if ctx_start is None and not short_contexts and gluon_takes(q, key_cache, value_cache, out):
        paged_attention_gluon.launch_decode(q, key_cache, value_cache, block_tables, seq_lens, float(scale) * LOG2E,
                                            num_splits, out, partials, first_slot, row_order)
        return
    cfg = decode_cfg(q, key_cache, short_contexts, split_q)
    part_o, part_lse = partials if split else (out, out)
    out = out if out is not None else q  # unused when split
    _decode_kernel[(B * Hkv * num_splits,)](
        q, key_cache, value_cache, block_tables, seq_lens, ctx_start if ctx_start is not None else seq_lens,
        row_order if row_order is not None else seq_lens, out, part_o, part_lse,
        float(scale) * LOG2E, num_splits, first_slot, Hq,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0), *out.stride(),
        G=Hq // Hkv, BLOCK_G=max(16, triton.next_power_of_2(Hq // Hkv)), HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D), BLOCK_SIZE=bs, BLOCK_N=cfg["BLOCK_N"], SPLIT=split,
        BLOCK_S=part_lse.shape[2] if split else 1, HAS_CTX_START=ctx_start is not None,
        HAS_ORDER=row_order is not None, DOT_PREC=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q, key_cache),
        SPLIT_QUERY=split_q, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def gluon_takes(q, key_cache, value_cache, out=None):
    """Whether a split-query decode launch over whole contexts of these tensors runs the Gluon kernel."""
    return split_query(q, key_cache) and paged_attention_gluon.takes(q, key_cache, value_cache, out)


def launch_reduce(partials, out, num_slots, prefix_slots=None, num_prefix_slots=0):
    """out[b, h] = the log-sum-exp merge of partial slots [0, num_slots); with prefix_slots (int32 [B]),
    of slots [0, num_prefix_slots) only a row's first prefix_slots[b] count."""
    part_o, part_lse = partials
    B, Hq, D = out.shape
    block_s, block_d = part_lse.shape[2], part_o.shape[3]
    block_h = min(triton.next_power_of_2(Hq), max(1, REDUCE_TILE_ELEMENTS // (block_s * block_d)))
    _decode_reduce_kernel[(B, triton.cdiv(Hq, block_h))](
        part_o, part_lse, prefix_slots if prefix_slots is not None else part_lse, out,
        num_slots, num_prefix_slots, Hq, *out.stride(),
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_H=block_h, HAS_PREFIX=prefix_slots is not None,
        num_warps=8,
    )


def paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale,
                           max_seq_len: Optional[int] = None, num_splits: Optional[int] = None, row_order=None,
                           out=None):
    """max_seq_len: optional CPU-side bound of seq_lens; it only sizes the split-KV grid (results are
    right whatever its value, since each split's range is computed in the kernel from seq_len).
    num_splits: force the number of KV partitions (tests, benchmarks); None picks it from shapes.
    row_order: optional int32 [B] permutation, the order in which the rows' programs start (longest
    first shortens the last wave over mixed lengths); results do not depend on it."""
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    max_ctx = block_tables.shape[1] * bs
    if max_seq_len is not None:
        max_ctx = min(max_ctx, int(max_seq_len))
    if num_splits is None:
        num_splits = decode_num_splits(B, Hkv, max_ctx, q.device, balance=not gluon_takes(q, key_cache, value_cache, out))
    num_splits = max(1, int(num_splits))
    if num_splits == 1:
        launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, 1, out=out, row_order=row_order)
        return out
    partials = decode_partials(q, num_splits)
    launch_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, num_splits, partials=partials,
                  row_order=row_order)
    launch_reduce(partials, out, num_splits)
    return out


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
# Integer arguments that change from call to call are not specialised: Triton would otherwise compile
# a new variant whenever one of them becomes 1 or a multiple of 16 (seconds, inside a timed run).
@triton.jit(do_not_specialize=["num_seqs", "s_btb"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, seqlen_ptr, out_ptr,
    qk_scale, num_seqs,
    s_qt, s_qh, s_qd,
    s_kcb, s_kch, s_kct, s_kcd, s_vcb, s_vch, s_vct, s_vcd,
    s_btb,
    s_ot, s_oh, s_od,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b, q_start, len_q, q_block_start = tile_owner(cu_ptr, num_seqs, pid, BLOCK_Q)
    if q_block_start >= len_q:
        return
    seq_len = tl.load(seqlen_ptr + b)
    ctx = seq_len - len_q

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_block_start + offs_m // G
    heads = kvh * G + offs_m % G
    row_mask = (offs_m < BLOCK_Q * G) & (tok < len_q)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx + tok
    q_rows = (q_start + tok).to(tl.int64)
    q, m_i, l_i, acc = load_query_tile(q_ptr, q_rows, heads, row_mask, offs_d, d_mask, s_qt, s_qh, s_qd,
                                       BLOCK_M, BLOCK_D, DOT_DTYPE)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    kc_head = kc_ptr + kvh.to(tl.int64) * s_kch
    vc_head = vc_ptr + kvh.to(tl.int64) * s_vch

    first_pos = ctx + q_block_start                               # every row sees keys <= first_pos
    kv_end = ctx + tl.minimum(q_block_start + BLOCK_Q, len_q)     # last row's position + 1
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            q, acc, m_i, l_i, qk_scale, q_pos,
            kc_head, vc_head, bt_row, n0, kv_end,
            s_kcb, s_kct, s_kcd, s_vcb, s_vct, s_vcd,
            offs_n, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, False, False, DOT_PREC,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            q, acc, m_i, l_i, qk_scale, q_pos,
            kc_head, vc_head, bt_row, n0, kv_end,
            s_kcb, s_kct, s_kcd, s_vcb, s_vct, s_vcd,
            offs_n, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, True, True, DOT_PREC,
        )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_rows[:, None] * s_ot + heads[:, None] * s_oh + offs_d[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


PREFILL_CFG = {
    "gpu": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    "gpu_large_d": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),  # head_dim > 128
    "gpu_fp32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    "interp": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
}


def prefill_cfg(q, key_cache, table=PREFILL_CFG):
    """The entry of a table of query-tile launches (PREFILL_CFG, ops.cascade.PREFIX_CFG) for q: the
    interpreter's, float32's, head_dim > 128's or the GPU's."""
    if not q.is_cuda:
        return table["interp"]
    if q.dtype == torch.float32:
        return table["gpu_fp32"]
    return table["gpu_large_d" if q.shape[2] > 128 else "gpu"]


def query_tile(cfg, G, max_rows, on_gpu):
    """(BLOCK_M, BLOCK_Q): a tile of BLOCK_M rows packs BLOCK_Q query rows x G heads. max_rows, a
    CPU-side bound of the rows per range, picks a smaller tile on the GPU."""
    BLOCK_M = max(cfg["BLOCK_M"], 16, triton.next_power_of_2(G))
    BLOCK_Q = BLOCK_M // G
    if max_rows is not None and on_gpu:
        # short query runs (e.g. many 1-token chunks) waste most rows of a 128-row tile
        while BLOCK_Q // 2 >= max(int(max_rows), 1) and BLOCK_M // 2 >= max(16, G):
            BLOCK_M //= 2
            BLOCK_Q = BLOCK_M // G
    return BLOCK_M, BLOCK_Q


def paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                            max_seqlen_q: Optional[int] = None, out=None):
    """max_seqlen_q: optional CPU-side upper bound of the query lengths; only picks a smaller query
    tile for short chunks. Without it the kernel still needs no host synchronisation."""
    T, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    out = torch.empty_like(q) if out is None else out
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    G = Hq // Hkv
    cfg = prefill_cfg(q, key_cache)
    BLOCK_M, BLOCK_Q = query_tile(cfg, G, max_seqlen_q, q.is_cuda)
    grid = (T // BLOCK_Q + B, Hkv)
    _prefill_kernel[grid](
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out,
        float(scale) * LOG2E, B,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0), *out.stride(),
        G=G, BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_SIZE=bs, BLOCK_N=cfg["BLOCK_N"], DOT_PREC=dot_precision(q.dtype), DOT_DTYPE=dot_dtype(q, key_cache),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out

"""The decode kernel over an e4m3 cache on Hopper, in Gluon (Triton's explicit-layout dialect).

The same split query as ops/paged_attention.py's attend_range_split_query: the scores of a tile of BLOCK_N
tokens, transposed, S^T [BLOCK_N, BLOCK_G] = K q_hi^T + K q_lo^T on FP8 tensor cores, the keys as stored; then
acc^T [D, BLOCK_G] += V^T P^T in float16. What Gluon adds is the memory path Triton's compiler does not choose:
each tile's K and V are copied by cp.async straight into swizzled shared memory, two tiles in flight; the keys
feed the first product from there, V^T goes to registers widened to float16 as the second product's first
operand, and P^T is the only tile the kernel writes to shared memory itself. On the H200 it reads the cache at
2.7-3.3 TB/s where the Triton kernel reads 2.6-2.8 (benchmarks/NOTES.md, session 31).

Shapes: q [B, Hq, D] (bfloat16 or float16); caches [num_blocks, Hkv, block_size, D] float8_e4m3fn; D one of
SUPPORTED_HEAD_DIMS (the first product's reduction and the second's 64-row side); up to GROUP_TILE query
heads per KV head (the products' other side, padded to GROUP_TILE)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

# Triton 3.6's names for cp.async into shared memory and the CTA barrier (later versions: async_load, barrier)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
SUPPORTED_HEAD_DIMS = (64, 128, 256)
GROUP_TILE = 16  # the one group tile built and measured; larger groups (rare) stay with the Triton kernel
# The fastest of 8 tiles (64/128 tokens, 4/8 warps, 2/3 stages, V through shared memory or registers) at the
# four shapes of benchmarks/decode_kernel.py on the H200 (benchmarks/NOTES.md, session 31)
BLOCK_N, NUM_WARPS, STAGES = 64, 4, 2


def takes(q, key_cache, value_cache, out=None):
    """Whether this kernel takes a decode launch that ops/paged_attention.py gives the split query: CUDA
    tensors of the shapes above, each with its last dimension contiguous, and caches whose rows cp.async can
    copy (16-byte aligned)."""
    if not q.is_cuda or q.shape[-1] not in SUPPORTED_HEAD_DIMS or q.shape[1] // key_cache.shape[1] > GROUP_TILE:
        return False
    tensors = (q, key_cache, value_cache) + ((out,) if out is not None else ())
    return all(t.stride(-1) == 1 for t in tensors) and all(
        c.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in c.stride()[:3]) for c in (key_cache, value_cache))


@gluon.jit
def _issue_tile(k_dst, v_dst, kc, vc, bt_row, n0, end, offs_n, offs_d, s_kcb, s_kct, s_vcb, s_vct,
                BLOCK_SIZE: gl.constexpr):
    """cp.async of tokens n0 .. n0 + BLOCK_N's K and V rows, as stored, into k_dst and v_dst, as one group;
    tokens at or past end are not read (their rows fill with zeros)."""
    pos = n0 + offs_n
    n_mask = pos < end
    blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(gl.int64)
    slot = (pos % BLOCK_SIZE).to(gl.int64)
    mask = n_mask[:, None] & (offs_d >= 0)[None, :]
    _async_load(k_dst, kc + (blk * s_kcb + slot * s_kct)[:, None] + offs_d[None, :], mask)
    _async_load(v_dst, vc + (blk * s_vcb + slot * s_vct)[:, None] + offs_d[None, :], mask)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["s_btb", "first_slot"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, order_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                   qk_scale, num_splits, first_slot, s_qb, s_qh, s_kcb, s_kch, s_kct, s_vcb, s_vch, s_vct, s_btb,
                   s_ob, s_oh,
                   NUM_KV_HEADS: gl.constexpr, G: gl.constexpr, BLOCK_G: gl.constexpr, D: gl.constexpr,
                   BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                   BLOCK_S: gl.constexpr, HAS_ORDER: gl.constexpr, num_warps: gl.constexpr):
    """ops/paged_attention.py's _decode_kernel for a split-query launch without ctx_start: B x Hkv x num_splits
    programs, row-major (the i-th row taken is row_order[i] with HAS_ORDER); SPLIT writes partial (out,
    log2-sum-exp) pairs to slot first_slot + split of part_o [B, Hq, BLOCK_S, D] and part_lse [B, Hq, BLOCK_S]."""
    pid = gl.program_id(0)
    i = pid // (NUM_KV_HEADS * num_splits)
    kvh = (pid // num_splits) % NUM_KV_HEADS
    split = pid % num_splits
    if HAS_ORDER:
        b = gl.load(order_ptr + i)
    else:
        b = i
    seq_len = gl.load(seqlen_ptr + b)
    if SPLIT:
        per = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per
        end = gl.minimum(start + per, seq_len)
    else:
        start = 0
        end = seq_len

    tile_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])  # 16-byte copies
    q_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    # a byte a thread: from q_l, Triton 3.6 writes 8-bit tiles with stmatrix (b16), and the product read the
    # query scrambled (the H200, session 31)
    q_store_l: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, num_warps], [0, 1])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_G, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_G, 16])
    v_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float8e4nv)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_G, D], gl.float8e4nv)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_G], gl.float16)

    # the query split in two e4m3 parts per head (ops/paged_attention.py, split_query_fp8)
    offs_g = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, q_l))
    offs_dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    q = gl.load(q_ptr + b.to(gl.int64) * s_qb + (kvh * G + offs_g)[:, None] * s_qh + offs_dq[None, :],
                mask=(offs_g < G)[:, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(q), axis=1)
    q_scale = gl.where(amax > 0.0, 448.0 / amax, 1.0)
    q = q * q_scale[:, None]
    hi = q.to(gl.float8e4nv)
    lo = (q - hi.to(gl.float32)).to(gl.float8e4nv)
    q_hi = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_G, D], q_sl, gl.convert_layout(hi, q_store_l))
    q_lo = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_G, D], q_sl, gl.convert_layout(lo, q_store_l))
    qk_cols = gl.convert_layout(qk_scale / q_scale, gl.SliceLayout(0, s_l))

    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], kv_sl)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], kv_sl)
    p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_G], p_sl)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile_l))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, tile_l))
    offs_ns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_l))
    m_i = gl.full([BLOCK_G], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_l))
    # each thread's share of the softmax sum, reduced across warps once after the loop: a reduction a tile
    # costs barriers, and dropping them took 6-13% off the kernel (benchmarks/NOTES.md, session 33)
    l_part = gl.zeros([BLOCK_N, BLOCK_G], gl.float32, layout=s_l)
    acc = gl.zeros([D, BLOCK_G], gl.float32, layout=o_l)
    s_zero = gl.zeros([BLOCK_N, BLOCK_G], gl.float32, layout=s_l)
    bt_row = bt_ptr + b.to(gl.int64) * s_btb
    kc = kc_ptr + kvh.to(gl.int64) * s_kch
    vc = vc_ptr + kvh.to(gl.int64) * s_vch
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    for st in gl.static_range(STAGES - 1):
        _issue_tile(k_bufs.index(st), v_bufs.index(st), kc, vc, bt_row, start + st * BLOCK_N, end, offs_n, offs_d,
                    s_kcb, s_kct, s_vcb, s_vct, BLOCK_SIZE)
    for t in range(num_tiles):
        n0 = start + t * BLOCK_N
        # the tile STAGES - 1 ahead goes out now (past the range it reads nothing, and the count of groups
        # in flight stays the same for the wait)
        ahead = t + STAGES - 1
        _issue_tile(k_bufs.index(ahead % STAGES), v_bufs.index(ahead % STAGES), kc, vc, bt_row,
                    start + ahead * BLOCK_N, end, offs_n, offs_d, s_kcb, s_kct, s_vcb, s_vct, BLOCK_SIZE)
        async_copy.wait_group(STAGES - 1)
        _barrier()
        k_smem = k_bufs.index(t % STAGES)
        v_t = v_bufs.index(t % STAGES).permute((1, 0)).load(v_l).to(gl.float16)
        fence_async_shared()
        _barrier()
        s = warpgroup_mma(k_smem, q_hi.permute((1, 0)), s_zero, use_acc=False)
        s = warpgroup_mma(k_smem, q_lo.permute((1, 0)), s) * qk_cols[None, :]
        s = gl.where((n0 + offs_ns < end)[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_part = l_part * alpha[None, :] + p
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        _barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_l))[None, :]
        acc = warpgroup_mma(v_t, p_smem, acc)
        m_i = m_new
        _barrier()  # every warp is done with this tile's buffers before they are refilled
    async_copy.wait_group(0)

    l_o = gl.convert_layout(gl.sum(l_part, axis=0), gl.SliceLayout(0, o_l))
    l_safe = gl.where(l_o > 0.0, l_o, 1.0)
    res = acc / l_safe[None, :]
    offs_do = gl.arange(0, D, layout=gl.SliceLayout(1, o_l))
    offs_go = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, o_l))
    g_mask = offs_go < G
    if SPLIT:  # as ops/paged_attention.py's store_partial: an empty range stores only lse = -inf
        idx = (b.to(gl.int64) * (NUM_KV_HEADS * G) + kvh * G + offs_go) * BLOCK_S + first_slot + split
        gl.store(part_o_ptr + idx[None, :] * D + offs_do[:, None], res, mask=(g_mask & (l_o > 0.0))[None, :])
        m_o = gl.convert_layout(m_i, gl.SliceLayout(0, o_l))
        gl.store(part_lse_ptr + idx, gl.where(l_o > 0.0, m_o + gl.log2(l_safe), float("-inf")), mask=g_mask)
    else:
        gl.store(out_ptr + b.to(gl.int64) * s_ob + (kvh * G + offs_go)[None, :] * s_oh + offs_do[:, None],
                 res.to(out_ptr.dtype.element_ty), mask=g_mask[None, :])


def launch_decode(q, key_cache, value_cache, block_tables, seq_lens, qk_scale, num_splits, out, partials,
                  first_slot, row_order):
    """ops/paged_attention.py's launch_decode for what takes() accepts; qk_scale in log2 units; partials as
    decode_partials makes them (num_splits > 1) or None; q's and the caches' last dimension contiguous."""
    B, Hq, D = q.shape
    _, Hkv, bs, _ = key_cache.shape
    G = Hq // Hkv
    split = partials is not None
    part_o, part_lse = partials if split else (out, out)
    out = out if out is not None else q  # unused when split
    _decode_kernel[(B * Hkv * num_splits,)](
        q, key_cache, value_cache, block_tables, seq_lens, row_order if row_order is not None else seq_lens,
        out, part_o, part_lse, qk_scale, num_splits, first_slot, q.stride(0), q.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
        value_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=Hkv, G=G, BLOCK_G=GROUP_TILE, D=D, BLOCK_SIZE=bs, BLOCK_N=BLOCK_N,
        STAGES=STAGES, SPLIT=split, BLOCK_S=part_lse.shape[2] if split else 1, HAS_ORDER=row_order is not None,
        num_warps=NUM_WARPS,
    )

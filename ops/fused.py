"""Triton versions of the fused elementwise ops of the decode step (contracts and PyTorch
references: ops/fused_reference.py).

    rms_norm(x[T,H], weight[H], eps) -> [T,H]
    rope_and_write_kv_cache(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], cos[P,D], sin[P,D], positions[T],
                            key_cache, value_cache, slot_mapping[T], qk_norm=None, input_norm=None,
                            bias=None) -> q'
    silu_and_mul(x[T, 2I], input_norm=None, bias=None, e4m3_rows=None) -> [T, I] (or its rows in e4m3)
    quantize_rows_to_e4m3(x[R, C], input_weight=None, rows=None) -> (float8_e4m3fn [rows, C], float32 [rows, 1])
    add_and_quantize_rows(residual[R, C], product[R, C], scales=None, input_weight=None, rows=None) -> (q, scale)

Each replaces a chain of small torch kernels by one pass over its inputs, reproducing the chain's
rounding steps (float32 math, casts to the model dtype where the torch code casts; a folded input norm's
rounding: ops/fused_reference.py). None of them
synchronises with the host (grids come from shapes only), so they can be captured in CUDA graphs.

Kernels:
- rms_norm: one program per row, the whole row in registers.
- input_norm (the RMSNorm folded into the projection before rope_and_write_kv_cache and silu_and_mul):
  each program reads its token's hidden row whole and computes the row's scale itself, which costs
  less than a norm kernel of its own (a decode step's ~2 us kernel and ~1 us gap, twice a layer).
- rope_and_write_kv_cache: one program per (token, group of heads), QK-norm a compile-time switch;
  each element also loads its rotary partner (d +- D/2) and normalises it with the same per-head
  scale, so no shuffle is needed. A program of k heads stores them, rotated, straight into the cache
  slot of its token, and copies the same heads of v there (write_kv_cache's work, without a kernel of
  its own or a k' tensor).
- silu_and_mul: one program per (row, tile of I); with e4m3_rows (the input of an FP8 down_proj), one
  program per row in two passes, as quantize_rows_to_e4m3's, which computes the product in each: a kernel
  and the bfloat16 row's store and loads saved.
- quantize_rows_to_e4m3 (the activations of an FP8 GEMM): one program per row, two passes over it (its
  largest magnitude, then the quotients), in place of torch's chain of eight kernels.
- add_and_quantize_rows (an FP8 o_proj's or down_proj's sum into the residual stream, which an FP8
  projection reads next): one program per row, the sum stored and its largest magnitude found in the first
  pass, the quotients in the second: the quantization's kernel saved.
The sampling kernels are in ops/sampling.py.
"""
import torch
import triton
import triton.language as tl

from ops.paged_attention_reference import E4M3_MAX


# a torch dtype's Triton type (a kernel's constexpr for roundings in the model's dtype)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _num_warps(block):
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


# --------------------------------------------------------------------------------------------
# rms_norm, and the input norm's scale of a row
# --------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, s_x, s_xc, s_o, s_oc, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * s_x + cols * s_xc, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    y = (x32 * inv).to(x.dtype).to(tl.float32)  # cast to x's dtype before the weight, as HF does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols * s_oc, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _inv_rms(row_ptr, s_c, n_cols, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(row^2) + eps) of one row of n_cols elements, in float32."""
    cols = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + cols * s_c, mask=cols < n_cols, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)


def rms_norm(x, weight, eps):
    T, H = x.shape
    weight = weight.contiguous()
    out = torch.empty((T, H), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if T > 0:
        block = triton.next_power_of_2(H)
        _rms_norm_kernel[(T,)](x, weight, out, H, float(eps), *x.stride(), *out.stride(), BLOCK=block,
                               num_warps=_num_warps(block))
    return out


def _input_norm_args(input_norm, x):
    """(hidden, H, its two strides, eps, BLOCK) of an op's input_norm = (hidden [T, H], eps); placeholders
    for None."""
    if input_norm is None:
        return x, 0, 0, 0, 0.0, 1
    hidden, eps = input_norm
    return hidden, hidden.shape[1], *hidden.stride(), float(eps), triton.next_power_of_2(hidden.shape[1])


# --------------------------------------------------------------------------------------------
# rope_and_write_kv_cache
# --------------------------------------------------------------------------------------------
@triton.jit
def _projection(x_ptr, x_offs, b_ptr, c_ptr, col, mask, row_scale, inv, DT: tl.constexpr, SCALED: tl.constexpr,
                INPUT_NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A projection's elements at x_ptr + x_offs, its weight's columns col, as the unfolded layers round them in
    the model's dtype DT: an FP8 product's scales first (SCALED: times row_scale, then the column scales at
    c_ptr + col, as scale_product), the matmul of the normalised hidden row (x * inv), plus the bias at
    b_ptr + col; in float32."""
    y = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        y = (y * row_scale * tl.load(c_ptr + col, mask=mask, other=0.0)).to(DT).to(tl.float32)
    if INPUT_NORM:
        y = (y * inv).to(DT).to(tl.float32)
    if HAS_BIAS:
        y = (y + tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
    return y


@triton.jit
def _narrowed(x, dtype: tl.constexpr):
    """x (float32, a value of the model's dtype) in dtype, an FP8 type's finite range first (beyond it its
    cast gives NaN or inf): how an FP8 KV cache stores K and V, unscaled (write_kv_cache's to_cache)."""
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    elif dtype == tl.float8e5:
        x = tl.minimum(tl.maximum(x, -57344.0), 57344.0)
    return x.to(dtype)


@triton.jit
def _rope_heads(
    x_ptr, b_ptr, c_ptr, o_ptr, w_ptr, cos_row, sin_row, s_cd,
    s_xh, s_xd, s_oh, s_od,
    h0, n_heads, eps, row_scale, inv, live,
    DT: tl.constexpr, SCALED: tl.constexpr, NORM: tl.constexpr, INPUT_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Heads h0 .. h0 + BLOCK_H of one token, rotated, stored at o_ptr when live is nonzero."""
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < HEAD_DIM
    mask = (h < n_heads) & d_mask
    first = d < HEAD_DIM // 2
    pd = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)  # rotary partner of d
    y = _projection(x_ptr, h * s_xh + d * s_xd, b_ptr, c_ptr, h * HEAD_DIM + d, mask, row_scale, inv,
                    DT, SCALED, INPUT_NORM, HAS_BIAS)
    yp = _projection(x_ptr, h * s_xh + pd * s_xd, b_ptr, c_ptr, h * HEAD_DIM + pd, mask, row_scale, inv,
                     DT, SCALED, INPUT_NORM, HAS_BIAS)
    if NORM:
        inv_head = tl.rsqrt(tl.sum(y * y, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + pd, mask=d_mask, other=0.0).to(tl.float32)
        # RMSNorm with the unfused rounding: weight * (x * inv).to(dtype), rounded to the dtype
        y = (w * (y * inv_head).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        yp = (wp * (yp * inv_head).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    rot = tl.where(first, -yp, yp)  # rotate_half: cat(-x2, x1)
    c = tl.load(cos_row + d * s_cd, mask=d_mask, other=0.0).to(DT).to(tl.float32)
    s = tl.load(sin_row + d * s_cd, mask=d_mask, other=0.0).to(DT).to(tl.float32)
    out = (y * c).to(DT).to(tl.float32) + (rot * s).to(DT).to(tl.float32)
    # (live + 0 * h) keeps the mask a block: the interpreter rejects a scalar & block mask
    stored = _narrowed(out.to(DT).to(tl.float32), o_ptr.dtype.element_ty)
    tl.store(o_ptr + h * s_oh + d * s_od, stored, mask=mask & ((live + 0 * h) != 0))


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, qb_ptr, kb_ptr, vb_ptr, qs_ptr, ks_ptr, vs_ptr, rs_ptr, hid_ptr, qw_ptr, kw_ptr,
    cos_ptr, sin_ptr, pos_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr,
    num_q_heads, num_kv_heads, n_hidden, eps, hid_eps,
    s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_ht, s_hc,
    s_qot, s_qoh, s_qod,
    s_kcb, s_kch, s_kct, s_kcd, s_vcb, s_vch, s_vct, s_vcd,
    s_cp, s_cd,
    SCALED: tl.constexpr, NORM: tl.constexpr, INPUT_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """SCALED: q, k and v are an FP8 product still to be scaled, by each token's row scale at rs_ptr and the
    column scales at qs_ptr, ks_ptr and vs_ptr; the roundings are in the dtype of q's output."""
    DT: tl.constexpr = qo_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos_row = cos_ptr + pos * s_cp
    sin_row = sin_ptr + pos * s_cp
    inv = 1.0
    if INPUT_NORM:
        inv = _inv_rms(hid_ptr + t * s_ht, s_hc, n_hidden, hid_eps, BLOCK_HIDDEN)
    row_scale = 1.0
    if SCALED:
        row_scale = tl.load(rs_ptr + t)
    q_groups = tl.cdiv(num_q_heads, BLOCK_H)
    if g < q_groups:
        _rope_heads(q_ptr + t * s_qt, qb_ptr, qs_ptr, qo_ptr + t * s_qot, qw_ptr, cos_row, sin_row, s_cd,
                    s_qh, s_qd, s_qoh, s_qod, g * BLOCK_H, num_q_heads, eps, row_scale, inv, 1,
                    DT, SCALED, NORM, INPUT_NORM, HAS_BIAS, HEAD_DIM, BLOCK_H, BLOCK_D)
    else:
        h0 = (g - q_groups) * BLOCK_H
        slot = tl.load(slot_ptr + t).to(tl.int64)
        live = (slot >= 0).to(tl.int32)  # slot -1: the token writes nothing
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        _rope_heads(k_ptr + t * s_kt, kb_ptr, ks_ptr, kc_ptr + blk * s_kcb + off * s_kct, kw_ptr, cos_row, sin_row,
                    s_cd, s_kh, s_kd, s_kch, s_kcd, h0, num_kv_heads, eps, row_scale, inv, live,
                    DT, SCALED, NORM, INPUT_NORM, HAS_BIAS, HEAD_DIM, BLOCK_H, BLOCK_D)
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < HEAD_DIM) & ((live + 0 * h) != 0)
        v = _projection(v_ptr + t * s_vt, h * s_vh + d * s_vd, vb_ptr, vs_ptr, h * HEAD_DIM + d, mask, row_scale, inv,
                        DT, SCALED, INPUT_NORM, HAS_BIAS)
        tl.store(vc_ptr + blk * s_vcb + h * s_vch + off * s_vct + d * s_vcd, _narrowed(v, vc_ptr.dtype.element_ty),
                 mask=mask)


def rope_and_write_kv_cache(q, k, v, cos, sin, positions, key_cache, value_cache, slot_mapping, qk_norm=None,
                            input_norm=None, bias=None, out=None, scales=None, dtype=None):
    """qk_norm: None for RoPE alone, else (q_weight, k_weight, eps) of the QK-norm before it; input_norm:
    (hidden, eps) of the RMSNorm folded into the projections, or None; bias: (q_bias, k_bias, v_bias) or
    None; out: where the rotated q goes (None: a new tensor); scales: (row_scale, (q_cols, k_cols, v_cols)) of
    an FP8 product still to be scaled, or None; dtype: the roundings' and the rotated q's (default q's)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert D % 2 == 0 and k.shape[2] == D and cos.shape[1] == D and sin.stride() == cos.stride()
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm[0].contiguous(), qk_norm[1].contiguous(), qk_norm[2]
    else:
        q_weight, k_weight, eps = q, k, 0.0  # unused (NORM=False)
    q_bias, k_bias, v_bias = (b.contiguous() for b in bias) if bias is not None else (q, q, q)  # unused without
    row_scale, (q_cols, k_cols, v_cols) = (scales[0].contiguous(), (c.contiguous() for c in scales[1])) \
        if scales is not None else (q, (q, q, q))
    hidden, n_hidden, s_ht, s_hc, hidden_eps, block_hidden = _input_norm_args(input_norm, q)
    q_out = torch.empty(q.shape, dtype=dtype or q.dtype, device=q.device) if out is None else out
    if T == 0:
        return q_out
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(max(Hq, Hkv)), 2048 // block_d))
    grid = (T, triton.cdiv(Hq, block_h) + triton.cdiv(Hkv, block_h))
    _rope_kernel[grid](
        q, k, v, q_bias, k_bias, v_bias, q_cols, k_cols, v_cols, row_scale, hidden, q_weight, k_weight, cos, sin,
        positions, slot_mapping, q_out, key_cache, value_cache, Hq, Hkv, n_hidden, float(eps), hidden_eps,
        *q.stride(), *k.stride(), *v.stride(), s_ht, s_hc, *q_out.stride(), *key_cache.stride(),
        *value_cache.stride(), *cos.stride(),
        SCALED=scales is not None, NORM=qk_norm is not None, INPUT_NORM=input_norm is not None,
        HAS_BIAS=bias is not None, HEAD_DIM=D,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_HIDDEN=block_hidden, BLOCK_SIZE=key_cache.shape[2], num_warps=4,
    )
    return q_out


# --------------------------------------------------------------------------------------------
# silu_and_mul
# --------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_tile(x_row, b_ptr, c_ptr, cols, n_inter, s_xc, row_scale, inv, DT: tl.constexpr,
                       SCALED: tl.constexpr, INPUT_NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """silu(gate) * up at columns cols (< n_inter) of the row at x_row, rounded in DT as F.silu then the
    product round it; in float32."""
    mask = cols < n_inter
    gate = _projection(x_row, cols * s_xc, b_ptr, c_ptr, cols, mask, row_scale, inv, DT, SCALED, INPUT_NORM, HAS_BIAS)
    up = _projection(x_row, (cols + n_inter) * s_xc, b_ptr, c_ptr, cols + n_inter, mask, row_scale, inv, DT, SCALED,
                     INPUT_NORM, HAS_BIAS)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)  # F.silu, rounded
    return (act * up).to(DT).to(tl.float32)


@triton.jit
def _silu_row_terms(rs_ptr, hid_ptr, row, n_hidden, hid_eps, s_ht, s_hc, SCALED: tl.constexpr,
                    INPUT_NORM: tl.constexpr, BLOCK_HIDDEN: tl.constexpr):
    """(row_scale, inv) of a row: its FP8 product's scale (SCALED) and its folded input norm's (INPUT_NORM); 1 else."""
    inv = 1.0
    if INPUT_NORM:
        inv = _inv_rms(hid_ptr + row * s_ht, s_hc, n_hidden, hid_eps, BLOCK_HIDDEN)
    row_scale = 1.0
    if SCALED:
        row_scale = tl.load(rs_ptr + row)
    return row_scale, inv


@triton.jit
def _silu_and_mul_kernel(x_ptr, b_ptr, c_ptr, rs_ptr, hid_ptr, out_ptr, n_inter, n_hidden, hid_eps, s_x, s_xc, s_ht,
                         s_hc, s_o, s_oc, SCALED: tl.constexpr, INPUT_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_HIDDEN: tl.constexpr):
    """SCALED: x is an FP8 product still to be scaled (rope's); the roundings are in the output's dtype."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_scale, inv = _silu_row_terms(rs_ptr, hid_ptr, row, n_hidden, hid_eps, s_ht, s_hc, SCALED, INPUT_NORM,
                                     BLOCK_HIDDEN)
    out = _silu_and_mul_tile(x_ptr + row * s_x, b_ptr, c_ptr, cols, n_inter, s_xc, row_scale, inv, DT, SCALED,
                             INPUT_NORM, HAS_BIAS)
    tl.store(out_ptr + row * s_o + cols * s_oc, out.to(DT), mask=cols < n_inter)


@triton.jit
def _silu_and_mul_e4m3_kernel(x_ptr, b_ptr, c_ptr, rs_ptr, hid_ptr, q_ptr, scale_ptr, n_inter, n_hidden, hid_eps,
                              s_x, s_xc, s_ht, s_hc, s_q, DT: tl.constexpr, E4M3_MAX: tl.constexpr,
                              SCALED: tl.constexpr, INPUT_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr, BLOCK_HIDDEN: tl.constexpr):
    """_silu_and_mul_kernel's row, rounded in DT, then to e4m3 as _quantize_rows_kernel's: one program per row,
    two passes (the row's largest magnitude, then the quotients), each computing the product again from x."""
    row = tl.program_id(0).to(tl.int64)
    row_scale, inv = _silu_row_terms(rs_ptr, hid_ptr, row, n_hidden, hid_eps, s_ht, s_hc, SCALED, INPUT_NORM,
                                     BLOCK_HIDDEN)
    x_row = x_ptr + row * s_x
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_inter, BLOCK):
        out = _silu_and_mul_tile(x_row, b_ptr, c_ptr, start + tl.arange(0, BLOCK), n_inter, s_xc, row_scale, inv,
                                 DT, SCALED, INPUT_NORM, HAS_BIAS)
        amax = tl.maximum(amax, tl.abs(out))
    scale = _e4m3_scale(tl.max(amax, axis=0), E4M3_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        out = _silu_and_mul_tile(x_row, b_ptr, c_ptr, cols, n_inter, s_xc, row_scale, inv, DT, SCALED, INPUT_NORM,
                                 HAS_BIAS)
        tl.store(q_ptr + row * s_q + cols, _e4m3_quotient(out, scale, E4M3_MAX).to(q_ptr.dtype.element_ty),
                 mask=cols < n_inter)


def silu_and_mul(x, input_norm=None, bias=None, scales=None, dtype=None, e4m3_rows=None):
    """scales: (row_scale, columns) of an FP8 product still to be scaled, or None; dtype: the output's and the
    roundings' (default x's). e4m3_rows: the output's rows go on to e4m3, as quantize_rows_to_e4m3(out,
    rows=e4m3_rows) would: (q, scale), in one kernel."""
    T, two_i = x.shape
    inter = two_i // 2
    dtype = dtype or x.dtype
    if e4m3_rows is not None:
        q, scale = _e4m3_outputs(e4m3_rows, inter, x.device)
    else:
        out = torch.empty((T, inter), dtype=dtype, device=x.device)
    if T == 0 or inter == 0:
        return out if e4m3_rows is None else (q, scale)
    hidden, n_hidden, s_ht, s_hc, hidden_eps, block_hidden = _input_norm_args(input_norm, x)
    row_scale, columns = (scales[0].contiguous(), scales[1].contiguous()) if scales is not None else (x, x)
    switches = dict(SCALED=scales is not None, INPUT_NORM=input_norm is not None, HAS_BIAS=bias is not None,
                    BLOCK_HIDDEN=block_hidden)
    bias = x if bias is None else bias.contiguous()
    if e4m3_rows is None:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](
            x, bias, columns, row_scale, hidden, out, inter, n_hidden, hidden_eps, *x.stride(), s_ht, s_hc,
            *out.stride(), BLOCK=block, num_warps=4, **switches)
        return out
    block = min(4096, triton.next_power_of_2(inter))
    _silu_and_mul_e4m3_kernel[(T,)](
        x, bias, columns, row_scale, hidden, q, scale, inter, n_hidden, hidden_eps, *x.stride(), s_ht, s_hc,
        q.stride(0), DT=TL_DTYPES[dtype], E4M3_MAX=E4M3_MAX, BLOCK=block, num_warps=_num_warps(block), **switches)
    return q, scale


# --------------------------------------------------------------------------------------------
# quantize_rows_to_e4m3: per-row FP8 activations
# --------------------------------------------------------------------------------------------
@triton.jit
def _weighted_tile(x_ptr, w_ptr, row, s_x, start, n_cols, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [start, start + BLOCK) of x's row in float32, times the input weight's (HAS_WEIGHT); 0 past n_cols."""
    cols = start + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * s_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        v = v * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    return cols, v


@triton.jit
def _e4m3_scale(amax, E4M3_MAX: tl.constexpr):
    """A row's scale from its largest magnitude: amax / 448, 1 for an all-zero row."""
    return tl.where(amax > 0, amax / E4M3_MAX, 1.0)


@triton.jit
def _e4m3_quotient(v, scale, E4M3_MAX: tl.constexpr):
    """v / scale within e4m3's finite range, in float32 (its cast to e4m3 rounds to nearest)."""
    return tl.minimum(tl.maximum(v / scale, -E4M3_MAX), E4M3_MAX)


@triton.jit
def _quantize_rows_kernel(x_ptr, w_ptr, q_ptr, scale_ptr, n_cols, s_x, s_q, E4M3_MAX: tl.constexpr,
                          HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        _, v = _weighted_tile(x_ptr, w_ptr, row, s_x, start, n_cols, HAS_WEIGHT, BLOCK)
        amax = tl.maximum(amax, tl.abs(v))
    _store_e4m3_row(x_ptr, w_ptr, q_ptr, scale_ptr, row, s_x, s_q, n_cols, amax, E4M3_MAX, HAS_WEIGHT, BLOCK)


@triton.jit
def _store_e4m3_row(x_ptr, w_ptr, q_ptr, scale_ptr, row, s_x, s_q, n_cols, amax, E4M3_MAX: tl.constexpr,
                    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """The second pass over a row: its scale from amax (the tiles' largest magnitudes of x times the weight),
    then the quotients of the row at x_ptr (times the weight) into q's row."""
    scale = _e4m3_scale(tl.max(amax, axis=0), E4M3_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols, v = _weighted_tile(x_ptr, w_ptr, row, s_x, start, n_cols, HAS_WEIGHT, BLOCK)
        tl.store(q_ptr + row * s_q + cols, _e4m3_quotient(v, scale, E4M3_MAX).to(q_ptr.dtype.element_ty),
                 mask=cols < n_cols)


def _e4m3_outputs(rows, C, device):
    """q [rows, C] e4m3 and scale [rows, 1] float32, unwritten (rows past the input's stay so: padding)."""
    return (torch.empty((rows, C), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def quantize_rows_to_e4m3(x, input_weight=None, rows=None):
    R, C = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    q, scale = _e4m3_outputs(rows or R, C, x.device)
    if R == 0:
        return q, scale
    block = min(4096, triton.next_power_of_2(C))
    _quantize_rows_kernel[(R,)](x, x if input_weight is None else input_weight.contiguous(), q, scale, C, x.stride(0),
                                q.stride(0), E4M3_MAX=E4M3_MAX,
                                HAS_WEIGHT=input_weight is not None, BLOCK=block, num_warps=_num_warps(block))
    return q, scale


# --------------------------------------------------------------------------------------------
# add_and_quantize_rows: a residual sum, then its rows to e4m3
# --------------------------------------------------------------------------------------------
@triton.jit
def _add_and_quantize_kernel(p_ptr, rs_ptr, cs_ptr, r_ptr, w_ptr, q_ptr, scale_ptr, n_cols, s_p, s_r, s_q,
                             E4M3_MAX: tl.constexpr, SCALED: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                             BLOCK: tl.constexpr):
    """One program per row: the sum into the residual's row, tile by tile (scale_product's rounding), and the
    largest magnitude of the sum times the weight; a second pass reads the row back (the same threads' own
    stores: the tiles' layout is the same) for the quotients."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(p_ptr + row * s_p + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            v = v * tl.load(rs_ptr + row) * tl.load(cs_ptr + cols, mask=mask, other=0.0)
        res = r_ptr + row * s_r + cols
        total = (v + tl.load(res, mask=mask, other=0.0).to(tl.float32)).to(r_ptr.dtype.element_ty)
        tl.store(res, total, mask=mask)
        weighted = total.to(tl.float32)
        if HAS_WEIGHT:
            weighted = weighted * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(weighted))
    _store_e4m3_row(r_ptr, w_ptr, q_ptr, scale_ptr, row, s_r, s_q, n_cols, amax, E4M3_MAX, HAS_WEIGHT, BLOCK)


def add_and_quantize_rows(residual, product, scales=None, input_weight=None, rows=None):
    R, C = residual.shape
    product = product if product.stride(1) == 1 else product.contiguous()
    q, scale = _e4m3_outputs(rows or R, C, residual.device)
    if R == 0:
        return q, scale
    row_scale, col_scale = (scales[0].contiguous(), scales[1].contiguous()) if scales is not None else (product, product)
    block = min(4096, triton.next_power_of_2(C))
    _add_and_quantize_kernel[(R,)](
        product, row_scale, col_scale, residual, residual if input_weight is None else input_weight.contiguous(), q,
        scale, C, product.stride(0), residual.stride(0), q.stride(0), E4M3_MAX=E4M3_MAX, SCALED=scales is not None,
        HAS_WEIGHT=input_weight is not None, BLOCK=block, num_warps=_num_warps(block))
    return q, scale

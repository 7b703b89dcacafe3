"""Triton versions of the fused elementwise ops of the decode step (contracts and PyTorch
references: ops/fused_reference.py).

    rms_norm(x[T,H], weight[H], eps) -> [T,H]
    fused_add_rms_norm(x[T,H], residual[T,H], weight[H], eps) -> (normed, x + residual)
    qk_norm_rope(q[T,Hq,D], k[T,Hkv,D], q_weight[D], k_weight[D], eps, cos[P,D], sin[P,D], positions[T])
        -> (q', k')
    silu_and_mul(x[T, 2I]) -> [T, I]
    gumbel_sample(logits[B,V] float, temperature[B] f32, seed[B] i64, step[B] i64, num_splits=None) -> i64 [B]

Each replaces a chain of small torch kernels by one pass over its inputs, reproducing the chain's
rounding steps (float32 math, casts to the model dtype where the torch code casts). None of them
synchronises with the host (grids come from shapes only), so they can be captured in CUDA graphs.
They are registered as torch.library custom ops (namespace ``minipaged``) with fake
implementations; eager calls skip the dispatcher (as in ops/triton_ops.py).

Kernels:
- rms_norm / fused_add_rms_norm: one program per row, the whole row in registers.
- qk_norm_rope: one program per (token, group of heads); each element also loads its rotary
  partner (d +- D/2) and normalises it with the same per-head scale, so no shuffle is needed.
- silu_and_mul: one program per (row, tile of I).
- gumbel_sample: programs per (row, vocabulary range) loop over vocabulary tiles keeping a
  per-lane running max and argmax (first index on ties); logits of any float dtype are read once
  and widened to float32 in registers; a row at temperature 0 takes the plain argmax. The
  counter-based noise is computed in the kernel (uint32 arithmetic, bit-identical to
  ops/fused_reference.uniform_noise for seed and step in [0, 2^32)). With one range per row the program writes the token id; otherwise each range
  writes (max, argmax) and a second kernel reduces the ranges of a row. On CUDA the score uses
  IEEE division and libdevice's logf, as torch's CUDA kernels do, so that ties resolve alike.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - only the interpreter path is usable then
    libdevice = None


def _num_warps(block):
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


# --------------------------------------------------------------------------------------------
# rms_norm, fused_add_rms_norm
# --------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_cols, eps,
    s_x, s_xc, s_r, s_rc, s_o, s_oc, s_ro, s_roc,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * s_x + cols * s_xc, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * s_r + cols * s_rc, mask=mask, other=0.0)
        # x + residual in the model dtype (the unfused code's `x = x + attn_out`)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + cols * s_roc, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    y = (x32 * inv).to(x.dtype).to(tl.float32)  # cast to x's dtype before the weight, as HF does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols * s_oc, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(x, residual, weight, eps):
    T, H = x.shape
    weight = weight.contiguous()
    out = torch.empty((T, H), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res_in, res_out = x, out  # unused (HAS_RES=False)
    else:
        res_in = residual
        res_out = torch.empty((T, H), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if T > 0:
        block = triton.next_power_of_2(H)
        _rms_norm_kernel[(T,)](
            x, res_in, weight, out, res_out, H, float(eps),
            *x.stride(), *res_in.stride(), *out.stride(), *res_out.stride(),
            HAS_RES=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )
    return out, res_out


def _rms_norm_impl(x, weight, eps):
    return _rms_norm_launch(x, None, weight, eps)[0]


def _fused_add_rms_norm_impl(x, residual, weight, eps):
    return _rms_norm_launch(x, residual, weight, eps)


# --------------------------------------------------------------------------------------------
# qk_norm_rope
# --------------------------------------------------------------------------------------------
@triton.jit
def _norm_rope_heads(
    x_ptr, o_ptr, w_ptr, cos_row, sin_row, s_cd,
    s_xh, s_xd, s_oh, s_od,
    h0, n_heads, eps,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < HEAD_DIM
    mask = (h < n_heads) & d_mask
    first = d < HEAD_DIM // 2
    pd = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)  # rotary partner of d
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + h * s_xh + d * s_xd, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + h * s_xh + pd * s_xd, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + pd, mask=d_mask, other=0.0).to(tl.float32)
    # RMSNorm with the unfused rounding: weight * (x * inv).to(dtype), rounded to the dtype
    y = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    yp = (wp * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    rot = tl.where(first, -yp, yp)  # rotate_half: cat(-x2, x1)
    c = tl.load(cos_row + d * s_cd, mask=d_mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_row + d * s_cd, mask=d_mask, other=0.0).to(dt).to(tl.float32)
    out = (y * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)
    tl.store(o_ptr + h * s_oh + d * s_od, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, ko_ptr,
    num_q_heads, num_kv_heads, eps,
    s_qt, s_qh, s_qd, s_kt, s_kh, s_kd,
    s_qot, s_qoh, s_qod, s_kot, s_koh, s_kod,
    s_cp, s_cd,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos_row = cos_ptr + pos * s_cp
    sin_row = sin_ptr + pos * s_cp
    q_groups = tl.cdiv(num_q_heads, BLOCK_H)
    if g < q_groups:
        _norm_rope_heads(q_ptr + t * s_qt, qo_ptr + t * s_qot, qw_ptr, cos_row, sin_row, s_cd,
                         s_qh, s_qd, s_qoh, s_qod, g * BLOCK_H, num_q_heads, eps,
                         HEAD_DIM, BLOCK_H, BLOCK_D)
    else:
        _norm_rope_heads(k_ptr + t * s_kt, ko_ptr + t * s_kot, kw_ptr, cos_row, sin_row, s_cd,
                         s_kh, s_kd, s_koh, s_kod, (g - q_groups) * BLOCK_H, num_kv_heads, eps,
                         HEAD_DIM, BLOCK_H, BLOCK_D)


def _qk_norm_rope_impl(q, k, q_weight, k_weight, eps, cos, sin, positions):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    assert D % 2 == 0 and k.shape[2] == D and cos.shape[1] == D and sin.stride() == cos.stride()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format)
    if T == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(max(Hq, Hkv)), 2048 // block_d))
    grid = (T, triton.cdiv(Hq, block_h) + triton.cdiv(Hkv, block_h))
    _qk_norm_rope_kernel[grid](
        q, k, q_weight, k_weight, cos, sin, positions, q_out, k_out,
        Hq, Hkv, float(eps),
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos.stride(),
        HEAD_DIM=D, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return q_out, k_out


# --------------------------------------------------------------------------------------------
# silu_and_mul
# --------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_inter, s_x, s_xc, s_o, s_oc, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + row * s_x + cols * s_xc, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + (cols + n_inter) * s_xc, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)  # F.silu, rounded
    tl.store(out_ptr + row * s_o + cols * s_oc, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul_impl(x):
    T, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](
        x, out, inter, *x.stride(), *out.stride(), BLOCK=block, num_warps=4,
    )
    return out


# --------------------------------------------------------------------------------------------
# gumbel_sample
# --------------------------------------------------------------------------------------------
@triton.jit
def _mix32(x):
    """ops/fused_reference.mix32 on uint32 values: the same bits as its int64 arithmetic (which keeps
    the low 32 bits of each product)."""
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, step_ptr, b):
    seed = tl.load(seed_ptr + b).to(tl.uint32)
    step = tl.load(step_ptr + b).to(tl.uint32)
    return _mix32(_mix32(seed) ^ step)


@triton.jit
def _uniform(key, v):
    """uniform_noise for token ids v (int32 >= 0) of a row whose key is _row_key."""
    bits = _mix32(key ^ v.to(tl.uint32)) >> 8  # 24 bits: exact in float32
    return (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _uniform_kernel(seed_ptr, step_ptr, ids_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    """Test helper: out[b, v] = uniform_noise(seed[b], step[b], ids[b, v]) (contiguous [B, V])."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    v = tl.load(ids_ptr + b * V + offs, mask=mask, other=0)
    u = _uniform(_row_key(seed_ptr, step_ptr, b), v.to(tl.int32))
    tl.store(out_ptr + b * V + offs, u, mask=mask)


@triton.jit
def _gumbel_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, out_ptr, part_max_ptr, part_idx_ptr,
    V, chunk, s_lb, s_lv,
    NUM_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr, CUDA_MATH: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(temp_ptr + b)
    greedy = temp == 0.0  # temperature 0: plain argmax, no noise
    temp_safe = tl.where(temp == 0.0, 1.0, temp)
    key = _row_key(seed_ptr, step_ptr, b)
    row = logits_ptr + b * s_lb
    offs = tl.arange(0, BLOCK_V)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    best = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK_V], dtype=tl.int32)
    for v0 in range(start, end, BLOCK_V):
        v = v0 + offs
        mask = v < end
        x = tl.load(row + v * s_lv, mask=mask, other=float("-inf")).to(tl.float32)
        u = _uniform(key, v)
        scaled = tl.math.div_rn(x, temp_safe + tl.zeros_like(x))  # IEEE division, as torch
        if CUDA_MATH:
            noise = libdevice.log(-libdevice.log(u))
        else:
            noise = tl.log(-tl.log(u))
        score = tl.where(mask, tl.where(greedy, x, scaled - noise), float("-inf"))
        take = score > best  # strict: each lane keeps its first maximum
        best = tl.where(take, score, best)
        best_idx = tl.where(take, v, best_idx)
    m = tl.max(best, 0)
    idx = tl.min(tl.where(best == m, best_idx, V), 0)  # first index among the lanes' maxima
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b, idx.to(tl.int64))
    else:
        tl.store(part_max_ptr + b * NUM_SPLITS + split, m)
        tl.store(part_idx_ptr + b * NUM_SPLITS + split, idx)


@triton.jit
def _gumbel_reduce_kernel(part_max_ptr, part_idx_ptr, out_ptr, V,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < NUM_SPLITS
    m = tl.load(part_max_ptr + b * NUM_SPLITS + offs, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + b * NUM_SPLITS + offs, mask=mask, other=V)
    best = tl.max(m, 0)
    # ranges are ordered by token id, so the smallest index among the maxima is the first one
    tl.store(out_ptr + b, tl.min(tl.where(m == best, idx, V), 0).to(tl.int64))


# Tunables. Keys: "gpu" / "interp". The split count is a constant, not a function of the batch size:
# NUM_SPLITS is a compile-time constant of the kernels, and a count that followed the batch recompiled
# them whenever the batch shrank past a threshold (seconds each, inside the timed run).
GUMBEL_CFG = {
    "gpu": dict(BLOCK_V=2048, num_warps=8, num_splits=16),
    "interp": dict(BLOCK_V=1024, num_warps=4, num_splits=2),
}


def _gumbel_sample_impl(logits, temperature, seed, step, num_splits=None):
    B, V = logits.shape
    temperature, seed, step = temperature.contiguous(), seed.contiguous(), step.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    cfg = GUMBEL_CFG["gpu" if logits.is_cuda else "interp"]
    block_v = min(cfg["BLOCK_V"], triton.next_power_of_2(V))
    num_splits = max(1, min(int(num_splits or cfg["num_splits"]), triton.cdiv(V, block_v)))
    chunk = triton.cdiv(triton.cdiv(V, num_splits), block_v) * block_v
    if num_splits > 1:
        part_max = torch.empty((B, num_splits), dtype=torch.float32, device=logits.device)
        part_idx = torch.empty((B, num_splits), dtype=torch.int32, device=logits.device)
    else:
        part_max, part_idx = out, out  # unused
    _gumbel_kernel[(B, num_splits)](
        logits, temperature, seed, step, out, part_max, part_idx,
        V, chunk, *logits.stride(),
        NUM_SPLITS=num_splits, BLOCK_V=block_v, CUDA_MATH=logits.is_cuda and libdevice is not None,
        num_warps=cfg["num_warps"],
    )
    if num_splits > 1:
        _gumbel_reduce_kernel[(B,)](
            part_max, part_idx, out, V,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1,
        )
    return out


def uniform_noise(seed, step, token_ids):
    """The sampler's uniform noise [B, V] computed by the kernels' hash (for tests)."""
    B, V = token_ids.shape
    ids = token_ids.to(torch.int32).contiguous()
    out = torch.empty((B, V), dtype=torch.float32, device=token_ids.device)
    if B and V:
        block = min(1024, triton.next_power_of_2(V))
        _uniform_kernel[(B, triton.cdiv(V, block))](seed, step, ids, out, V, BLOCK_V=block)
    return out


# --------------------------------------------------------------------------------------------
# registration as torch.library custom ops (opaque to torch.compile, capturable in CUDA graphs)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("minipaged::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_impl(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("minipaged::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_add_rms_norm_impl(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)),
            x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype)))


@torch.library.custom_op("minipaged::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _qk_norm_rope_impl(q, k, q_weight, k_weight, eps, cos, sin, positions)


@_qk_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, eps, cos, sin, positions):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("minipaged::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return _silu_and_mul_impl(x)


@_silu_and_mul_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("minipaged::gumbel_sample", mutates_args=())
def _gumbel_sample_op(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                      step: torch.Tensor, num_splits: Optional[int] = None) -> torch.Tensor:
    return _gumbel_sample_impl(logits, temperature, seed, step, num_splits)


@_gumbel_sample_op.register_fake
def _(logits, temperature, seed, step, num_splits=None):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# public functions (same positional arguments as ops/fused_reference.py)
# --------------------------------------------------------------------------------------------
# Outside torch.compile tracing they call their implementations directly (the custom-op
# dispatcher costs ~15 us of CPU per call); under torch.compile they go through torch.ops.minipaged.*.
_compiling = torch.compiler.is_compiling


def rms_norm(x, weight, eps):
    if _compiling():
        return torch.ops.minipaged.rms_norm(x, weight, float(eps))
    return _rms_norm_impl(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    if _compiling():
        return torch.ops.minipaged.fused_add_rms_norm(x, residual, weight, float(eps))
    return _fused_add_rms_norm_impl(x, residual, weight, eps)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin, positions):
    if _compiling():
        return torch.ops.minipaged.qk_norm_rope(q, k, q_weight, k_weight, float(eps), cos, sin, positions)
    return _qk_norm_rope_impl(q, k, q_weight, k_weight, eps, cos, sin, positions)


def silu_and_mul(x):
    if _compiling():
        return torch.ops.minipaged.silu_and_mul(x)
    return _silu_and_mul_impl(x)


def gumbel_sample(logits, temperature, seed, step, num_splits: Optional[int] = None):
    """num_splits: force the number of vocabulary ranges per row (tests, benchmarks); None picks
    it from shapes."""
    if _compiling():
        return torch.ops.minipaged.gumbel_sample(logits, temperature, seed, step, num_splits)
    return _gumbel_sample_impl(logits, temperature, seed, step, num_splits)

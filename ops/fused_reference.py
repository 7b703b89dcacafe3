"""Readable PyTorch versions of the fused elementwise ops (Triton versions: ops/fused.py).

They reproduce Hugging Face's unfused modules operation for operation (same rounding steps), so the
torch backend gives bit-identical results to them:

    rms_norm(x[T,H], weight[H], eps) -> [T,H]
        weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)   (Hugging Face order)
    rope_and_write_kv_cache(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], cos[P,D], sin[P,D], positions[T],
                            key_cache, value_cache, slot_mapping[T], qk_norm=None, input_norm=None,
                            bias=None) -> q':
        rope(q, k) = x*cos + rotate_half(x)*sin with the float32 tables cast to the model dtype first,
        rotate_half(x) = cat(-x2, x1); with qk_norm = (q_weight[D], k_weight[D], eps), rope of the
        per-head rms_norm over D of each (Qwen3's QK-norm). k' and v are written to the cache through
        slot_mapping (write_kv_cache of ops/paged_attention_reference.py); q' is returned.
    silu_and_mul(x[T, 2I], input_norm=None, bias=None, e4m3_rows=None) -> [T, I] = silu(x[:, :I]) * x[:, I:]
        (e4m3_rows: that product's quantize_rows_to_e4m3(out, rows=e4m3_rows) instead)
    quantize_rows_to_e4m3(x[R, C], input_weight=None, rows=None) -> (q float8_e4m3fn [rows, C], scale float32
                                                                    [rows, 1]):
        x' = x.float() (* input_weight.float()), scale = amax(|x'| per row) / 448 (1 for a zero row),
        q = clamp(x' / scale, -448, 448) rounded to e4m3 (to nearest, ties to even); rows (>= R, default
        R): the rows allocated, those past R padding (zeros here, not written by the Triton kernel)
    add_and_quantize_rows(residual[R, C], product[R, C], scales=None, input_weight=None, rows=None) -> (q, scale):
        residual += product in place, summed in float32 and rounded to residual's dtype (scales = (row_scale
        [R, 1], col_scale [C]): product is an FP8 GEMM's, unscaled, summed as scale_product does), then
        quantize_rows_to_e4m3(residual, input_weight, rows): a residual stream's sum and its rows rounded for
        the FP8 projection that reads it next

Folded input norm. Given input_norm = (hidden[T,H], eps), q, k, v (or x) are projections of the raw
hidden rows by weights that already hold the preceding RMSNorm's weight (W * norm_weight, column-wise),
and each token's values are first scaled by rsqrt(mean(hidden.float()^2) + eps) and rounded to the dtype:
what the unfolded layers compute, W @ rms_norm(hidden), up to rounding (the projection no longer sees a
rounded normalised row). bias (q_bias[Hq*D], k_bias[Hkv*D], v_bias[Hkv*D]; for silu_and_mul [2I]) is
added after that scaling, as the unfolded projection's bias.

Deferred FP8 scales. Given scales = (row_scale[T, 1], columns) and dtype, q, k, v (or x) are an FP8 GEMM's
float32 product of the quantized operands (ops.fp8_product), and each is first scaled and rounded to dtype
as ops.fp8_gemm_reference.scale_product would (columns: the column scales, (q_cols, k_cols, v_cols) for
rope_and_write_kv_cache as bias is split); dtype is then the model's, the outputs' and the roundings'.
"""
import torch
import torch.nn.functional as F

from ops.fp8_gemm_reference import scale_product
from ops.paged_attention_reference import E4M3_MAX, write_kv_cache


def rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def input_normed(x, input_norm, bias):
    """x [T, ...], a projection of hidden rows with the RMSNorm folded into its weight -> the unfolded
    projection's output (see the module's docstring)."""
    if input_norm is not None:
        hidden, eps = input_norm
        h = hidden.float()
        inv = torch.rsqrt(h.pow(2).mean(-1) + eps).view(-1, *[1] * (x.dim() - 1))
        x = (x.float() * inv).to(x.dtype)
    return x if bias is None else x + bias.view(x.shape[1:])


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope(q, k, cos, sin, positions):
    cos, sin = cos[positions, None, :].to(q.dtype), sin[positions, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def scaled(x, row_scale, columns, dtype):
    """x [T, ...] (an FP8 product's columns, unscaled) times row_scale [T, 1] and columns [x[0].numel()], in dtype."""
    return scale_product(x.reshape(x.shape[0], -1), row_scale, columns, dtype=dtype).view(x.shape)


def rope_and_write_kv_cache(q, k, v, cos, sin, positions, key_cache, value_cache, slot_mapping, qk_norm=None,
                            input_norm=None, bias=None, out=None, scales=None, dtype=None):
    if scales is not None:
        q, k, v = (scaled(x, scales[0], c, dtype) for x, c in zip((q, k, v), scales[1]))
    q, k, v = (input_normed(x, input_norm, b) for x, b in zip((q, k, v), bias or (None, None, None)))
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = rope(q, k, cos, sin, positions)
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
    return q if out is None else out.copy_(q)


def silu_and_mul(x, input_norm=None, bias=None, scales=None, dtype=None, e4m3_rows=None):
    if scales is not None:
        x = scaled(x, *scales, dtype)
    gate, up = input_normed(x, input_norm, bias).chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if e4m3_rows is None else quantize_rows_to_e4m3(out, rows=e4m3_rows)


def quantize_rows_to_e4m3(x, input_weight=None, rows=None):
    x = x.float() if input_weight is None else x.float() * input_weight.float()
    x = torch.nn.functional.pad(x, (0, 0, 0, (rows or x.shape[0]) - x.shape[0]))
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def add_and_quantize_rows(residual, product, scales=None, input_weight=None, rows=None):
    if scales is None:
        residual.add_(product)
    else:
        scale_product(product, *scales, residual)
    return quantize_rows_to_e4m3(residual, input_weight, rows)

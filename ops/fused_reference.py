"""Readable PyTorch versions of the fused elementwise ops (Triton versions: ops/fused.py).

They reproduce Hugging Face's unfused modules operation for operation (same rounding steps), so the
torch backend gives bit-identical results to them:

    rms_norm(x[T,H], weight[H], eps) -> [T,H]
        weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)   (Hugging Face order)
    fused_add_rms_norm(x[T,H], residual[T,H], weight[H], eps) -> (rms_norm(x + residual), x + residual)
    rope(q[T,Hq,D], k[T,Hkv,D], cos[P,D], sin[P,D], positions[T]) -> (q', k'):
        x*cos + rotate_half(x)*sin with the float32 tables cast to the model dtype first;
        rotate_half(x) = cat(-x2, x1)
    qk_norm_rope(q, k, q_weight[D], k_weight[D], eps, cos, sin, positions) -> (q', k'):
        rope of the per-head rms_norm over D (Qwen3's QK-norm)
    silu_and_mul(x[T, 2I]) -> [T, I] = silu(x[:, :I]) * x[:, I:]
"""
import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope(q, k, cos, sin, positions):
    cos, sin = cos[positions, None, :].to(q.dtype), sin[positions, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin, positions):
    return rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin, positions)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

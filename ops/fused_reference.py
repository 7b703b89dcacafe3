"""Readable PyTorch versions of the fused elementwise ops (Triton versions: ops/fused.py).

They reproduce Hugging Face's unfused modules operation for operation (same rounding steps), so the
torch backend gives bit-identical results to them:

    rms_norm(x[T,H], weight[H], eps) -> [T,H]
        weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)   (Hugging Face order)
    fused_add_rms_norm(x[T,H], residual[T,H], weight[H], eps) -> (rms_norm(x + residual), x + residual)
    rope_and_write_kv_cache(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], cos[P,D], sin[P,D], positions[T],
                            key_cache, value_cache, slot_mapping[T], qk_norm=None) -> q':
        rope(q, k) = x*cos + rotate_half(x)*sin with the float32 tables cast to the model dtype first,
        rotate_half(x) = cat(-x2, x1); with qk_norm = (q_weight[D], k_weight[D], eps), rope of the
        per-head rms_norm over D of each (Qwen3's QK-norm). k' and v are written to the cache through
        slot_mapping (write_kv_cache of ops/paged_attention_reference.py); q' is returned.
    silu_and_mul(x[T, 2I]) -> [T, I] = silu(x[:, :I]) * x[:, I:]
"""
import torch
import torch.nn.functional as F

from ops.paged_attention_reference import write_kv_cache


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


def rope_and_write_kv_cache(q, k, v, cos, sin, positions, key_cache, value_cache, slot_mapping, qk_norm=None,
                            out=None):
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = rope(q, k, cos, sin, positions)
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
    return q if out is None else out.copy_(q)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

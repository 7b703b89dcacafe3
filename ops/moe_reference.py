"""Readable PyTorch versions of the mixture-of-experts ops (the contracts; the Triton versions: ops/moe.py).

    moe_route(router_logits[T, E], top_k, renormalize) -> (weights float32 [T, k], expert ids int64 [T, k])
        softmax over the experts in float32, the top_k largest (ties: the lower id first, as torch.topk orders
        them on the CPU), divided by their sum when renormalize.
    moe_experts(x[T, H], gate_up[E, 2I, H], down[E, H, I], weights[T, k], ids[T, k]) -> [T, H]
        sum over j of weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, j]; gate
        is the first I rows of gate_up[e], up the last I. Each expert's rows are computed together, in x's
        dtype, an expert no token picks not at all; the weights are rounded to x's dtype first (Hugging
        Face's order).
"""
import torch
import torch.nn.functional as F


def moe_route(router_logits, top_k: int, renormalize: bool):
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(x, gate_up, down, weights, ids):
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for expert in ids.unique().tolist():
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, down[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, rows)
    return out


def compile_launches(gate_up, down, top_k: int, max_tokens: int) -> int:
    """ops/moe.py's compile_launches: PyTorch compiles nothing ahead, so no launch runs (0)."""
    return 0

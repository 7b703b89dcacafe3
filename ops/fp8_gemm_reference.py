"""FP8 weights times activations of the model's dtype (W8A16), as torch ops: the contract of ops/fp8_gemm.py.

weight float8_e4m3fn [N, K] with weight_scale float32 [N] (one scale per output row) stands for
W = weight * weight_scale[:, None]; x [M, K] in the model's dtype is not rounded to FP8. A decode step's
matmuls read their weights once and multiply few rows, so they cost the bytes of the weights: FP8 halves
them, and the activations' rounding (W8A8) would buy nothing there but a kernel and its error.
"""
import torch


def fp8_weight_matmul(x, weight, weight_scale, input_weight=None, residual=None):
    """(x * input_weight) @ W^T in float32 -> [M, N] in x's dtype; input_weight [K] (optional): a folded
    RMSNorm's weight, multiplied into x first (rounded to x's dtype, as the kernel multiplies). residual
    [M, N] (optional): residual + the product, summed in float32, written into residual and returned."""
    if input_weight is not None:
        x = (x.float() * input_weight.float()).to(x.dtype)
    out = x.float() @ (weight.float() * weight_scale.float()[:, None]).T
    if residual is None:
        return out.to(x.dtype)
    return residual.copy_((residual.float() + out).to(residual.dtype))

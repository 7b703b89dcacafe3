"""The scales of a unit-scale W8A8 product, as torch ops: the contract of ops/fp8_gemm.py (ops.fp8_matmul's
small calls: torch._scaled_mm multiplies the FP8 operands with unit scales into float32, which runs faster on
Hopper than with its scales per row, and this applies them).
"""


def scale_product(raw, row_scale, col_scale, residual=None, dtype=None):
    """raw [M, N] (an FP8 GEMM's product of the quantized operands, unscaled) * row_scale [M, 1] * col_scale [N]
    in float32 -> [M, N] in dtype; residual [M, N] (optional): residual + that, summed in float32, written into
    residual and returned."""
    out = raw.float() * row_scale.float().reshape(-1, 1) * col_scale.float().reshape(1, -1)
    if residual is None:
        return out.to(dtype)
    return residual.copy_((residual.float() + out).to(residual.dtype))

"""ops/fp8_gemm_reference.py's scale_product as a Triton kernel: one program per (row, tile of columns), the row's
scale a scalar, the columns' a vector, the residual's sum in place."""
import torch
import triton
import triton.language as tl


@triton.jit
def _scale_product_kernel(raw_ptr, row_ptr, col_ptr, out_ptr, N, s_raw, s_out, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    val = tl.load(raw_ptr + row * s_raw + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(row_ptr + row)
    val = val * tl.load(col_ptr + cols, mask=mask, other=0.0)
    out = out_ptr + row * s_out + cols
    if ADD:
        val += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=mask)


SCALE_BLOCK = 1024


def scale_product(raw, row_scale, col_scale, residual=None, dtype=None):
    M, N = raw.shape
    raw = raw if raw.stride(1) == 1 else raw.contiguous()
    out = residual if residual is not None else torch.empty((M, N), dtype=dtype, device=raw.device)
    if M:
        _scale_product_kernel[(triton.cdiv(N, SCALE_BLOCK), M)](
            raw, row_scale.contiguous(), col_scale.contiguous(), out, N, raw.stride(0), out.stride(0),
            ADD=residual is not None, BLOCK=SCALE_BLOCK, num_warps=4)
    return out

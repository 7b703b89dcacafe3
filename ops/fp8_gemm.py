"""ops/fp8_gemm_reference.py's W8A16 matmul as one Triton kernel: each program multiplies a tile of rows by a
tile of FP8 weight rows, widened to the activations' dtype as they are loaded, over the whole reduction
(no split: every output element has one program, so the residual's sum is in place and the kernel
replays in a CUDA graph as it is). Tiles: fp8_tiles."""
import torch
import triton
import triton.language as tl


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, iw_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                  HAS_INPUT_WEIGHT: tl.constexpr, ADD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)  # the row tiles of a weight tile run side by side
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if HAS_INPUT_WEIGHT:
            iw = tl.load(iw_ptr + kk, mask=kk < K, other=0.0)
            x = (x.to(tl.float32) * iw.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = y_ptr + rm[:, None].to(tl.int64) * s_ym + rn[None, :]
    if ADD:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_tiles(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). For up to 16 rows, 32 x 256 weight tiles: the
    fastest of 13 for each Qwen3-8B projection at 16 rows on the H200 (benchmarks/fp8_gemm.py; 12.6-37.6
    us, 1.3-2.7 TB/s). Row tiles of 64 were 2-5x slower than cuBLASLt's FP8 GEMM, which is why the engine
    sends this kernel only calls of up to 16 rows (engine/models/layers.py); larger M still run right."""
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    return block_m, 32, 256 if block_m == 16 else 128, 4, 3


def fp8_weight_matmul(x, weight, weight_scale, input_weight=None, residual=None, tiles=None):
    """tiles: fp8_tiles' tuple (default: fp8_tiles(M))."""
    M, K = x.shape
    N = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = residual if residual is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles or fp8_tiles(M)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w8a16_kernel[grid](x, weight, weight_scale, x if input_weight is None else input_weight, out, M, N, K,
                        x.stride(0), weight.stride(0), out.stride(0), HAS_INPUT_WEIGHT=input_weight is not None,
                        ADD=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        num_warps=warps, num_stages=stages)
    return out

"""Skinny matmuls of a decode step: cuBLAS (F.linear) against a Triton tile kernel, with optional
in-kernel split-K, over a sweep of tile configs.

Each layer shape of $MODEL's arch (default Qwen3-0.6B) at M rows is timed as the engine runs it: the
same matmul over num_hidden_layers distinct weights (so the weights come from HBM, not L2), captured in
one CUDA graph, replayed (benchmarks/ops.bench, do_bench medians); time per matmul = replay time / layers. Prints per (shape, M) the cuBLAS time,
the best Triton config and its time, and the share of the copy speed each reaches (weights + x + y).
Usage (GPU): [MODEL=qwen2.5-0.5b] python3 benchmarks/gemm.py [M ...]   (default 8 32 64 128 256 512)
"""
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ops import bench  # noqa: E402
from benchmarks.profile_decode import COPY_BYTES_PER_S  # noqa: E402
from engine.config import engine_config  # noqa: E402
from engine.models.loader import model_spec, resolve_model_path  # noqa: E402


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, sx_ptr, sw_ptr, M, N, K, s_xm, s_wn, s_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   SCALED: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (SCALED: times sx[m] * sw[n], W8A8's row scales, for e4m3 x and w);
    program (n tile, m tile, k split). With SPLIT_K > 1 each split writes a float32 partial; the last split
    of a tile to finish (a ticket per tile) sums them, writes y and resets the ticket, so the kernel is one
    launch and replays in a graph."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_per_split = K // SPLIT_K
    k0 = pid_k * k_per_split
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k0, k0 + k_per_split, BLOCK_K):
        x = tl.load(x_rows + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_rows + (k + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SCALED:
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
        sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
    if SPLIT_K == 1:
        if SCALED:
            acc = acc * sx[:, None] * sw[None, :]
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        part = part_ptr + (rm[:, None] * N + rn[None, :])
        tl.store(part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if SCALED:
                total = total * sx[:, None] * sw[None, :]
            tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)


_COUNTERS: dict = {}


def triton_linear(x, w, config, scales=None, out_dtype=None):
    """x [M, K] @ w[N, K]^T by _linear_kernel; scales: (sx float32 [M], sw float32 [N]) for e4m3 x and w,
    out_dtype then the result's (default x's)."""
    bm, bn, bk, split, warps, stages = config
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    part = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else y
    count = _COUNTERS.get(x.device)
    if count is None:
        count = _COUNTERS[x.device] = torch.zeros(1 << 16, device=x.device, dtype=torch.int32)
    sx, sw = (y, y) if scales is None else (scales[0].contiguous(), scales[1].contiguous())
    _linear_kernel[grid](x, w, y, part, count, sx, sw, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SCALED=scales is not None,
                         num_warps=warps, num_stages=stages)
    return y


def configs(M, K):
    for bm, bn, bk, split, warps, stages in itertools.product(
            (16, 32, 64, 128), (64, 128), (64, 128), (1, 2, 4), (4,), (3, 4)):
        if bm > max(16, triton.next_power_of_2(M)) or (K // split) % bk:
            continue
        yield bm, bn, bk, split, warps, stages


def shapes(arch):
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def per_matmul_s(fn, xs, ws):
    """Seconds per matmul: fn over every (x, w) pair, captured in one graph and replayed (bench)."""
    return bench(lambda: [fn(x, w) for x, w in zip(xs, ws)], graph=True) / 1e3 / len(xs)


def main(ms):
    cfg = engine_config(os.environ.get("MODEL", "qwen3-0.6b"))
    arch = model_spec(cfg.model, resolve_model_path(cfg.model))[1]
    layers = arch.num_hidden_layers
    total = {"cublas": 0.0, "triton": 0.0}
    for name, (N, K) in shapes(arch).items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        for M in ms:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            ref = F.linear(xs[0], ws[0])
            t_cublas = per_matmul_s(F.linear, xs, ws)
            best = (float("inf"), None)
            for config in configs(M, K):
                try:
                    out = triton_linear(xs[0], ws[0], config)
                    if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                        print(f"  WRONG {name} M={M} {config}")
                        continue
                    t = per_matmul_s(lambda x, w: triton_linear(x, w, config), xs, ws)
                except Exception as e:  # out of shared memory, registers
                    print(f"  skip {config}: {type(e).__name__}")
                    continue
                best = min(best, (t, config))
            nbytes = (N * K + M * K + M * N) * 2
            print(f"{name:8s} N={N:5d} K={K:5d} M={M:4d}: cublas {t_cublas * 1e6:6.2f} us "
                  f"({100 * nbytes / COPY_BYTES_PER_S / t_cublas:4.0f}% copy), triton {best[0] * 1e6:6.2f} us "
                  f"({100 * nbytes / COPY_BYTES_PER_S / best[0]:4.0f}%) {best[1]}", flush=True)
            total["cublas"] += t_cublas * layers
            total["triton"] += best[0] * layers
    print(f"per step over the {len(ms)} sizes: cublas {total['cublas'] * 1e3 / len(ms):.3f} ms, "
          f"best triton {total['triton'] * 1e3 / len(ms):.3f} ms")


if __name__ == "__main__":
    with torch.inference_mode():
        main([int(m) for m in sys.argv[1:]] or [8, 32, 64, 128, 256, 512])

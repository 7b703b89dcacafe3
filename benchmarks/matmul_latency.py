"""Why a decode step's small matmuls cost ~25 us a layer against ~7 us of weights at the copy speed, asked
one question at a time on $MODEL's layer shapes (default Qwen3-0.6B), bf16, each matmul timed as the engine
runs it: over num_hidden_layers distinct weights in one CUDA graph (benchmarks/ops.bench), per matmul.
  blas      cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library) at 1-16384 rows, and lm_head
  l2        the same weight for every layer (in L2 after the first) against distinct ones; then layers of
            [a streaming kernel like decode attention; o, gate_up, down, next qkv] with the four weights
            prefetched into L2 (evict_last loads) on a side stream during the streaming kernel, or not
Usage (GPU): [MODEL=qwen2.5-0.5b] python3 benchmarks/matmul_latency.py [blas] [l2]   (default: both)
Results and reasoning: benchmarks/NOTES.md, session 13.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemm import per_matmul_s, shapes  # noqa: E402
from benchmarks.ops import bench  # noqa: E402
from engine.config import engine_config  # noqa: E402
from engine.models.loader import model_spec, resolve_model_path  # noqa: E402

DT = torch.bfloat16


def per_matmul_us(xs, ws) -> float:
    return per_matmul_s(F.linear, xs, ws) * 1e6


def blas(arch) -> None:
    layer_shapes = {**shapes(arch), "lm_head": (arch.vocab_size, arch.hidden_size)}
    for name, (N, K) in layer_shapes.items():
        count = 1 if name == "lm_head" else arch.num_hidden_layers
        ws = [torch.randn(N, K, device="cuda", dtype=DT) * 0.02 for _ in range(count)]
        for M in (1, 2, 4, 8, 32, 64, 128, 256, 512) + (() if name == "lm_head" else (2048, 16384)):
            xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(count)]
            times = {}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                times[library] = per_matmul_us(xs, ws)
            print(f"{name:8s} M={M:5d}: " + ", ".join(f"{k} {t:7.2f} us ({2 * M * N * K / t / 1e6:5.1f} TFLOP/s)"
                                                      for k, t in times.items()), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


@triton.jit
def _stream_kernel(src, out, n, BLOCK: tl.constexpr):
    """Reads src once (evict_first, as attention's K/V would have to): a bandwidth-bound kernel."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    tl.store(out + tl.program_id(0), tl.sum(x.to(tl.float32)))


@triton.jit
def _prefetch_kernel(src, out, n, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Loads src with evict_last, so that it stays in L2 for the kernels after it."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for c in range(CHUNKS):
        offs = (tl.program_id(0) * CHUNKS + c) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc))


def l2(arch) -> None:
    layers = arch.num_hidden_layers
    layer_shapes = shapes(arch)
    for name, (N, K) in layer_shapes.items():
        ws = [torch.randn(N, K, device="cuda", dtype=DT) * 0.02 for _ in range(layers)]
        for M in (1, 8, 32, 128, 256):
            xs = [torch.randn(M, K, device="cuda", dtype=DT) for _ in range(layers)]
            print(f"{name:8s} M={M:4d}: distinct weights {per_matmul_us(xs, ws):6.2f} us, "
                  f"one weight (from L2) {per_matmul_us(xs, [ws[0]] * layers):6.2f} us", flush=True)
    order = ["o", "gate_up", "down", "qkv"]  # the matmuls from one attention to the next
    sizes = [N * K for N, K in layer_shapes.values()]
    size = sum(sizes)
    flats = [torch.randn(size, device="cuda", dtype=DT) * 0.02 for _ in range(layers)]  # a layer's four weights
    weights = [{name: w.view(shape) for (name, shape), w in zip(layer_shapes.items(), torch.split(flat, sizes))}
               for flat in flats]
    sink, side = torch.zeros(1 << 20, device="cuda"), torch.cuda.Stream()
    for megabytes, M in ((64, 16), (256, 64), (1024, 256)):  # about a layer's K/V at M rows of 1k tokens
        buf = torch.randn(megabytes << 19, device="cuda", dtype=DT)
        xs = {name: torch.randn(M, layer_shapes[name][1], device="cuda", dtype=DT) for name in order}

        def layer_loop(stream: bool, matmuls: bool, prefetch: bool):
            def run():
                for layer in range(layers):
                    if prefetch:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            _prefetch_kernel[(triton.cdiv(size, 32768),)](flats[layer], sink, size, BLOCK=4096,
                                                                          CHUNKS=8)
                    if stream:
                        _stream_kernel[(triton.cdiv(buf.numel(), 8192),)](buf, sink, buf.numel(), BLOCK=8192,
                                                                          num_warps=8)
                    if prefetch:
                        torch.cuda.current_stream().wait_stream(side)
                    if matmuls:
                        for name in order:
                            F.linear(xs[name], weights[layer][name])
            return run

        cases = {"stream": (True, False, False), "matmuls": (False, True, False), "both": (True, True, False),
                 "both, prefetched": (True, True, True), "prefetch alone": (False, False, True)}
        print(f"{megabytes} MB streamed, M={M}, us a layer: " + ", ".join(
            f"{k} {bench(layer_loop(*v), graph=True) * 1e3 / layers:.2f}" for k, v in cases.items()), flush=True)


if __name__ == "__main__":
    questions = {"blas": blas, "l2": l2}
    cfg = engine_config(os.environ.get("MODEL", "qwen3-0.6b"))
    arch = model_spec(cfg.model, resolve_model_path(cfg.model))[1]
    with torch.inference_mode():
        for name in sys.argv[1:] or list(questions):
            questions[name](arch)

"""The decode step's projections in bfloat16 against W8A8 FP8 (issue 31), per matmul, on the GPU.

For each projection of $MODEL's arch (default Qwen3-8B) at M rows: F.linear over bf16 weights, torch._scaled_mm
over FP8 weights with activations quantized already (the GEMM alone), the same GEMM by benchmarks/gemm.py's
Triton kernel on e4m3 operands (its best config, split-K among them; each checked against _scaled_mm), the
activations' quantization alone (ops.quantize_rows_to_e4m3), and ops.fp8_matmul (quantization and
_scaled_mm). Each is timed as the engine runs it: over
num_hidden_layers distinct weights (from HBM, not L2), captured in one CUDA graph, replayed (benchmarks/ops.bench,
do_bench medians); time per matmul = replay time / layers.
Usage (GPU): [MODEL=qwen3-0.6b] [PROJ=gate_up,down] [LAYERS=n] [TRITON=0] python3 benchmarks/fp8_gemm.py [M ...]
(default 16 64 128 256 512; each row is followed by torch._scaled_mm's variants and fp8_matmul's paths, scaled_mm_variants and fp8_matmul_paths; PROJ: some of qkv, o, gate_up, down, default all; the Triton sweep compiles every
config, ~25 s a row, TRITON=0 leaves it out; LAYERS: distinct weights per projection, default the model's
layers; a 70B model's bf16 copies of all 80 do not fit, and 2 of its weights already exceed the L2)
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402
from benchmarks.gemm import configs, shapes, triton_linear  # noqa: E402
from benchmarks.ops import bench  # noqa: E402
from engine.config import engine_config  # noqa: E402
from engine.models.loader import model_spec, resolve_model_path  # noqa: E402


def triton_fp8(xq, xs, w8, m: int, k: int) -> tuple[float, tuple | None]:
    """The fastest of benchmarks/gemm.py's configs over the e4m3 operands (ms per matmul, as the others), among
    those whose result matches _scaled_mm's; (inf, None) if none does."""
    layers = len(w8)
    ref = torch._scaled_mm(xq, w8[0][0].t(), scale_a=xs, scale_b=w8[0][1].reshape(1, -1), out_dtype=torch.bfloat16)
    best = (float("inf"), None)
    for config in configs(m, k):
        run = lambda q, s: triton_linear(xq, q, config, (xs.reshape(-1), s.reshape(-1)), torch.bfloat16)  # noqa: E731
        try:
            if not torch.allclose(run(*w8[0]).float(), ref.float(), atol=2e-2, rtol=2e-2):
                print(f"  WRONG M={m} {config}")
                continue
            t = bench(lambda: [run(q, s) for q, s in w8], graph=True) / layers
        except Exception as e:  # noqa: BLE001 (out of shared memory or registers)
            print(f"  skip {config}: {type(e).__name__}")
            continue
        best = min(best, (t, config))
    return best


def scaled_mm_variants(xq, xs, w8) -> dict[str, float]:
    """The GEMM alone (ms per matmul) as the engine runs it (row-wise scales, which torch sends to its CUTLASS
    kernel on Hopper), with fast accumulation, and with one scale per tensor (cuBLASLt), each with and without
    fast accumulation: whether another of torch's FP8 paths reads the weights faster at decode sizes."""
    layers, one = len(w8), torch.ones((), device=xq.device)
    rowwise = lambda fast: lambda: [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.reshape(1, -1),  # noqa: E731
                                                     out_dtype=torch.bfloat16, use_fast_accum=fast) for q, s in w8]
    tensorwise = lambda fast: lambda: [torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one,  # noqa: E731
                                                        out_dtype=torch.bfloat16, use_fast_accum=fast) for q, _ in w8]
    return {name: bench(fn, graph=True) / layers for name, fn in (
        ("gemm_rowwise", rowwise(False)), ("gemm_rowwise_fast", rowwise(True)),
        ("gemm_tensorwise", tensorwise(False)), ("gemm_tensorwise_fast", tensorwise(True)))}


def fp8_matmul_paths(x, w8) -> dict[str, float]:
    """ops.fp8_matmul (ms per matmul) down each of its paths, with and without a residual to add into: unit
    scales then scale_product, and the row-wise scales of _scaled_mm itself (padded as the op pads): where
    ops.UNIT_SCALE_ROWS and UNIT_SCALE_ROWS_WITH_RESIDUAL belong."""
    layers, residual = len(w8), torch.zeros(x.shape[0], w8[0][0].shape[0], device=x.device, dtype=x.dtype)
    times = {}
    for path, rows in (("op_unit", 1 << 30), ("op_rowwise", 0)):
        for name, res in ((path, None), (path + "+res", residual)):
            saved = ops.UNIT_SCALE_ROWS, ops.UNIT_SCALE_ROWS_WITH_RESIDUAL
            ops.UNIT_SCALE_ROWS = ops.UNIT_SCALE_ROWS_WITH_RESIDUAL = rows
            try:
                times[name] = bench(lambda: [ops.fp8_matmul(x, q, s.reshape(-1), None, res) for q, s in w8],
                                    graph=True) / layers
            finally:
                ops.UNIT_SCALE_ROWS, ops.UNIT_SCALE_ROWS_WITH_RESIDUAL = saved
    return times


def main(rows: list[int]) -> None:
    cfg = engine_config(os.environ.get("MODEL", "qwen3-8b"))
    arch = model_spec(cfg.model, resolve_model_path(cfg.model))[1]
    layers = int(os.environ.get("LAYERS", arch.num_hidden_layers))
    sweep = os.environ.get("TRITON", "1") != "0"
    print(f"{cfg.model.name}: per matmul, us (over {layers} distinct weights, one CUDA graph)")
    print(f"{'proj':8s} {'M':>5s} {'bf16':>8s} {'fp8 gemm':>9s} {'triton fp8':>11s} {'quant':>7s} {'fp8_matmul':>11s} "
          f"{'speed-up':>9s} {'TB/s':>6s} triton config")
    chosen = os.environ.get("PROJ", "").split(",") if os.environ.get("PROJ") else list(shapes(arch))
    for name, (n, k) in ((name, nk) for name, nk in shapes(arch).items() if name in chosen):
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        w8 = [ops.quantize_rows_to_e4m3(w) for w in w16]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = ops.quantize_rows_to_e4m3(x)
            t16 = bench(lambda: [F.linear(x, w) for w in w16], graph=True) / layers
            tgemm = bench(lambda: [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.reshape(1, -1),
                                                    out_dtype=torch.bfloat16) for q, s in w8], graph=True) / layers
            gemm_variants = scaled_mm_variants(xq, xs, w8) | fp8_matmul_paths(x, w8)
            ttriton, best = triton_fp8(xq, xs, w8, m, k) if sweep else (float("nan"), None)
            tquant = bench(lambda: [ops.quantize_rows_to_e4m3(x) for _ in w8], graph=True) / layers
            tfp8 = bench(lambda: [ops.fp8_matmul(x, q, s.reshape(-1)) for q, s in w8], graph=True) / layers
            print(f"{name:8s} {m:5d} {t16 * 1e3:8.1f} {tgemm * 1e3:9.1f} {ttriton * 1e3:11.1f} {tquant * 1e3:7.1f} "
                  f"{tfp8 * 1e3:11.1f} {t16 / tfp8:8.2f}x {n * k / tfp8 / 1e9:6.2f} "
                  f"{best}", flush=True)
            print(f"{'':8s} {m:5d} GEMM variants and fp8_matmul's paths, us: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in gemm_variants.items()),
                  flush=True)
        del w16, w8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [16, 64, 128, 256, 512])

"""The decode attention kernel alone over a bfloat16 and an FP8 (e4m3) cache: µs a call and the K/V bytes read
per second (CUDA-graph replays), at the shapes of the 0.6B and 8B models' decode steps (--small: of Qwen2.5-0.5B's and Llama-3.2-1B's,
head_dim 64, bfloat16 only), for this tree's kernel and, with --baseline, another version's
ops/paged_attention.py. --sweep also times DECODE_CFG's tile choices for each cache dtype (over an e4m3 cache on
Hopper, the split query's, unless the Gluon kernel takes those launches).
Results: benchmarks/NOTES.md (issue 31; session 26 ran the version of 805f5f2, which also timed a value cache
stored with each block transposed; session 31 the Gluon kernel against the Triton one).

    python3 benchmarks/decode_kernel.py [--baseline PATH] [--sweep] [--small]     (a CUDA GPU)
"""
import argparse
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops import paged_attention  # noqa: E402
from ops.paged_attention_reference import to_cache  # noqa: E402

BS = 16
SHAPES = [(16, 8, 256, 2048, 128), (16, 8, 64, 4096, 128), (32, 8, 256, 1024, 128), (32, 8, 64, 4096, 128)]  # Hq, Hkv, rows, context, head_dim
SMALL_SHAPES = [(14, 2, 256, 1024, 64), (14, 2, 64, 1024, 64), (32, 8, 256, 1024, 64), (32, 8, 64, 1024, 64)]
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SWEEP = dict(BLOCK_N=(64, 128), num_warps=(2, 4), num_stages=(2, 3))
SMALL_SWEEP = dict(BLOCK_N=(32, 64, 128), num_warps=(2, 4), num_stages=(2, 3))


def load_module(path):
    spec = importlib.util.spec_from_file_location("paged_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(hq, hkv, rows, ctx, d, cache_dtype):
    """A pool holding rows x ctx tokens in shuffled blocks, and a query per row."""
    blocks = rows * ctx // BS
    k, v = (to_cache(torch.randn(blocks, hkv, BS, d, device="cuda"), cache_dtype) for _ in range(2))
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int64).to(torch.int32).view(rows, ctx // BS)
    q = torch.randn(rows, hq, d, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    return q, k, v, tables, seq_lens, 1 / math.sqrt(d)


def time_us(module, args, calls=10):
    """µs a call, from replays of a CUDA graph of `calls` calls: the engine's decode steps replay graphs, and
    eager launches of the small shapes measure the host's launch, not the kernel."""
    out = module.paged_attention_decode(*args)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            module.paged_attention_decode(*args, out=out)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1e3 / calls


def read_tbs(shape, cache_dtype, us):
    hq, hkv, rows, ctx, d = shape
    return 2 * rows * ctx * hkv * d * torch.empty((), dtype=cache_dtype).element_size() / us / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="another version's ops/paged_attention.py")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--small", action="store_true")
    opts = parser.parse_args()
    shapes, caches, sweep = (SMALL_SHAPES, {"bf16": CACHES["bf16"]}, SMALL_SWEEP) if opts.small else (SHAPES, CACHES, SWEEP)
    versions = [("tree", paged_attention)]
    if opts.baseline:
        versions.append(("baseline", load_module(opts.baseline)))
    print(f"{'cache':5} {'Hq/Hkv':7} {'rows x ctx':12} " + " ".join(f"{name + ' µs':>12} {'TB/s':>6}" for name, _ in versions))
    for (name, dtype), shape in itertools.product(caches.items(), shapes):
        cells = []
        for _, module in versions:
            us = time_us(module, inputs(*shape, dtype))
            cells.append(f"{us:12.1f} {read_tbs(shape, dtype, us):6.2f}")
        print(f"{name:5} {shape[0]}/{shape[1]:<5} {shape[2]:>4} x {shape[3]:<5} d {shape[4]:<3} " + " ".join(cells), flush=True)
    if not opts.sweep:
        return
    for name, dtype in caches.items():
        q, key_cache, value_cache = inputs(16, 8, 1, BS, 128, dtype)[:3]
        split = paged_attention.split_query(q, key_cache)
        if split and paged_attention.paged_attention_gluon.takes(q, key_cache, value_cache):
            print(f"sweep {name}: the Gluon kernel takes these launches (its tile: ops/paged_attention_gluon.py)")
            continue
        key = "gpu" if name == "bf16" else "gpu_fp8_split_query" if split else "gpu_fp8"
        chosen = dict(paged_attention.DECODE_CFG[key])
        for values in itertools.product(*sweep.values()):
            cfg = dict(zip(sweep, values))
            paged_attention.DECODE_CFG[key] = cfg
            times = [time_us(paged_attention, inputs(*shape, dtype)) for shape in shapes]
            mark = " (DECODE_CFG)" if cfg == chosen else ""
            print(f"sweep {name} {cfg}: " + " ".join(f"{t:.1f}" for t in times)
                  + f" µs, sum {sum(times):.1f}{mark}", flush=True)
        paged_attention.DECODE_CFG[key] = chosen


if __name__ == "__main__":
    main()

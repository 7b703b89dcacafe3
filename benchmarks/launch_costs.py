"""What a launch costs, apart from any kernel's speed (GPU only).

1. Host microseconds per call, the device idle before each: cuBLAS (F.linear, the qkv layer's shape) at
   token counts it has not met before and again at the same counts; a Triton launch (RMSNorm) likewise.
   An eager mixed step makes ~113 cuBLAS calls and ~255 Triton launches at a token count of its own.
2. A CUDA graph of N dependent launches of a one-element kernel: device microseconds per node, the
   least a step of N kernels costs whatever they compute (a decode step of Qwen3-0.6B has ~285).
Usage: python3 benchmarks/launch_costs.py
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402


def host_us(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6


def median(values) -> float:
    return sorted(values)[len(values) // 2]


def launch_host_costs(counts: list[int]) -> None:
    x = torch.randn(max(counts), 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    calls = {"cuBLAS linear": lambda m: F.linear(x[:m], w),
             "Triton rms_norm": lambda m: ops.rms_norm(x[:m], norm_w, 1e-6)}
    for name, call in calls.items():
        call(8)  # first use: handles, compilation
        first = [host_us(lambda: call(m)) for m in counts]
        again = [host_us(lambda: call(m)) for m in counts]
        print(f"{name}: host us per call, {len(counts)} token counts: first time median {median(first):.1f} "
              f"(max {max(first):.1f}), again median {median(again):.1f} (max {max(again):.1f})")


def graph_chain(num_nodes: int, replays: int = 50) -> float:
    """Device microseconds per node of a CUDA graph of num_nodes dependent one-element adds."""
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(num_nodes):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / num_nodes


if __name__ == "__main__":
    generator = torch.Generator().manual_seed(0)
    launch_host_costs(sorted(set(torch.randint(600, 16384, (40,), generator=generator).tolist())))
    for nodes in (100, 285, 1000):
        print(f"graph of {nodes} dependent one-element kernels: {graph_chain(nodes):.2f} us per node")

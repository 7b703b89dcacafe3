"""The MoE experts op (ops/moe.py) at the Qwen3-30B-A3B shape (128 experts, 8 a token, hidden 2,048, expert
intermediate 768, bf16), by the number of tokens T: each tile candidate's time against the bytes of the experts
its tokens route to (uniform routing, each token 8 distinct experts), and the share of a decode step it
would be (48 layers). Each kernel's tiles are swept with the other's at its default; every candidate's output
is checked against the defaults'. Times are medians of CUDA-event pairs over REPEATS calls, after one
warm-up call that compiles.
Usage: python3 benchmarks/moe_op.py [T ...]   (default 1 16 64 256 4096)
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops.moe import DEFAULT_TILES, Tiles, moe_experts  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 48
REPEATS = 20
COPY_BYTES_PER_S = 4.2e12  # the H200's measured copy speed (engine/hardware.py's, as the bench logs it)
BLOCK_M = (16, 32, 64)
GATE_UP = [Tiles(n, k, w, s) for n, k, w, s in
           [(32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3)]]
DOWN = [Tiles(n, k, w, s) for n, k, w, s in
        [(32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3)]]


def timed_us(call) -> float:
    call()
    times = []
    for _ in range(REPEATS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(token_counts: list[int]) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / 32
    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    print(f"{'T':>5} {'experts':>7} {'floor us':>8}  block_m  gate_up tiles (n, k, warps, stages)  down tiles"
          f"{'us':>10} {'GB/s':>7} {'x48 ms':>7}")
    for tokens in token_counts:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda"), -1)
        touched = int(ids.unique().numel())
        floor_us = touched * expert_bytes / COPY_BYTES_PER_S * 1e6
        reference = moe_experts(x, gate_up, down, weights, ids)
        candidates = [(m, DEFAULT_TILES, DEFAULT_TILES) for m in BLOCK_M]
        candidates += [(m, t, DEFAULT_TILES) for m in BLOCK_M for t in GATE_UP]
        candidates += [(m, DEFAULT_TILES, t) for m in BLOCK_M for t in DOWN]
        results = []
        for block_m, up_tiles, down_tiles in candidates:
            call = lambda: moe_experts(x, gate_up, down, weights, ids, block_m, up_tiles, down_tiles)  # noqa: E731
            error = (call().float() - reference.float()).abs().max().item()
            if error > 1e-2 * reference.float().abs().max().item():
                print(f"{tokens:5d} block_m {block_m} {up_tiles} {down_tiles}: differs by {error}")
                continue
            results.append((timed_us(call), block_m, up_tiles, down_tiles))
        best = sorted(results, key=lambda r: r[0])[:4]
        default = [r for r in results if r[1:] == (16, DEFAULT_TILES, DEFAULT_TILES) and r not in best]
        for us, block_m, up_tiles, down_tiles in best + default:  # the four fastest, then today's default
            print(f"{tokens:5d} {touched:7d} {floor_us:8.1f}  {block_m:7d}  {tuple(vars(up_tiles).values())!s:35} "
                  f"{tuple(vars(down_tiles).values())!s:18} {us:8.1f} {touched * expert_bytes / us / 1e3:7.0f} "
                  f"{us * LAYERS / 1e3:7.2f}")


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [1, 16, 64, 256, 4096])

"""The MoE experts op (ops/moe.py) at the Qwen3-30B-A3B shape (128 experts, 8 a token, hidden 2,048, expert
intermediate 768, bf16), by the number of tokens T: each launch candidate's time against the bytes of the experts
its tokens route to (uniform routing, each token 8 distinct experts), and the share of a decode step it
would be (48 layers). At each block_m, each kernel's tiles are swept with the other's at its default (the two
kernels run one after the other, so their best tiles combine); the best combination is timed again and, with
--save, written to the op's tuned table (ops/moe_tuned/<key>.json, which ops.moe.moe_launch reads; the
token counts not swept keep their entries). Every
candidate's output is checked against the default launch's. Times are medians over REPEATS replays of a
CUDA graph of GRAPH_CALLS calls (as decode runs the op), after one warm-up call that compiles.
Usage: python3 benchmarks/moe_op.py [--save] [T ...]   (default T: SWEPT_TOKENS; block_m above 16 only where
       the experts average half as many pairs or more: an expert's pairs then fit one block, its weights read once)
"""
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops.moe import DEFAULT_LAUNCH, DEFAULT_TILES, TUNED_DIR, Launch, Tiles, moe_experts, tuned_key  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 48
REPEATS = 10
GRAPH_CALLS = 8  # calls a timed graph holds
COPY_BYTES_PER_S = 4.2e12  # the H200's measured copy speed (engine/hardware.py's, as the bench logs it)
BLOCK_M = (16, 32, 64, 128)
SWEPT_TOKENS = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]  # every decode batch size has one near
# (block_n, block_k, warps, stages[, group_m]): the grouped order (ops/moe.py _program_tile) for the prefill-sized tiles
GATE_UP = [Tiles(*t) for t in
           [(32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3),
            (128, 128, 8, 3), (64, 64, 4, 3, 8), (128, 64, 8, 3, 8), (128, 128, 8, 3, 8)]]
DOWN = [Tiles(*t) for t in
        [(32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
         (128, 64, 4, 3, 8), (128, 64, 8, 3, 8)]]


def timed_us(call) -> float:
    """The median of REPEATS timings of call() replayed from a CUDA graph (decode runs it so: eager timings
    of small T measure the host's launches), each of GRAPH_CALLS calls."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    graph.replay()
    times = []
    for _ in range(REPEATS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def best_launch(x, gate_up, down, weights, ids) -> tuple[Launch, float, float]:
    """(the fastest launch found, its time in us, the default launch's time in us) for one T: the best tiles
    of each kernel combined, unless the default launch times faster."""
    reference = moe_experts(x, gate_up, down, weights, ids, *vars(DEFAULT_LAUNCH).values())

    def time_of(launch: Launch) -> float:
        call = lambda: moe_experts(x, gate_up, down, weights, ids, *vars(launch).values())  # noqa: E731
        try:
            error = (call().float() - reference.float()).abs().max().item()
        except OutOfResources as err:  # the tiles need more shared memory than the device has
            print(f"{x.shape[0]:5d} {launch}: {err}")
            return float("inf")
        if error > 1e-2 * reference.float().abs().max().item():
            print(f"{x.shape[0]:5d} {launch}: differs by {error}")
            return float("inf")
        return timed_us(call)

    estimates, pairs_per_expert = [], x.shape[0] * TOP_K / EXPERTS
    for block_m in (m for m in BLOCK_M if m == BLOCK_M[0] or m <= 2 * pairs_per_expert):  # not mostly padding
        base = time_of(Launch(block_m))
        up_us, up = min((time_of(Launch(block_m, t, DEFAULT_TILES)), t) for t in GATE_UP)
        down_us, down_tiles = min((time_of(Launch(block_m, DEFAULT_TILES, t)), t) for t in DOWN)
        estimates.append((up_us + down_us - base, Launch(block_m, up, down_tiles)))
    launch = min(estimates, key=lambda e: e[0])[1]
    us, default_us = time_of(launch), time_of(DEFAULT_LAUNCH)
    return (launch, us, default_us) if us < default_us else (DEFAULT_LAUNCH, default_us, default_us)


def main(token_counts: list[int], save: bool) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / 32
    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    print(f"{'T':>5} {'experts':>7} {'floor us':>8} {'default us':>10} {'best us':>8} {'GB/s':>6} {'x48 ms':>7}  "
          "best: block_m, gate_up and down tiles (n, k, warps, stages)")
    table = {}
    for tokens in token_counts:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda"), -1)
        touched = int(ids.unique().numel())
        launch, us, default_us = best_launch(x, gate_up, down, weights, ids)
        table[tokens] = launch.to_json()
        print(f"{tokens:5d} {touched:7d} {touched * expert_bytes / COPY_BYTES_PER_S * 1e6:8.1f} {default_us:10.1f} "
              f"{us:8.1f} {touched * expert_bytes / us / 1e3:6.0f} {us * LAYERS / 1e3:7.2f}  {launch.block_m}, "
              f"{tuple(vars(launch.gate_up).values())}, {tuple(vars(launch.down).values())}", flush=True)
    if save:
        path = TUNED_DIR / f"{tuned_key(EXPERTS, INTER, HIDDEN, torch.bfloat16, torch.device('cuda'))}.json"
        path.parent.mkdir(exist_ok=True)
        saved = {int(t): entry for t, entry in json.loads(path.read_text()).items()} if path.exists() else {}
        path.write_text(json.dumps(dict(sorted({**saved, **table}.items())), indent=1) + "\n")
        print(f"saved {path}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--save"]
    main([int(t) for t in args] or SWEPT_TOKENS, "--save" in sys.argv[1:])

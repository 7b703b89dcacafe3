"""Where a decode step's time goes on the GPU: busy share and host overhead per step.

Builds the engine on the Qwen3-0.6B shape, prefills N prompts, then times decode steps (device steps: an
engine.step() of a decode run takes several): wall time (no profiler), summed kernel time (torch.profiler,
CUDA activity only), their difference per step as the host overhead, the kernel time per step by kernel, the
host time of each phase of a step, and cProfile's top host functions.
Usage: [MODEL=llama-3.2-1b] [OVERRIDES="cache.cascade_attention=off ..."] python3 benchmarks/profile_decode.py
       [--host] SEQS:CONTEXT[+PREFIX][xSAMPLES] [...]
CONTEXT is a prompt length or a range LO-HI (lengths uniform in it, as in the nano workload); +PREFIX puts
one shared prefix of PREFIX tokens before every prompt (as the shared_prefix workload: the prefix cache
shares its blocks, cascade attention reads them once per group); xSAMPLES: SEQS / SAMPLES prompts of
SAMPLES samples each at temperature 1 (as the rollout workload: groups of SAMPLES rows); --host adds the host phases and
cProfile. --mixed K: then, four times, K more prompts of the same kind arrive and the steps that prefill
them beside the running decodes (mixed steps, run eagerly) are timed: wall time, kernel time by kernel,
and cProfile's top host functions. Default: 256:1024.
"""
import cProfile
import gc
import itertools
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.engine import LLMEngine  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from jobs.config import engine_config_of, register_configs  # noqa: E402


COPY_BYTES_PER_S = 4.26e12  # the H200's measured device-to-device copy


def bench_engine(*overrides: str) -> LLMEngine:
    """The engine of the GPU benchmarks: random weights of $MODEL's shape (default Qwen3-0.6B), 256
    sequences, 16384 tokens."""
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={os.environ.get('MODEL', 'qwen3-0.6b')}", "scheduler.max_num_seqs=256",
                                           "scheduler.max_num_batched_tokens=16384", "job=bench", *overrides])
    return LLMEngine(engine_config_of(cfg))  # the plain dataclasses a job hands the engine: omegaconf's look-ups cost


def main(num_seqs: int, context: str, host: bool, mixed: int, steps: int = 50, temperature: float = 0.6) -> None:
    context, _, samples = context.partition("x")
    samples = int(samples or 1)
    temperature = 1.0 if samples > 1 else temperature
    context, _, prefix_len = context.partition("+")
    lo, _, hi = context.partition("-")
    lo, hi = int(lo), int(hi or lo)
    overrides = os.environ.get("OVERRIDES", "").split()
    engine = bench_engine(f"scheduler.max_num_seqs={num_seqs + 4 * mixed}", *overrides)
    generator = torch.Generator().manual_seed(0)
    vocab = min(10000, engine.model.arch.vocab_size)
    prefix = torch.randint(0, vocab, (int(prefix_len or 0),), generator=generator).tolist()
    ids = itertools.count()

    def add_requests(count: int) -> None:
        for _ in range(count):
            length = int(torch.randint(lo, hi + 1, (1,), generator=generator))
            prompt = prefix + torch.randint(0, vocab, (length,), generator=generator).tolist()
            engine.add_request(str(next(ids)), prompt,
                               SamplingParams(n=samples, temperature=temperature, max_tokens=10 * steps,
                                              ignore_eos=True))

    add_requests(num_seqs // samples)
    prefill_all(engine)
    for _ in range(5):
        engine.step()
    bytes_per_token = engine.kv_cache.bytes / (engine.num_blocks * engine.block_size)
    logical = sum(s.sequence_length for s in engine.block_manager.sequences.values())  # shared ones per row
    kv_floor = logical * bytes_per_token / COPY_BYTES_PER_S
    timed, wall = synced(run_steps, engine, steps)
    grouped = sum(s.cascade_rows for s in engine.stats.steps[-timed:]) / timed  # rows a step that cascade
    (profiled, profiled_wall), busy, by_kernel = kernel_seconds(run_steps, engine, steps)
    shape = (f"{context}+{prefix_len}" if prefix_len else context) + (f" x{samples}" if samples > 1 else "")
    # the profiled steps come after the timed ones, over longer contexts: their busy share is of their own wall
    print(f"decode batch {num_seqs}, context {shape}: {wall / timed * 1e3:.2f} ms/step wall; then, profiled, "
          f"{profiled_wall / profiled * 1e3:.2f} ms/step wall, {busy / profiled * 1e3:.2f} ms/step GPU busy "
          f"({100 * busy / profiled_wall:.1f}%, host overhead {(profiled_wall - busy) / profiled * 1e3:.2f} "
          f"ms/step); {num_seqs * timed / wall:.0f} tok/s, "
          f"every row's own K/V at copy speed {kv_floor * 1e3:.2f} ms/step, rows in sharing groups "
          f"{grouped:.0f} a step")
    print_kernels(by_kernel, profiled, 16)
    if host:
        phases(engine, lambda: synced(run_steps, engine, steps)[::-1])
        profiler = cProfile.Profile()
        profiler.runcall(run_steps, engine, steps)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    if mixed:
        mixed_steps(engine, mixed, add_requests)
    engine.close()


def prefill_all(engine) -> int:
    """Step until no request has prompt tokens left to compute; returns the device steps taken."""
    before = len(engine.stats.steps)
    while any(s.num_uncomputed_tokens > 1 for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
        engine.step()
    return len(engine.stats.steps) - before


def mixed_steps(engine, count: int, add_requests) -> None:
    """Four rounds of `count` new prompts prefilled beside the running decodes: wall, kernels, host phases, cProfile."""
    add_requests(count)
    taken, wall = synced(prefill_all, engine)
    add_requests(count)
    (profiled, _), busy, by_kernel = kernel_seconds(prefill_all, engine)
    print(f"{count} new prompts beside {len(engine.scheduler.running) - 2 * count} decodes: {taken} steps, "
          f"{wall / taken * 1e3:.2f} ms/step wall; {busy / profiled * 1e3:.2f} ms/step of kernels over "
          f"{profiled} steps")
    print_kernels(by_kernel, profiled, 24)
    add_requests(count)
    phases(engine, lambda: synced(prefill_all, engine)[::-1])
    add_requests(count)
    profiler = cProfile.Profile()
    profiler.runcall(prefill_all, engine)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(16)


def run_steps(engine, calls: int) -> int:
    """engine.step() `calls` times; returns the device steps they took (a decode run takes several a call)."""
    before = len(engine.stats.steps)
    for _ in range(calls):
        engine.step()
    return len(engine.stats.steps) - before


def synced(fn, *args):
    """(fn(*args), its wall seconds), the device synchronised before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args)
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def kernel_seconds(fn, *args) -> tuple[tuple[object, float], float, dict[str, tuple[float, int]]]:
    """fn(*args) under the profiler (CUDA activity only, to keep it light): (its result, its wall seconds), the
    summed GPU kernel time, and per kernel name (seconds, calls)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = synced(fn, *args)
    by_kernel: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            seconds, calls = by_kernel.get(e.name, (0.0, 0))
            by_kernel[e.name] = (seconds + e.device_time / 1e6, calls + 1)
    return result, sum(seconds for seconds, _ in by_kernel.values()), by_kernel


def print_kernels(by_kernel: dict[str, tuple[float, int]], steps: int, top: int) -> None:
    for name, (seconds, calls) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {seconds / steps * 1e3:7.3f} ms/step {calls // steps:4d} calls/step  {name[:90]}")


def phases(engine, run) -> None:
    """Host milliseconds per step in scheduling, launching (of which building inputs and enqueueing the
    forward; the rest of it enqueues sampling) and waiting for the previous step's tokens; the rest is
    bookkeeping. run() -> (wall seconds, steps)."""
    totals = {"schedule": 0.0, "launch": 0.0, "step_arrays": 0.0, "forward": 0.0, "wait for tokens": 0.0}
    timed(engine.scheduler, "schedule", totals, "schedule")
    timed(engine.runner, "launch", totals, "launch")
    timed(engine.runner, "step_arrays", totals, "step_arrays")
    timed(engine.runner, "forward", totals, "forward")
    timed(engine, "_tokens", totals, "wait for tokens")
    wall, steps = run()
    owners = {"schedule": engine.scheduler, "launch": engine.runner, "step_arrays": engine.runner,
              "forward": engine.runner, "_tokens": engine}
    for name, owner in owners.items():
        delattr(owner, name)  # the instance's wrapper goes; the class's method is back
    rest = wall - totals["schedule"] - totals["launch"] - totals["wait for tokens"]
    print("host per step, ms: " + ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in totals.items())
          + f", other {rest / steps * 1e3:.3f}")


def timed(obj, name: str, totals: dict, key: str) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


if __name__ == "__main__":
    args = sys.argv[1:]
    mixed = int(args[args.index("--mixed") + 1]) if "--mixed" in args else 0
    specs = [a for a in args if ":" in a]
    for spec in specs or ["256:1024"]:
        seqs, _, ctx = spec.partition(":")
        with torch.inference_mode():
            main(int(seqs), ctx, "--host" in args, mixed)
        gc.collect()
        torch.cuda.empty_cache()

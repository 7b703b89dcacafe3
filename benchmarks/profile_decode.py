"""Where a decode step's time goes on the GPU: busy share and host overhead per step (issue 4).

Builds the engine on the Qwen3-0.6B shape, prefills N prompts, then times decode steps: wall time
(no profiler), summed kernel time (torch.profiler, CUDA activity only), their difference per step as
the host overhead, the host time of each phase of a step, and cProfile's top host functions.
Usage: python3 benchmarks/profile_decode.py [num_seqs] [context]
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.config import register_configs  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402


def main(num_seqs: int = 256, context: int = 1024, steps: int = 50, temperature: float = 0.6) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=qwen3-0.6b", f"scheduler.max_num_seqs={num_seqs}",
                                           "scheduler.max_num_batched_tokens=16384", "job=bench"])
    engine = LLMEngine(cfg)
    generator = torch.Generator().manual_seed(0)
    for i in range(num_seqs):
        prompt = torch.randint(0, min(10000, engine.model.arch.vocab_size), (context,), generator=generator).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=temperature, max_tokens=10 * steps, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
        engine.step()
    for _ in range(5):
        engine.step()
    wall = timed_steps(engine, steps)
    busy = kernel_seconds(engine, steps)
    print(f"decode batch {num_seqs}, context ~{context}: {wall / steps * 1e3:.2f} ms/step wall, "
          f"{busy / steps * 1e3:.2f} ms/step GPU busy ({100 * busy / wall:.1f}%), "
          f"host overhead {(wall - busy) / steps * 1e3:.2f} ms/step, {num_seqs * steps / wall:.0f} tok/s")
    phases(engine, steps)
    profiler = cProfile.Profile()
    profiler.runcall(timed_steps, engine, steps)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def timed_steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def kernel_seconds(engine, steps: int) -> float:
    """Summed GPU kernel time of `steps` decode steps (CUDA activity only, to keep the profiler light)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, steps)
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6


def phases(engine, steps: int) -> None:
    """Host milliseconds per step in scheduling, launching (building inputs, enqueueing the forward and
    sampling) and waiting for the previous step's tokens; the rest is bookkeeping."""
    totals = {"schedule": 0.0, "launch": 0.0, "wait for tokens": 0.0}
    timed(engine.scheduler, "schedule", totals, "schedule")
    timed(engine.runner, "launch", totals, "launch")
    timed(engine.runner, "tokens", totals, "wait for tokens")
    wall = timed_steps(engine, steps)
    rest = wall - sum(totals.values())
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
    with torch.inference_mode():
        main(*(int(a) for a in sys.argv[1:3]))

"""The host's cost of a decode step, on the CPU, with the model's compute stubbed out.

The engine runs the host one step ahead of the device, so for a small model on a fast GPU the host's time
per step bounds the step. This builds the tiny model's engine on the CPU, replaces the forward and
compute_logits by zeros (what remains is scheduling, block tables, metadata, sampling tensors, the
sampler on a 64-token vocabulary, resolving and statistics), prefills SEQS prompts of 300 tokens (after a
shared prefix of PREFIX tokens), and times engine.step() over decode steps: the best of ROUNDS rounds of
STEPS steps, per device step (--scheduler-steps K: decode runs of K device steps a scheduling), then cProfile's
top functions over one more round with --profile. --admit K: then, ROUNDS
times, K more prompts of the same kind arrive and the step that admits them beside the decodes is timed
(its schedule, and the whole step; shared_prefix's mixed steps admit 64 prompts sharing 2,048 tokens).
Usage: OMP_NUM_THREADS=1 python benchmarks/host_step.py [--seqs 256] [--logprobs K] [--steps 100]
       [--rounds 5] [--prefix 0] [--admit 0] [--scheduler-steps 1] [--profile]
"""
import argparse
import cProfile
import itertools
import pstats
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.engine import LLMEngine  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from jobs.config import engine_config_of, register_configs  # noqa: E402

PROMPT_LEN, STUB_VOCAB = 300, 64


def stubbed_engine(num_seqs: int, scheduler_steps: int = 1) -> LLMEngine:
    """The tiny model's engine on the CPU for num_seqs rows, its forward and logits zeros."""
    return stub_engine([f"scheduler.max_num_seqs={num_seqs}", "scheduler.max_num_batched_tokens=65536",
                        "cache.num_blocks=40000", "model.max_model_len=4096",
                        f"scheduler.num_scheduler_steps={scheduler_steps}"])[0]


def stub_engine(overrides: list[str]):
    """(the tiny model's engine on the CPU with its forward and logits zeros, the composed config) for a bench job
    with these overrides."""
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = compose("config", overrides=["job=bench", "model.device=cpu", *overrides])
    engine = LLMEngine(engine_config_of(cfg))  # the plain dataclasses a job hands the engine, not omegaconf's
    torch.set_num_threads(1)
    hidden = engine.model.arch.hidden_size
    engine.runner.forward = lambda ids, pos, meta: (torch.zeros(ids.shape[0], hidden), None)
    engine.model.compute_logits = lambda h: torch.zeros(h.shape[0], STUB_VOCAB)
    return engine, cfg


def timed(engine: LLMEngine, steps: int) -> float:
    """Seconds per device step over `steps` calls of engine.step() (a decode run's several device steps)."""
    before, start = len(engine.stats.steps), time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / max(len(engine.stats.steps) - before, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument("--admit", type=int, default=0)
    parser.add_argument("--scheduler-steps", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = stubbed_engine(args.seqs + args.rounds * args.admit, args.scheduler_steps)
    max_tokens = ((args.rounds + 2) * args.steps + 20) * args.scheduler_steps  # no sequence finishes while timed
    prefix = [j % 97 + 1 for j in range(args.prefix)]
    request_ids = map(str, itertools.count())

    def add_requests(count: int) -> None:
        for i in range(count):
            prompt = prefix + [(j * 7 + i) % 250 + 1 for j in range(PROMPT_LEN)]
            engine.add_request(next(request_ids), prompt, SamplingParams(
                temperature=0.6, max_tokens=max_tokens, ignore_eos=True, logprobs=args.logprobs))
    add_requests(args.seqs)
    for _ in range(10):  # the prefill, then decode steps
        engine.step()
    best = min(timed(engine, args.steps) for _ in range(args.rounds))
    print(f"{args.seqs} seqs, prefix {args.prefix}, logprobs {args.logprobs}, scheduler steps {args.scheduler_steps}: "
          f"{best * 1e3:.3f} ms a device step (best of {args.rounds} x {args.steps} steps)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(timed, engine, args.steps)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.admit:
        admissions = [admitting_step(engine, add_requests, args.admit) for _ in range(args.rounds)]
        schedule, step = min(a[0] for a in admissions), min(a[1] for a in admissions)
        print(f"{args.admit} prompts admitted beside {args.seqs} decodes: schedule {schedule * 1e3:.2f} ms, "
              f"the step {step * 1e3:.2f} ms (best of {args.rounds})")


def admitting_step(engine: LLMEngine, add_requests, count: int) -> tuple[float, float]:
    """(the scheduler's seconds, the whole step's) for the step that admits `count` new prompts."""
    add_requests(count)
    scheduler, inner = engine.scheduler, engine.scheduler.schedule
    timing = []

    def schedule():
        start = time.perf_counter()
        try:
            return inner()
        finally:
            timing.append(time.perf_counter() - start)
    scheduler.schedule = schedule
    try:
        step = timed(engine, 1)
    finally:
        del scheduler.schedule
    return timing[0], step


if __name__ == "__main__":
    main()

"""The host's cost of a decode step, on the CPU, with the model's compute stubbed out.

The engine runs the host one step ahead of the device, so for a small model on a fast GPU the host's time
per step bounds the step. This builds the tiny model's engine on the CPU, replaces the forward and
compute_logits by zeros (what remains is scheduling, block tables, metadata, sampling tensors, the
sampler on a 64-token vocabulary, resolving and statistics), prefills SEQS prompts of 300 tokens, and
times engine.step() over decode steps: the best of ROUNDS rounds of STEPS steps, then cProfile's top
functions over one more round with --profile.
Usage: OMP_NUM_THREADS=1 python benchmarks/host_step.py [--seqs 256] [--logprobs K] [--steps 100]
       [--rounds 5] [--profile]
"""
import argparse
import cProfile
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


def stubbed_engine(num_seqs: int) -> LLMEngine:
    """The tiny model's engine on the CPU for num_seqs rows, its forward and logits zeros."""
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"scheduler.max_num_seqs={num_seqs}", "scheduler.max_num_batched_tokens=65536",
                                           "job=bench", "model.device=cpu", "cache.num_blocks=20000"])
    engine = LLMEngine(engine_config_of(cfg))  # the plain dataclasses a job hands the engine, not omegaconf's
    torch.set_num_threads(1)
    hidden = engine.model.arch.hidden_size
    engine.runner.forward = lambda ids, pos, meta: torch.zeros(ids.shape[0], hidden)
    engine.model.compute_logits = lambda h: torch.zeros(h.shape[0], STUB_VOCAB)
    return engine


def timed(engine: LLMEngine, steps: int) -> float:
    """Seconds per step over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = stubbed_engine(args.seqs)
    max_tokens = (args.rounds + 2) * args.steps + 20  # no sequence finishes while timed
    for i in range(args.seqs):
        prompt = [(j * 7 + i) % 250 + 1 for j in range(PROMPT_LEN)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True,
                                                          logprobs=args.logprobs))
    for _ in range(10):  # the prefill, then decode steps
        engine.step()
    best = min(timed(engine, args.steps) for _ in range(args.rounds))
    print(f"{args.seqs} seqs, logprobs {args.logprobs}: {best * 1e3:.3f} ms/step "
          f"(best of {args.rounds} x {args.steps} steps)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(timed, engine, args.steps)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

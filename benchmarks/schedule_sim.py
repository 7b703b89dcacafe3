"""A bench workload's schedule on the CPU, its model stubbed out: the steps, preemptions, recomputed prompt
tokens and running sequences that a GPU run with the same pool and limits gets (the scheduler is the same code
and sees the same lengths; only the tokens differ, and ignore_eos makes them irrelevant). Seconds, not minutes,
to weigh a scheduling policy before a device call.
Usage: OMP_NUM_THREADS=1 python benchmarks/schedule_sim.py job.workload=long cache.num_blocks=72697 \\
       model.max_model_len=4096 scheduler.max_num_seqs=1024 [scheduler.admission_headroom=0 ...]
(72,697 blocks of 16: the Qwen3-0.6B shape's pool on an H200, from its run.log; max_model_len as conf/model/'s.)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_step import STUB_VOCAB, stub_engine  # noqa: E402

from jobs.bench import workload  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402


def main() -> None:
    engine, cfg = stub_engine(["scheduler.max_num_batched_tokens=16384", "scheduler.num_scheduler_steps=8",
                               *sys.argv[1:]])
    for i, (prompt, params) in enumerate(workload(cfg.job, SamplingParams(), STUB_VOCAB)):
        engine.add_request(str(i), prompt, params)
    list(engine.run())
    steps = engine.stats.steps
    print(f"{' '.join(sys.argv[1:])}: {len(steps)} device steps, {engine.scheduler.num_preemptions} preemptions, "
          f"{sum(s.num_prefill_tokens for s in steps)} prompt tokens computed, running sequences mean "
          f"{sum(s.seqs for s in steps) / len(steps):.0f}, max {max(s.seqs for s in steps)}")


if __name__ == "__main__":
    main()

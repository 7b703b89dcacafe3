"""A bench workload's schedule on the CPU, its model stubbed out: the steps, preemptions, recomputed prompt
tokens and running sequences that a GPU run with the same pool and limits gets (the scheduler is the same code
and sees the same lengths; only the tokens differ, and ignore_eos makes them irrelevant). Seconds, not minutes,
to weigh a scheduling policy before a device call.
Usage: OMP_NUM_THREADS=1 python benchmarks/schedule_sim.py job.workload=long cache.num_blocks=72697 \\
       model.max_model_len=4096 scheduler.max_num_seqs=1024 [scheduler.admission_headroom=0 ...]
(72,697 blocks of 16: the Qwen3-0.6B shape's pool on an H200, from its run.log; max_model_len as conf/model/'s.)
--cascade-groups=G: decode rows ordered by prefix as cascade attention orders them, and each step's sharing
groups found as CUDA's policy finds them with at most G a step (without its cost model: every group of >= 2 rows
sharing >= 1 block, on steps of >= CASCADE_MIN_ROWS rows); prints the rows in them on the full steps, and the
K/V tokens a layer of those steps reads.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_step import STUB_VOCAB, stub_engine  # noqa: E402

from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

from engine.prefix_groups import CASCADE_MIN_ROWS  # noqa: E402
from jobs.bench import workload  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402


def main() -> None:
    groups = [int(arg.split("=")[1]) for arg in sys.argv[1:] if arg.startswith("--cascade-groups=")]
    overrides = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    engine, cfg = stub_engine(["scheduler.max_num_batched_tokens=16384", "scheduler.num_scheduler_steps=8",
                               *(["cache.cascade_attention=on"] if groups else []), *overrides])
    layouts = []  # per decode layout (a run's first step): rows, K/V tokens its rows read plainly, and with groups
    if groups:
        engine.runner.cascade = replace(engine.runner.cascade, max_groups=groups[0], min_step_rows=CASCADE_MIN_ROWS)
        find = engine.runner._prefix_groups

        def recorded(tables: np.ndarray, seq_lens: np.ndarray):
            found, plain = find(tables, seq_lens), int(seq_lens.sum())
            saved = 0 if found is None else int(((np.diff(found.cu_group_rows) - 1) * found.group_prefix_lens).sum())
            layouts.append((len(seq_lens), plain, plain - saved))
            return found

        engine.runner._prefix_groups = recorded
    for i, (prompt, params) in enumerate(workload(cfg.job, SamplingParams(), STUB_VOCAB)):
        engine.add_request(str(i), prompt, params)
    list(engine.run())
    steps = engine.stats.steps
    print(f"{' '.join(sys.argv[1:])}: {len(steps)} device steps, {engine.scheduler.num_preemptions} preemptions, "
          f"{sum(s.num_prefill_tokens for s in steps)} prompt tokens computed, running sequences mean "
          f"{sum(s.seqs for s in steps) / len(steps):.0f}, max {max(s.seqs for s in steps)}")
    if groups:
        full = [s for s in steps if s.num_decode_seqs > 3 * engine.scheduler.max_num_seqs // 4]
        print(f"cascade: {len(full)} steps of more than 3/4 of max_num_seqs decode rows: "
              f"{sum(s.seqs for s in full) / len(full):.0f} rows, {sum(s.cascade_rows for s in full) / len(full):.0f} "
              "in sharing groups on average")
        full = [(plain, grouped) for rows, plain, grouped in layouts if rows > 3 * engine.scheduler.max_num_seqs // 4]
        print(f"K/V tokens a layer of such a step reads: {sum(p for p, _ in full) / len(full):.0f} plainly, "
              f"{sum(g for _, g in full) / len(full):.0f} with each group's prefix once")


if __name__ == "__main__":
    main()

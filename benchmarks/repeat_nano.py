"""First-use costs: the nano workload three times over in one engine.

A cost paid the first time a shape or a kernel occurs (cuBLAS choosing a kernel for a new matmul shape,
a CUDA graph's first replay, pinned buffers of a new size) shows as a first round slower than the
next two, and as decode steps far above their neighbours ("spikes": over 1.6x the median of the 11
steps around them). The engine's warm-up is meant to leave nothing of the kind for round 0.
Usage: python3 benchmarks/repeat_nano.py
"""
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.profile_decode import bench_engine  # noqa: E402
from engine.generation_config import resolve_sampling  # noqa: E402
from jobs.bench import workload  # noqa: E402

engine = bench_engine("job.workload=nano")
cfg = engine.cfg
with torch.inference_mode():
    for round_ in range(3):
        for i, (p, s) in enumerate(workload(cfg.job, resolve_sampling(cfg.sampling, engine.generation_config),
                                                 engine.model.arch.vocab_size)):
            engine.add_request(f"{round_}-{i}", p, s)
        engine.stats.restart_clock()
        start = time.perf_counter()
        out = sum(len(s.output_token_ids) for s in engine.run())
        wall = time.perf_counter() - start
        rows = [dataclasses.asdict(step) for step in engine.stats.steps]
        t = np.array([r["step_time_s"] for r in rows if r["phase"] == "decode"]) * 1e3
        med = np.array([np.median(t[max(0, i - 5):i + 6]) for i in range(len(t))])
        pre = sum(r["step_time_s"] for r in rows if r["phase"] == "prefill")
        print(f"round {round_}: {out / wall:.0f} tok/s, {wall:.3f} s, prefill {pre:.3f} s, decode {t.sum() / 1e3:.3f} s, "
              f"spikes {(t > 1.6 * med).sum()} ({(t - med)[t > 1.6 * med].sum():.0f} ms over the local median)", flush=True)
        engine.stats = type(engine.stats)()

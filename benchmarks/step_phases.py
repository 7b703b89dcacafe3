"""Where a job's steps go on the host, one step at a time, without profilers: python3 benchmarks/step_phases.py
[--every] OVERRIDES... (engine.run's overrides, e.g. job=bench job.workload=rollout model=qwen3-0.6b).

Runs engine.run with timers around the scheduler, the launch, the wait for the step before's tokens and the
resolve (which includes that wait), and the garbage collector's callbacks; prints, per engine.step() after the
warm-up (the CPU has none: from the first), its phase, decode rows, lap (steps.parquet's step time: of a
decode run, one device step's share), those host ms, and the collector's pauses (all generations, and the
full collections alone); then the totals. First, the ms from the warm-up's end to the first step (the job's
set-up, engine start-up's last collection, the intake before the first step) with what add_request and the
collector took of them. Prints the first 16 steps and those with a lap over 60 ms or a pause over 3 ms
(--every: all). A step whose launch is much longer than its host work waited inside it for the device.
On CUDA two more columns come from events recorded at each launch's start and end: the device's ms inside
the step's launches (its kernels, and its idle time while the host launched), and its ms from the step's last
launch end to the next step's first launch start (work enqueued outside the launches, or the device idle while
the host resolved and scheduled: a launch held up until the device drained leaves that gap after it)."""
import gc
import runpy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine.engine as engine_module  # noqa: E402
import engine.model_runner as runner_module  # noqa: E402
import engine.scheduler as scheduler_module  # noqa: E402
from benchmarks.profile_decode import timed  # noqa: E402

PHASES = ("schedule", "launch", "wait", "resolve", "gc", "full gc", "add")
current = dict.fromkeys(PHASES, 0.0)
rows: list[tuple] = []
marks = {"warm": not torch.cuda.is_available(), "warm_end": time.perf_counter(), "first": None, "gc": 0.0}
launch_events: list[tuple] = []  # (start, end) CUDA events of the current step's launches


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        marks["gc"] = time.perf_counter()
        return
    pause = time.perf_counter() - marks["gc"]
    current["gc"] += pause
    if info["generation"] == 2:
        current["full gc"] += pause


def record_launch_events() -> None:
    """ModelRunner.launch between two CUDA events (on the class: every instance's calls)."""
    launch = runner_module.ModelRunner.launch

    def between_events(self, *args, **kwargs):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return launch(self, *args, **kwargs)
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            launch_events.append((start, end))

    runner_module.ModelRunner.launch = between_events


def install() -> None:
    timed(scheduler_module.Scheduler, "schedule", current, "schedule")  # on the classes: every instance's calls
    if torch.cuda.is_available():
        record_launch_events()
    timed(runner_module.ModelRunner, "launch", current, "launch")
    timed(engine_module.LLMEngine, "_tokens", current, "wait")
    timed(engine_module.LLMEngine, "_resolve", current, "resolve")
    timed(engine_module.LLMEngine, "add_request", current, "add")
    gc.callbacks.append(on_gc)
    step, warm_up = engine_module.LLMEngine.step, engine_module.LLMEngine._warm_up

    def warm_up_then_mark(self, *args, **kwargs):
        warm_up(self, *args, **kwargs)
        marks["warm"], marks["warm_end"] = True, time.perf_counter()
        current.update(dict.fromkeys(PHASES, 0.0))

    def step_recorded(self):
        if marks["warm"] and marks["first"] is None:
            marks["first"] = time.perf_counter()
            print(f"warm-up's end to the first step: {1e3 * (marks['first'] - marks['warm_end']):.1f} ms, of which "
                  f"add_request {1e3 * current['add']:.1f} ms and collections {1e3 * current['gc']:.1f} ms")
            current.update(dict.fromkeys(PHASES, 0.0))
        launch_events.clear()
        finished = step(self)
        if marks["warm"] and self.stats.steps:
            last = self.stats.steps[-1]
            rows.append((last.phase, last.num_decode_seqs, last.step_time_s * 1e3,
                         *(current[p] * 1e3 for p in PHASES), list(launch_events)))
        current.update(dict.fromkeys(PHASES, 0.0))
        return finished

    engine_module.LLMEngine.step, engine_module.LLMEngine._warm_up = step_recorded, warm_up_then_mark


def device_ms(events: list[tuple], next_events: list[tuple]) -> tuple[str, str]:
    """(device ms inside a step's launches, device ms from their end to the next step's first launch), "-"
    where the step launched nothing or nothing came after it."""
    if not events:
        return "-", "-"
    inside = f"{sum(start.elapsed_time(end) for start, end in events):.1f}"
    return inside, f"{events[-1][1].elapsed_time(next_events[0][0]):.1f}" if next_events else "-"


def report(every: bool) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print("step phase decode_rows lap_ms " + " ".join(p.replace(" ", "_") for p in PHASES)
          + " device_launch_ms device_after_ms")
    for i, (phase, decode_rows, lap, *ms, events) in enumerate(rows):
        if every or i < 16 or lap > 60 or ms[4] > 3:
            later = next((r[-1] for r in rows[i + 1:] if r[-1]), [])
            print(i, phase, decode_rows, f"{lap:.1f}", *(f"{v:.1f}" for v in ms), *device_ms(events, later))
    totals = [sum(r[j] for r in rows) for j in range(2, 3 + len(PHASES))]
    print("totals, ms: " + ", ".join(f"{name} {value:.0f}" for name, value in zip(("lap", *PHASES), totals)))


if __name__ == "__main__":
    args = sys.argv[1:]
    every = "--every" in args
    install()
    sys.argv = ["engine.run", *(a for a in args if a != "--every")]
    try:
        runpy.run_module("engine.run", run_name="__main__")
    finally:
        report(every)

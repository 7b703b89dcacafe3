"""Where start-up goes (engine/startup.py): the engine's phases add up to its construction, and a job's
start-up columns add up to the process's age at its first step, which is no more than the process's whole
wall time measured from outside it."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import startup
from engine.engine import SCHEDULER_DEFAULTS, LLMEngine
from engine.startup import Laps, process_age_s
from jobs import generate
from jobs.generate import generate_job

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PHASES = ["model", "tokenizer", "kv_pool", "graphs", "warm_up"]
needs_proc = pytest.mark.skipif(process_age_s() is None, reason="the process's age is read from Linux's /proc")


def test_laps_are_the_times_between_them(monkeypatch):
    clock = iter([10.0, 10.5, 12.0, 12.25, 13.0])
    monkeypatch.setattr(startup.time, "perf_counter", lambda: next(clock))
    laps = Laps()
    for name in ("a", "b", "a", "c"):
        laps.lap(name)
    assert laps.phases == {"a": 0.5 + 0.25, "b": 1.5, "c": 0.75}


@needs_proc
def test_the_process_age_counts_from_the_process_start():
    """A child that sleeps 0.5 s before reading its age: at least that, at most its wall time seen from here."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); from engine.startup import "
                          "process_age_s; print(process_age_s())"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    wall = time.perf_counter() - start
    assert 0.5 <= float(out) <= wall + 0.01  # the age is read to the clock tick, 10 ms


def test_the_engine_phases_add_up_to_its_construction(make_config):
    before = process_age_s()
    start = time.perf_counter()
    engine = LLMEngine(make_config("model.device=cpu"))
    outside = time.perf_counter() - start
    after = process_age_s()
    assert list(engine.startup_s) == ["before_engine"] + ENGINE_PHASES
    phases = [engine.startup_s[name] for name in ENGINE_PHASES]
    assert all(p >= 0 for p in phases) and sum(phases) <= outside
    if before is not None:
        assert before - 0.01 <= engine.startup_s["before_engine"] <= after + 0.01


@pytest.mark.parametrize("max_num_seqs", [20, 1, 600])
def test_the_warm_up_decodes_once_at_each_graph_bucket_and_the_size_below(make_config, monkeypatch, max_num_seqs):
    """The warm-up's steps, recorded as the scheduler hands them out: one prefill step of every request, then
    one decode step at each decode graph bucket (1, 2, 4, 8, the multiples of 16 up to 512 and of 64 above,
    below max_num_seqs, and max_num_seqs itself) and at the size below each, largest first."""
    engine = LLMEngine(make_config("model.device=cpu", f"scheduler.max_num_seqs={max_num_seqs}"))
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append((batch.num_prefill_tokens > 0, len(batch.seqs)))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    engine._warm_up()
    buckets = [b for b in [1, 2, 4, 8, *range(16, 513, 16), *range(576, 2048, 64)] if b < max_num_seqs] + [max_num_seqs]
    sizes = sorted({s for b in buckets for s in (b, b - 1)} - {0}, reverse=True)
    assert steps[0] == (True, max_num_seqs)
    assert [n for prefill, n in steps[1:] if n] == sizes and not any(prefill for prefill, _ in steps[1:])


@needs_proc
def test_a_jobs_start_up_columns_add_up_to_its_age_at_the_first_step(tmp_path):
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "engine.run", "job=bench", "model.device=cpu", "job.num_prompts=4",
                    "job.input_len=[4,8]", "job.output_len=[2,4]", f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                   capture_output=True, text=True, check=True, timeout=600)
    wall = time.perf_counter() - start
    summary = pq.read_table(tmp_path / "summary.parquet").to_pylist()[0]
    parts = [summary[f"startup_{name}_s"] for name in ["before_engine"] + ENGINE_PHASES + ["after_engine"]]
    assert all(p >= 0 for p in parts)
    assert summary["startup_s"] == pytest.approx(sum(parts), abs=1e-9)
    assert summary["startup_s"] + summary["wall_time_s"] <= wall + 0.01
    log = (tmp_path / "run.log").read_text()
    assert f"start-up {summary['startup_s']:.1f} s before the first step: before engine " in log


@pytest.mark.parametrize("rows, n_column", [(3, False), (40, False), (3, True)])
def test_a_job_builds_its_engine_for_the_sequences_its_rows_run(make_config, monkeypatch, tmp_path, rows, n_column):
    """A generate job of `rows` rows at sampling.n=2 caps max_num_seqs (the decode graphs' and the warm-up's
    batch sizes) at rows x 2 when that is below the device's default, unless a row may set its own n; its
    sampled outputs are those of the engine without the cap (a draw depends only on its seed and logits)."""
    table = {"prompt": [f"prompt {i} " * (i % 5 + 1) for i in range(rows)]}
    if n_column:
        table["n"] = [None] * rows
    pq.write_table(pa.table(table), tmp_path / "in.parquet")

    def job(name: str) -> tuple[list, dict]:
        cfg = make_config(f"job.input={tmp_path / 'in.parquet'}", "model.device=cpu", "model.max_model_len=128",
                          "sampling.max_tokens=6", "sampling.n=2", "sampling.temperature=1.0", "sampling.seed=5")
        (tmp_path / name).mkdir()
        generate_job(cfg, tmp_path / name)
        summary = pq.read_table(tmp_path / name / "summary.parquet").to_pylist()[0]
        return pq.read_table(tmp_path / name / "generations.parquet").to_pylist(), summary

    capped, summary = job("capped")
    default = SCHEDULER_DEFAULTS["cpu"][0]
    assert summary["max_num_seqs"] == (default if n_column else min(default, 2 * rows))
    monkeypatch.setattr(generate.GenerateProcessor, "max_sequences", lambda self, num_rows: None)
    uncapped, summary = job("uncapped")
    assert summary["max_num_seqs"] == default
    assert [r["output_token_ids"] for r in capped] == [r["output_token_ids"] for r in uncapped]


def test_building_a_model_imports_neither_dynamo_nor_sympy():
    """build_model lays the model out on the meta device without running torch's Python references there
    (init functions, empty_like), whose first calls import torch._dynamo and sympy: seconds of a job's
    start-up. A fresh interpreter builds the tiny model and lists what it imported; torch.nn.init's
    functions are torch's own again afterwards."""
    code = ("import sys, torch\nfrom engine.config import engine_config\nfrom engine.models.loader import build_model\n"
            "build_model(engine_config('tiny').model, torch.device('cpu'), torch.float32)\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
            "print(torch.nn.init.normal_.__module__, torch.nn.init.kaiming_uniform_.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=300).stdout.splitlines()
    assert out == ["[]", "torch.nn.init torch.nn.init"]

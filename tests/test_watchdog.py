"""The step watchdog (engine/watchdog.py): a step whose tokens do not come back in time stops the run, names
the step, keeps the finished rows and saves the step's inputs so that its draw can be replayed.

A stall is made through the probe the watchdog polls, InFlight.done (the test hook): it answers "not yet"
for one chosen step, as a device kernel that never ends would. On the CPU the step has in fact run, so
its tokens are known: the saved inputs must replay to exactly those.
"""
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.engine import LLMEngine
from engine.model_runner import InFlight
from engine.sequence import SamplingParams
from engine.watchdog import SLOWEST_STEP_FACTOR, StepTimeout, replay_sampler, step_deadline_s, wait_until
from jobs.generate import generate_job


def stall_at(monkeypatch, step: int) -> dict:
    """Make step `step` never finish, as far as the watchdog can tell; the returned dict gets its InFlight."""
    held = {}
    finished = InFlight.done

    def done(self):
        if self.inputs.step == step:
            held["step"] = self
            return False
        return finished(self)

    monkeypatch.setattr(InFlight, "done", done)
    return held


def test_the_deadline_is_the_timeout_or_a_multiple_of_the_slowest_step():
    assert step_deadline_s(60.0, 0.5) == 60.0
    assert step_deadline_s(60.0, 4.0) == SLOWEST_STEP_FACTOR * 4.0
    assert step_deadline_s(None, 100.0) is None


def test_waiting_ends_when_the_probe_says_so_or_the_deadline_passes():
    answers = iter([False, False, True])
    assert wait_until(lambda: next(answers), 30.0)
    assert not wait_until(lambda: False, 0.05)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_stalled_step_stops_the_engine_and_its_inputs_replay_its_draw(make_config, tmp_path, monkeypatch, top_p):
    engine = LLMEngine(make_config("model.device=cpu", "scheduler.step_timeout_s=0.2"), tmp_path)
    held = stall_at(monkeypatch, 4)
    for i in range(3):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4], SamplingParams(temperature=0.8, top_p=top_p, max_tokens=20, seed=i))
    with pytest.raises(StepTimeout) as failure:
        list(engine.run())
    path = tmp_path / "stalled-step-4.pt"
    assert re.fullmatch(r"step 4 \(decode, 3 rows: requests r0, r1, r2\) did not finish within ([0-9.]+) s "
                        r"\(scheduler.step_timeout_s, or 20x the slowest step so far if more\); its logits and "
                        r"sampling parameters and its batch's metadata are saved in " + re.escape(str(path)),
                        str(failure.value))
    slowest = max(s.step_time_s for s in engine.stats.steps[:4])
    assert float(re.search(r"within ([0-9.]+) s", str(failure.value))[1]) == pytest.approx(max(0.2, 20 * slowest), rel=1e-2)
    record = torch.load(path, weights_only=True)
    assert (record["step"], record["phase"], record["request_ids"]) == (4, "decode", ["r0", "r1", "r2"])
    assert record["starts"].tolist() == [4 + 3] * 3 and record["counts"].tolist() == [1, 1, 1]
    assert record["logits"].shape == (3, engine.model.arch.vocab_size)
    assert replay_sampler(path).tolist() == held["step"].host_tokens.tolist()


def test_a_stalled_job_keeps_its_finished_rows(make_config, tmp_path, monkeypatch):
    """Requests of 2, 4, ... 12 output tokens; step 6 stalls: the rows that finished before are saved, each
    as the same job without a stall writes it."""
    prompts = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(6)], "max_tokens": [2 * (i + 1) for i in range(6)]}),
                   prompts)
    overrides = [f"job.input={prompts}", "model.device=cpu", "job.flush_every=1", "sampling.temperature=0.7"]
    for run in ("whole", "stalled"):  # Hydra makes a run's directory
        (tmp_path / run).mkdir()
    generate_job(make_config(*overrides), tmp_path / "whole")
    whole = pq.read_table(tmp_path / "whole" / "generations.parquet").to_pylist()
    stall_at(monkeypatch, 6)
    with pytest.raises(StepTimeout, match=r"^step 6 \(decode, \d rows: requests "):
        generate_job(make_config(*overrides, "scheduler.step_timeout_s=0.2"), tmp_path / "stalled")
    saved = pq.read_table(tmp_path / "stalled" / "generations.parts").to_pylist()
    assert 1 <= len(saved) < 6
    for row in saved:
        assert row["output_token_ids"] == whole[row["row"]]["output_token_ids"]
    assert (tmp_path / "stalled" / "stalled-step-6.pt").exists()


HUNG_KERNEL_SCRIPT = r'''
import sys, time
import torch, triton, triton.language as tl
from triton.language.extra.cuda import globaltimer
from engine import model_runner
from engine.llm import LLM
from engine.sequence import SamplingParams
from engine.watchdog import StepTimeout


@triton.jit
def spin(flag_ptr, limit_ns):
    """Spins until *flag_ptr is set or limit_ns have passed (bounded, so that a failed test frees the GPU)."""
    start = globaltimer()
    now = start
    while (tl.load(flag_ptr, volatile=True) == 0) & (now - start < limit_ns):
        now = globaltimer()


llm = LLM(model="tiny", device="cuda", step_timeout_s=2.0, num_blocks=256)
flag = torch.zeros(1, dtype=torch.int32, device="cuda")
draw, calls = model_runner.draw, []


def hanging_draw(*args, **kwargs):
    calls.append(1)
    if len(calls) == 5:
        spin[(1,)](flag, 60 * 10**9)
    return draw(*args, **kwargs)


model_runner.draw = hanging_draw
start = time.perf_counter()
try:
    llm.generate(["a", "b"], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30))
except StepTimeout as err:
    print(f"stopped after {time.perf_counter() - start:.1f} s: {err}", flush=True)
    sys.exit(3)
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a kernel that does not end needs the GPU")
def test_a_kernel_that_does_not_end_stops_the_run_and_the_process_exits(tmp_path):
    """A real kernel spinning in step 5's sampling: the Python API raises StepTimeout after the 2 s deadline,
    and the process exits long before the kernel's own 60 s limit (a kill of the context, not a wait)."""
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    script = tmp_path / "hung_kernel.py"  # Triton compiles @jit functions from their source file
    script.write_text(HUNG_KERNEL_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)
    elapsed = time.perf_counter() - start
    print(done.stdout, done.stderr[-2000:], f"exited after {elapsed:.1f} s")
    assert done.returncode == 3 and "did not finish within" in done.stdout
    assert elapsed < 50, "the process waited for the kernel to end"

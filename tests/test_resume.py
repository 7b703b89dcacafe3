"""Crash safety: rows are saved in parts as they finish; a job killed at any moment (SIGKILL included) and
started again with the same hydra.run.dir computes only the rows not saved yet; SIGINT and SIGTERM save
what finished and stop; generations.parquet has every id exactly once and is written atomically."""
import json
import os
import re
import shutil
import signal
import threading
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import JobError
from jobs.generate import generate_job
from jobs.results import ResultWriter, generations_schema, model_fingerprint

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}  # one thread: the tiny model gains nothing from more
NUM_ROWS = 120
FINGERPRINT = [["in.parquet", 10, "aa"]]


def row(i, text="out"):
    return {"row": i, "sample_index": 0, "prompt": f"p{i}", "output_text": text, "output_token_ids": [1, 2], "finish_reason": "length",
            "prompt_tokens": 2, "output_tokens": 2, "error": None}


def id_batches(ids, size):
    """The input's id column, as finalize reads it: record batches of `size` rows."""
    table = pa.table({"id": ids})
    return iter(table.to_batches(max_chunksize=size))


def finalize(writer, tmp_path, ids, size=2):
    writer.finalize(id_batches(ids, size), tmp_path / "generations.parquet", generations_schema(pa.string()))
    return pq.read_table(tmp_path / "generations.parquet")


# -- ResultWriter ----------------------------------------------------------------------------------
def test_parts_are_flushed_in_batches_and_read_back_on_restart(make_config, tmp_path):
    cfg = make_config()
    writer = ResultWriter(tmp_path, 7, cfg, FINGERPRINT, flush_every=3)
    assert not writer.parts_dir.exists()  # nothing written yet: no folder
    for i in (4, 0, 5, 2, 1, 3, 6):  # rows finish out of input order
        writer.add(row(i))
    assert [pq.read_table(p).num_rows for p in writer.parts] == [3, 3] and len(writer.buffer) == 1
    # killed here: row 6 was never flushed, and a part being written left its temporary file behind
    tmp = writer.parts_dir / ".part-000002.parquet.123-abcd.tmp"
    tmp.write_bytes(b"PAR1 half a parquet file")
    again = ResultWriter(tmp_path, 7, cfg, FINGERPRINT, flush_every=3)
    assert again.resumed == 6 and list(np.flatnonzero(again.saved < 0)) == [6] and not tmp.exists()
    again.add(row(6)), again.add(row(3, "written twice"))
    ids = ["g", "f", "e", "d", "c", "b", "a"]
    table = finalize(again, tmp_path, ids)
    assert table["id"].to_pylist() == ids and table["prompt"].to_pylist() == [f"p{i}" for i in range(7)]  # input order
    assert table["output_text"].to_pylist()[3] == "out"  # the first row written wins
    assert sorted(p.name for p in again.parts_dir.iterdir()) == [f"part-00000{n}.parquet" for n in range(3)]
    assert not list(tmp_path.glob(".*.tmp"))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_finalize_puts_rows_in_input_order_from_parts_of_any_shape(tmp_path_factory, data):
    """Rows finishing in any order, flushed in parts of any size and read back in batches of any size
    (so that parts span batches and stragglers sit far from their neighbours): the input order."""
    num_rows = data.draw(st.integers(0, 60))
    order = data.draw(st.permutations(range(num_rows)))
    directory = tmp_path_factory.mktemp("w")
    writer = ResultWriter(directory, num_rows, None, FINGERPRINT, flush_every=data.draw(st.integers(1, 9)))
    for i in order:
        writer.add(row(i, text=f"out{i}"))
    table = finalize(writer, directory, [f"id{i}" for i in range(num_rows)], size=data.draw(st.integers(1, 20)))
    assert table["output_text"].to_pylist() == [f"out{i}" for i in range(num_rows)]
    assert table["id"].to_pylist() == [f"id{i}" for i in range(num_rows)]


def test_slow_rows_are_flushed_after_flush_interval_s(make_config, tmp_path):
    writer = ResultWriter(tmp_path, 2, make_config(), flush_every=1000, flush_interval_s=0.05)
    writer.add(row(0))
    assert not writer.parts
    time.sleep(0.06)
    writer.add(row(1))  # the oldest unsaved row is older than flush_interval_s: both are saved
    assert len(writer.parts) == 1 and not writer.buffer


@pytest.mark.parametrize("receiver", ["this thread", "another thread"])
def test_an_interrupt_during_a_flush_saves_each_row_once(make_config, tmp_path, monkeypatch, receiver):
    """SIGINT arriving while a part is written (the generate job then saves what is buffered and stops),
    taken by the thread that writes or by another one (a process has threads of Ray, pyarrow, torch:
    the kernel hands a process's signal to any thread that does not block it)."""
    import jobs.results

    write = jobs.results.write_atomic
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()

    def write_then_interrupt(*args, **kwargs):
        write(*args, **kwargs)  # the part is on disk, the buffer not yet cleared
        # The kernel runs a signal's C handler in the receiving thread when that thread next runs, and Python
        # its handler in the main thread after that: wait until the handler in place (the writer's) has taken
        # it, or the interrupt could land after the flush (2 runs of 15 on a 2-core machine, and once in CI).
        in_place, taken = signal.getsignal(signal.SIGINT), threading.Event()
        signal.signal(signal.SIGINT, lambda signum, frame: (taken.set(), in_place(signum, frame)))
        if receiver == "this thread":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            signal.pthread_kill(other.ident, signal.SIGINT)
        while not taken.is_set():
            time.sleep(0.001)
        signal.signal(signal.SIGINT, in_place)

    monkeypatch.setattr(jobs.results, "write_atomic", write_then_interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    writer = ResultWriter(tmp_path, 4, make_config(), flush_every=2)
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.add(row(0)), writer.add(row(1))
        monkeypatch.setattr(jobs.results, "write_atomic", write)
        writer.add(row(2))
        writer.flush()  # the job's save on the way out
    finally:
        signal.signal(signal.SIGINT, previous)
        idle.set()
    # the interrupted flush finished its bookkeeping: the save wrote only row 2, as the next part
    assert [(p.name, pq.read_table(p)["row"].to_pylist()) for p in writer.parts] == [
        ("part-000000.parquet", [0, 1]), ("part-000001.parquet", [2])]


def test_a_new_part_never_overwrites_an_old_one(make_config, tmp_path):
    cfg = make_config()
    writer = ResultWriter(tmp_path, 3, cfg, flush_every=1)
    writer.add(row(0)), writer.add(row(1))
    (writer.parts_dir / "part-000000.parquet").unlink()  # a gap in the numbering
    again = ResultWriter(tmp_path, 3, cfg, flush_every=1)
    again.add(row(2))
    assert [p.name for p in again.parts] == ["part-000001.parquet", "part-000002.parquet"]


def test_finalize_needs_a_row_for_every_input_row(make_config, tmp_path):
    writer = ResultWriter(tmp_path, 2, make_config(), flush_every=10)
    writer.add(row(0))
    with pytest.raises(JobError, match=r"no result for 1 rows, e.g. input rows \[1\]"):
        finalize(writer, tmp_path, ["a", "b"])
    assert not (tmp_path / "generations.parquet").exists() and not list(tmp_path.glob(".*.tmp"))


def test_resuming_with_other_settings_or_another_input_is_refused(make_config, tmp_path):
    writer = ResultWriter(tmp_path, 4, make_config("sampling.max_tokens=8"), FINGERPRINT, flush_every=1)
    writer.add(row(0))
    with pytest.raises(JobError, match=r"holds rows generated with other settings \(sampling.max_tokens: 8 -> 9\)"):
        ResultWriter(tmp_path, 4, make_config("sampling.max_tokens=9"), FINGERPRINT)
    with pytest.raises(JobError, match=r"job.input: in.parquet changed \(same size, other bytes\) since the rows"):
        ResultWriter(tmp_path, 4, make_config("sampling.max_tokens=8"), [["in.parquet", 10, "bb"]])
    with pytest.raises(JobError, match=r"job.input: in.parquet changed \(10 -> 11 bytes\)"):
        ResultWriter(tmp_path, 4, make_config("sampling.max_tokens=8"), [["in.parquet", 11, "aa"]])
    with pytest.raises(JobError, match=r"job.input: more.parquet is new"):
        ResultWriter(tmp_path, 4, make_config("sampling.max_tokens=8"), FINGERPRINT + [["more.parquet", 1, "cc"]])
    # the pool and the batching do not change what a row's output is: resuming with a smaller pool is fine
    ResultWriter(tmp_path, 4, make_config("sampling.max_tokens=8", "cache.num_blocks=40", "scheduler.max_num_seqs=2",
                                          "model.device=cpu"), FINGERPRINT)


def test_resuming_with_the_same_files_by_other_paths_or_other_execution_settings_is_accepted(make_config, tmp_path,
                                                                                           monkeypatch):
    """A relative path and the absolute one of the same file are one input; threads, eager steps and piecewise
    graphs change how the steps run, not what a row is; another file, or another sampling value, is refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.parquet").write_bytes(b"x")
    (tmp_path / "other.parquet").write_bytes(b"y")
    run_dir = tmp_path / "run"
    writer = ResultWriter(run_dir, 4, make_config("job.input=in.parquet"), FINGERPRINT, flush_every=1)
    writer.add(row(0))
    resumed = ResultWriter(run_dir, 4, make_config(f"job.input={tmp_path / 'in.parquet'}", "model.cpu_threads=2",
                                                   "model.enforce_eager=true", "model.piecewise_graphs=false"),
                           FINGERPRINT)
    assert resumed.resumed == 1
    with pytest.raises(JobError, match=r"other settings \(job.input: '.*in.parquet' -> '.*other.parquet'\)"):
        ResultWriter(run_dir, 4, make_config("job.input=other.parquet"), FINGERPRINT)
    with pytest.raises(JobError, match=r"other settings \(model.max_model_len: None -> 1024\)"):
        ResultWriter(run_dir, 4, make_config("job.input=in.parquet", "model.max_model_len=1024"), FINGERPRINT)


def test_a_job_resumes_from_its_input_by_a_relative_or_an_absolute_path(make_config, tmp_path, monkeypatch,
                                                                        one_thread):
    """The input's fingerprint names each file as the file it is: the same input by the other kind of path resumes
    (nothing left to compute: the parts stay as they were)."""
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), tmp_path / "in.parquet")
    run = tmp_path / "run"
    run.mkdir()
    options = ("model.device=cpu", "sampling.max_tokens=2", "sampling.ignore_eos=true")
    generate_job(make_config("job.input=in.parquet", *options), run)
    before = {p.name: p.read_bytes() for p in (run / "generations.parts").iterdir()}
    generate_job(make_config(f"job.input={tmp_path / 'in.parquet'}", *options), run)
    generate_job(make_config("job.input=./in.parquet", *options), run)
    assert {p.name: p.read_bytes() for p in (run / "generations.parts").iterdir()} == before


KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from jobs.parquet import atomic_path

with atomic_path(Path(sys.argv[1])) as tmp:
    tmp.write_bytes(b"PAR1 the first half of the final file")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_temporary_file_left_by_a_kill_is_removed_by_the_next_run(make_config, tmp_path):
    """A job killed while it wrote its final file left the temporary file in the run directory for good (only
    the parts' were removed): the next run there, which holds the directory's lock, removes it; a file of
    that kind of name but not of ours stays."""
    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "in.parquet")
    run = tmp_path / "run"
    run.mkdir()
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(run / "generations.parquet")], cwd=ROOT,
                            capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    [left] = run.glob(".generations.parquet.*.tmp")
    (run / ".notes.tmp").write_text("the user's")
    generate_job(make_config(f"job.input={tmp_path / 'in.parquet'}", "model.device=cpu", "sampling.max_tokens=2"), run)
    assert not left.exists() and (run / ".notes.tmp").exists()
    assert pq.read_table(run / "generations.parquet").num_rows == 2


def test_model_dtype_compares_as_it_takes_effect(make_config, tmp_path):
    """auto is float32 on the CPU: a resume that sets float32 computes the same rows (it was refused: "other
    settings (model.dtype: 'auto' -> 'float32')"), as one that keeps auto does; another dtype is refused, named
    as it takes effect."""
    auto = make_config("model.device=cpu")
    writer = ResultWriter(tmp_path, 4, auto, FINGERPRINT, flush_every=1, model=model_fingerprint(auto))
    writer.add(row(0))
    for same in (make_config("model.device=cpu", "model.dtype=float32"), auto):
        assert ResultWriter(tmp_path, 4, same, FINGERPRINT, model=model_fingerprint(same)).resumed == 1
    other = make_config("model.device=cpu", "model.dtype=bfloat16")
    with pytest.raises(JobError, match=r"^the model's dtype in effect changed \(model.dtype: float32 -> bfloat16\) "
                                       r"since the rows in"):
        ResultWriter(tmp_path, 4, other, FINGERPRINT, model=model_fingerprint(other))


def test_top_k_off_by_either_spelling_is_no_change(make_config, tmp_path):
    """-1 and 0 both turn top_k off: a resume that spells it the other way computes the same rows."""
    first, other = make_config(), make_config("sampling.top_k=0")
    writer = ResultWriter(tmp_path, 4, first, FINGERPRINT, flush_every=1, model=model_fingerprint(first))
    writer.add(row(0))
    assert ResultWriter(tmp_path, 4, other, FINGERPRINT, model=model_fingerprint(other)).resumed == 1
    on = make_config("sampling.top_k=5")
    with pytest.raises(JobError, match=r"the sampling values in effect changed \(top_k: -1 -> 5\)"):
        ResultWriter(tmp_path, 4, on, FINGERPRINT, model=model_fingerprint(on))


def test_resuming_after_the_checkpoint_changed_is_refused(make_config, qwen3_checkpoint, tmp_path):
    """generation_config.json's defaults (the sampling values in effect), the tokenizer's files and the
    weights (size and mtime) are part of what the parts were made with; the sampling.* keys are unchanged."""
    source, _ = qwen3_checkpoint
    checkpoint, run = tmp_path / "ckpt", tmp_path / "run"
    shutil.copytree(source, checkpoint)
    cfg = make_config(f"model.path={checkpoint}")
    writer = ResultWriter(run, 4, cfg, FINGERPRINT, flush_every=1, model=model_fingerprint(cfg))
    writer.add(row(0))
    assert ResultWriter(run, 4, cfg, FINGERPRINT, model=model_fingerprint(cfg)).resumed == 1  # nothing changed
    same = make_config(f"model.path={checkpoint}", "sampling.temperature=0.0")  # set to the value it took from the file
    assert ResultWriter(run, 4, same, FINGERPRINT, model=model_fingerprint(same)).resumed == 1
    other = make_config(f"model.path={checkpoint}", "sampling.temperature=0.5")
    with pytest.raises(JobError, match=r"^the sampling values in effect changed \(temperature: 0.0 -> 0.5\) since"):
        ResultWriter(run, 4, other, FINGERPRINT, model=model_fingerprint(other))

    generation = checkpoint / "generation_config.json"
    original = generation.read_text()
    generation.write_text(json.dumps({**json.loads(original), "temperature": 0.7}))
    with pytest.raises(JobError, match=rf"^the sampling values in effect changed \(temperature: 0.0 -> 0.7\); model.path's "
                                       rf"files changed \(generation_config.json: blake2b \w+ -> blake2b \w+\) since the "
                                       rf"rows in {run} were generated: resuming would mix rows of two configurations"):
        ResultWriter(run, 4, cfg, FINGERPRINT, model=model_fingerprint(cfg))
    generation.write_text(original)

    tokenizer = checkpoint / "tokenizer_config.json"
    tokenizer.write_text(json.dumps({**json.loads(tokenizer.read_text()), "chat_template": "{{ messages }}"}))
    with pytest.raises(JobError, match=r"^model.path's files changed \(tokenizer_config.json: blake2b \w+ -> blake2b \w+\)"):
        ResultWriter(run, 4, cfg, FINGERPRINT, model=model_fingerprint(cfg))
    shutil.copy(source / "tokenizer_config.json", tokenizer)

    weights = checkpoint / "model.safetensors"
    size, mtime = weights.stat().st_size, weights.stat().st_mtime_ns
    os.utime(weights, ns=(mtime + 10**9, mtime + 10**9))
    with pytest.raises(JobError, match=rf"^model.path's files changed \(model.safetensors: {size} bytes, mtime {mtime} -> "
                                       rf"{size} bytes, mtime {mtime + 10**9}\)"):
        ResultWriter(run, 4, cfg, FINGERPRINT, model=model_fingerprint(cfg))
    os.utime(weights, ns=(mtime, mtime))
    assert ResultWriter(run, 4, cfg, FINGERPRINT, model=model_fingerprint(cfg)).resumed == 1  # restored


def test_the_job_refuses_a_resume_after_generation_config_changed(make_config, qwen3_checkpoint, tmp_path, one_thread):
    source, _ = qwen3_checkpoint
    checkpoint, run = tmp_path / "ckpt", tmp_path / "run"
    shutil.copytree(source, checkpoint)
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), tmp_path / "in.parquet")
    cfg = make_config(f"job.input={tmp_path / 'in.parquet'}", f"model.path={checkpoint}", "model.device=cpu",
                      "model.max_model_len=64", "sampling.max_tokens=2", "sampling.ignore_eos=true")
    run.mkdir()
    generate_job(cfg, run)
    before = {p.name: p.read_bytes() for p in (run / "generations.parts").iterdir()}
    generation = checkpoint / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "top_k": 5}))
    with pytest.raises(JobError, match=r"the sampling values in effect changed \(top_k: -1 -> 5\)"):
        generate_job(cfg, run)
    assert {p.name: p.read_bytes() for p in (run / "generations.parts").iterdir()} == before


def test_an_unreadable_part_is_reported(make_config, tmp_path):
    writer = ResultWriter(tmp_path, 1, make_config(), flush_every=1)
    writer.add(row(0))
    writer.parts[0].write_bytes(b"not parquet")
    with pytest.raises(JobError, match=r"cannot read .*part-000000.parquet .*delete it to compute its rows again"):
        ResultWriter(tmp_path, 1, make_config())


# -- the job, killed and started again -------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(NUM_ROWS)],
                             "prompt": [f"prompt number {i} " * (1 + i % 4) for i in range(NUM_ROWS)]}), path)
    return path


def job_args(prompts, run_dir, max_tokens=12):
    return [sys.executable, "-m", "engine.run", f"job.input={prompts}", f"hydra.run.dir={run_dir}",
            "model.device=cpu", f"sampling.max_tokens={max_tokens}", "sampling.ignore_eos=true",
            "scheduler.max_num_seqs=4", "job.flush_every=8"]


def start(prompts, run_dir, max_tokens=12):
    return subprocess.Popen(job_args(prompts, run_dir, max_tokens), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_parts(run_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(list((run_dir / "generations.parts").glob("part-*.parquet"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no part appeared"
        time.sleep(0.01)


def saved(run_dir: Path) -> dict:
    """part file name -> its bytes"""
    return {p.name: p.read_bytes() for p in sorted((run_dir / "generations.parts").glob("part-*.parquet"))}


def saved_ids(parts: dict, run_dir: Path) -> list:
    """The input rows saved in these parts."""
    return [i for name in parts for i in pq.read_table(run_dir / "generations.parts" / name)["row"].to_pylist()]


def finish(prompts, run_dir, max_tokens=12):
    result = subprocess.run(job_args(prompts, run_dir, max_tokens), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def check_complete(run_dir: Path, reference: list[dict] | None = None, max_tokens: int = 12) -> list[dict]:
    rows = pq.read_table(run_dir / "generations.parquet").to_pylist()
    assert [r["id"] for r in rows] == [f"r{i:03d}" for i in range(NUM_ROWS)]  # every id exactly once, in order
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == max_tokens for r in rows)
    if reference is not None:
        assert rows == reference
    return rows


def test_sigkill_then_resume(prompts, tmp_path):
    straight = tmp_path / "straight"
    run_dir = tmp_path / "run"
    proc = start(prompts, run_dir)
    wait_for_parts(run_dir, 1, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    before = saved(run_dir)
    done = saved_ids(before, run_dir)
    assert 8 <= len(done) < NUM_ROWS and not (run_dir / "generations.parquet").exists()
    # a kill in the middle of writing a part leaves its temporary file: the next run ignores it
    (run_dir / "generations.parts" / f".part-{len(before):06d}.parquet.99-beef.tmp").write_bytes(b"PAR1 torn")

    log = finish(prompts, run_dir)
    assert f"resuming: {len(done)} of {NUM_ROWS} rows already written" in log
    after = saved(run_dir)
    assert all(after[name] == data for name, data in before.items())  # saved parts untouched
    ids = saved_ids(after, run_dir)
    assert len(ids) == len(set(ids)) == NUM_ROWS  # the rows saved before were not computed again
    assert not list((run_dir / "generations.parts").glob(".*.tmp"))
    summary = pq.read_table(run_dir / "summary.parquet").to_pylist()[0]
    assert summary["num_requests"] == NUM_ROWS - len(done) and summary["resumed_rows"] == len(done)
    steps = pq.read_table(run_dir / "steps.parquet")
    assert sum(steps["finished"].to_pylist()) == NUM_ROWS - len(done)  # this run's steps only

    # the same rows as a run that was never killed (greedy: the output depends on nothing else)
    assert finish(prompts, straight)
    check_complete(run_dir, check_complete(straight))

    # nothing left to compute: generations.parquet rewritten the same, the stats of the run that did the work kept
    stats = {name: (run_dir / name).read_bytes() for name in ("steps.parquet", "summary.parquet")}
    log = finish(prompts, run_dir)
    assert "nothing left to compute" in log
    assert all((run_dir / name).read_bytes() == data for name, data in stats.items())
    check_complete(run_dir, check_complete(straight))


def test_sigint_and_sigterm_save_the_finished_rows_and_stop(prompts, tmp_path):
    run_dir = tmp_path / "run"
    parts_seen = 0
    max_tokens = 60  # the job must still be running when the signal comes, on a busy machine too
    for sig, code, name in ((signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")):
        proc = start(prompts, run_dir, max_tokens)
        wait_for_parts(run_dir, parts_seen + 1, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err
        assert re.search(rf"error: interrupted by {name}: finished rows are saved in .*; run again with "
                         rf"hydra.run.dir=.* to resume", err), err
        assert "Traceback" not in out + err
        parts = saved(run_dir)
        ids = saved_ids(parts, run_dir)
        assert len(ids) == len(set(ids)) < NUM_ROWS and not (run_dir / "generations.parquet").exists()
        parts_seen = len(parts)
    log = finish(prompts, run_dir, max_tokens)
    assert f"resuming: {len(ids)} of {NUM_ROWS} rows already written" in log
    check_complete(run_dir, max_tokens=max_tokens)

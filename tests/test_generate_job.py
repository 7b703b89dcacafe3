"""The generate job end to end, as a user runs it: Parquet in, three Parquet files out."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]


def run_job(*overrides, cwd=ROOT):
    """The job on the CPU on any machine: these tests check its files, and on CUDA a job beside the suite's
    other workers would not find the memory it sizes its pool for."""
    return subprocess.run([sys.executable, "-m", "engine.run", "model.device=cpu", *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_generate_writes_three_parquet_files(tmp_path):
    prompts = ["hello", "a much longer prompt about paged attention and block tables", "x"]
    pq.write_table(pa.table({"id": [10, 20, 30], "prompt": prompts, "max_tokens": [3, None, 5]}), tmp_path / "in.parquet")
    out = tmp_path / "run"
    result = run_job(f"job.input={tmp_path / 'in.parquet'}", f"hydra.run.dir={out}", "sampling.max_tokens=7",
                     "sampling.ignore_eos=true", "cache.block_size=8")
    assert result.returncode == 0, result.stderr
    generations = pq.read_table(out / "generations.parquet")
    rows = {r["id"]: r for r in generations.to_pylist()}
    assert sorted(rows) == [10, 20, 30]
    assert [rows[i]["output_tokens"] for i in (10, 20, 30)] == [3, 7, 5]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in rows.values())
    assert rows[20]["prompt_tokens"] == len(prompts[1].encode())  # byte-level tokenizer
    assert all(len(r["output_token_ids"]) == r["output_tokens"] for r in rows.values())
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    steps = pq.read_table(out / "steps.parquet")
    assert summary["output_tokens"] == 15 and summary["num_requests"] == 3 and summary["block_size"] == 8
    assert summary["num_steps"] == steps.num_rows and sum(steps["tokens"].to_pylist()) == 15 + summary["prompt_tokens"] - 3
    meta = pq.read_schema(out / "summary.parquet").metadata
    assert json.loads(meta[b"minipaged.config"])["cache"]["block_size"] == 8


def test_default_job_runs_on_the_shipped_sample(tmp_path):
    """...and its console holds only its log and its progress bar: nothing is printed as the process exits
    (Triton 3.9's bindings listed ~30 'leaked' objects at the teardown of a process whose heap main froze)."""
    result = run_job(f"hydra.run.dir={tmp_path}", "sampling.max_tokens=4")
    assert result.returncode == 0, result.stderr
    table = pq.read_table(tmp_path / "generations.parquet")
    assert table.num_rows == 16 and set(table["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert result.stdout.splitlines()[-1].endswith(f"wrote {tmp_path / 'generations.parquet'}: 16 rows")
    assert [line for line in result.stderr.splitlines() if line and not line.startswith(("generate:", "["))] == []


def test_peak_memory_does_not_grow_with_the_number_of_rows(make_config, tmp_path, one_thread):
    """The job on N and on 4N rows (max_tokens=1): rows are streamed in batches and a bounded window, results
    saved in parts and merged in batches, so the peak of Python allocations (tracemalloc) stays put: it grew by
    17 KB here. Holding the 3N extra result rows alone (about 440 bytes each: flush_every=10**6 instead) grew
    it by 790 KB, and holding their token ids too would add 1 KB a row more; the bound is 256 KiB."""
    import logging
    import tracemalloc

    from jobs.generate import generate_job

    def peak(num_rows: int) -> int:
        path = tmp_path / f"in-{num_rows}.parquet"
        pq.write_table(pa.table({"prompt": [f"row {i}: " + "lorem ipsum dolor sit amet " * 4 for i in range(num_rows)]}), path)
        (tmp_path / f"run-{num_rows}").mkdir()
        # a small pool: the prefix cache's index grows with the pool (~150 bytes a block), not with the rows
        cfg = make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=256", "sampling.max_tokens=1",
                          "job.flush_every=64", "cache.num_blocks=64")
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        generate_job(cfg, tmp_path / f"run-{num_rows}")
        return tracemalloc.get_traced_memory()[1] - base

    logging.disable(logging.INFO)
    tracemalloc.start()
    try:
        peak(50)  # once-only allocations (caches of torch, the tokenizer, pyarrow) out of the way
        small, large = peak(600), peak(2400)
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    assert large - small < 2**18, f"peak {small / 2**20:.2f} MiB for 600 rows, {large / 2**20:.2f} MiB for 2400"
    assert pq.read_table(tmp_path / "run-2400" / "generations.parquet").num_rows == 2400


def test_stop_token_id_is_the_id_that_ended_a_sample():
    """The EOS or stop id that ended a sample, else None: a stop string, the length, or a grammar complete on a
    token of its text (which the column used to report as if it were a stop id)."""
    from engine.outputs import CompletionOutput
    from jobs.generate import stop_token_id

    eos = frozenset({9})
    assert stop_token_id(CompletionOutput(0, "ab", [1, 2, 9], "stop"), eos) == 9
    assert stop_token_id(CompletionOutput(0, "ab", [1, 2, 7], "stop", stop_reason=7), eos) == 7
    assert stop_token_id(CompletionOutput(0, "ab", [1, 2], "stop"), eos) is None  # the grammar was complete
    assert stop_token_id(CompletionOutput(0, "a", [1, 2], "stop", stop_reason="b"), eos) is None
    assert stop_token_id(CompletionOutput(0, "ab9", [1, 2, 9], "length"), eos) is None


def test_a_constrained_job_with_samples(tmp_path):
    """n = 3 samples of 2 rows under a choice: 6 rows written (the log says so), each a choice, none with a
    stop id (the grammar ended them, on a token of their text)."""
    pq.write_table(pa.table({"prompt": ["pick one", "again"]}), tmp_path / "in.parquet")
    result = run_job(f"job.input={tmp_path / 'in.parquet'}", f"hydra.run.dir={tmp_path / 'run'}", "sampling.n=3",
                     "sampling.temperature=1.0", "sampling.max_tokens=8", "sampling.structured_outputs={choice: [yes, no]}")
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(tmp_path / "run" / "generations.parquet").to_pylist()
    assert len(rows) == 6 and result.stdout.splitlines()[-1].endswith("generations.parquet: 6 rows")
    assert all(r["output_text"] in ("yes", "no") and r["finish_reason"] == "stop" for r in rows)
    assert [r["stop_token_id"] for r in rows] == [None] * 6

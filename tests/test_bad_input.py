"""Bad input: job-level problems stop the job with one clear line (no traceback) and a non-zero exit;
row-level problems become finish_reason "error" rows while every other row completes."""
import errno
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.engine import LLMEngine, resolve_device
from engine.errors import ConfigError, RequestError
from engine.sequence import SamplingParams
from jobs import JobError
from jobs.common import run_lock
from jobs.config import validate
from jobs.generate import final_batches, generate_job, open_input, row_sampling

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}  # one thread: the tiny model gains nothing from more


def job(path, prompt_column="prompt", id_column=None):
    return SimpleNamespace(input=str(path), prompt_column=prompt_column, id_column=id_column, keep_columns=None)


def read_prompts(job):
    """The input as the job sees it: JobError if unusable, else its ids."""
    source, columns, _ = open_input(job)
    return pa.Table.from_batches(list(final_batches(source, columns)))


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


# -- job level: the input file ---------------------------------------------------------------------
def test_missing_input_file(tmp_path):
    with pytest.raises(JobError, match=r"job.input: no such file: .*nope.parquet"):
        read_prompts(job(tmp_path / "nope.parquet"))


def test_a_file_that_is_not_parquet(tmp_path):
    (tmp_path / "prompts.csv").write_text("id,prompt\n1,hello\n")
    with pytest.raises(JobError, match=r"prompts.csv is not a readable Parquet file"):
        read_prompts(job(tmp_path / "prompts.csv"))


def test_missing_prompt_column_is_named_with_the_columns_there(tmp_path):
    path = write(tmp_path / "in.parquet", id=[1, 2], text=["a", "b"])
    with pytest.raises(JobError, match=r"job.prompt_column: column 'prompt' not in .*columns: \['id', 'text'\]"):
        read_prompts(job(path))


def test_an_id_column_asked_for_must_exist(tmp_path):
    path = write(tmp_path / "in.parquet", prompt=["a", "b"])
    with pytest.raises(JobError, match=r"job.id_column: column 'key' not in .*columns: \['prompt'\]"):
        read_prompts(job(path, id_column="key"))


def test_without_an_id_column_the_ids_are_row_numbers(tmp_path):
    path = write(tmp_path / "in.parquet", prompt=["a", "b", "c"])
    assert read_prompts(job(path))["id"].to_pylist() == [0, 1, 2]
    path = write(tmp_path / "in2.parquet", id=["x", "y"], prompt=["a", "b"])
    assert read_prompts(job(path))["id"].to_pylist() == ["x", "y"]  # column "id" is used when present


@pytest.mark.parametrize("ids, message", [
    ([1, 1, 2, 3, 3], r"2 duplicate ids, e.g. \[1, 3\]"),
    (["a", None], r"1 null ids"),
    ([1.5, 2.5], r"holds double; ids must be integers or strings"),
])
def test_bad_ids(tmp_path, ids, message):
    path = write(tmp_path / "in.parquet", id=ids, prompt=[f"p{i}" for i in range(len(ids))])
    with pytest.raises(JobError, match=message):
        read_prompts(job(path))


def test_a_prompt_column_that_is_not_text(tmp_path):
    path = write(tmp_path / "in.parquet", id=[1, 2], prompt=[3, 4])
    with pytest.raises(JobError, match=r"column 'prompt' .* holds int64, neither strings nor conversations"):
        read_prompts(job(path))


# -- job level: settings ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["cache.block_size=0"], r"cache.block_size must be >= 1, got 0"),
    (["+cache.blok_size=3"], r"unknown config key 'cache.blok_size'; did you mean cache.block_size\? \(cache keys: block_size, "),
    (["+job.inptu=x"], r"unknown config key 'job.inptu'"),
    (["model.dtype=bf16"], r"model.dtype must be one of"),
    (["job.flush_every=0"], r"job.flush_every must be >= 1"),
    (["sampling.max_tokens=0"], r"sampling.max_tokens must be >= 1"),
    (["job.input="], r"job.input is empty: give a Parquet or JSONL file, a directory or a glob"),
    (["job.input=' '"], r"job.input is empty"),
    (["job.output_format=csv"], r"job.output_format must be 'parquet' or 'openai', got 'csv'"),
])
def test_impossible_settings(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(*overrides))


@pytest.mark.parametrize("override, message", [
    ("cache.kv_budget_gb=0.0001", r"a pool of 12 blocks .* cannot hold one sequence"),
    ("cache.num_blocks=3", r"a pool of 3 blocks of 16 tokens .* cannot hold one sequence of model.max_model_len 512"),
])
def test_a_pool_must_hold_one_sequence(make_config, tmp_path, override, message):
    path = write(tmp_path / "in.parquet", prompt=["hi"])
    cfg = make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=512", override)
    validate(cfg)  # the engine, sizing the pool, finds out (the one place the rule is kept)
    with pytest.raises(ConfigError, match=message):
        generate_job(cfg, tmp_path)
    assert not (tmp_path / "generations.parts").exists()  # nothing written for a job that cannot start


def test_a_dtype_the_device_cannot_run(make_config, monkeypatch):
    cfg = make_config("model.device=cpu", "model.dtype=float16")
    assert resolve_device(cfg.model) == (torch.device("cpu"), torch.float16)
    real_matmul = torch.Tensor.__matmul__

    def no_half(a, b):  # what an old PyTorch says for float16 matmul on CPU
        if a.dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")
        return real_matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", no_half)
    with pytest.raises(ConfigError, match=r"model.dtype float16 cannot run on cpu: .*not implemented for 'Half'"):
        resolve_device(cfg.model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_cuda(make_config):
    with pytest.raises(ConfigError, match=r"model.device is 'cuda' but no CUDA device is available"):
        resolve_device(make_config("model.device=cuda").model)


def test_a_model_path_without_weights_or_tokenizer(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"model.path .* is not a directory"):
        LLMEngine(make_config(f"model.path={tmp_path / 'nowhere'}", "model.device=cpu"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"lacks \*.safetensors weights, tokenizer files"):
        LLMEngine(make_config(f"model.path={tmp_path}", "model.device=cpu"))


# -- the entry point: one line on stderr, no traceback, exit code 1 ----------------------------------
def test_errors_print_one_line_without_a_traceback(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    long_name = "a" * 300  # over the 255 bytes of a file name
    cases = {
        "missing input": ([f"job.input={tmp_path / 'nope.parquet'}"], "error: job.input: no such file"),
        "empty input": (["job.input="], "error: job.input is empty"),
        "bad setting": (["cache.block_size=0"], "error: cache.block_size must be >= 1, got 0"),
        "appended unknown key": (["+cache.blok_size=3"], "error: unknown config key 'cache.blok_size'"),
        "bad value": (["cache.block_size=abc"], "error: cache.block_size must be a whole number, got 'abc'"),
        "empty run dir": (["hydra.run.dir="], "error: hydra.run.dir is empty: name a directory"),
        "run dir is a file": ([f"hydra.run.dir={tmp_path / 'a_file'}"],
                              f"error: hydra.run.dir {tmp_path / 'a_file'} is a file, not a directory"),
        "run dir name too long": ([f"hydra.run.dir={tmp_path / long_name}"],  # the check's own OSError
                                  f"error: hydra.run.dir {tmp_path / long_name} cannot be created (File name too long)"),
        "run dir in use": ([f"hydra.run.dir={tmp_path / 'busy'}"],
                           f"error: {tmp_path / 'busy'} is in use by another run (pid {os.getpid()})"),
    }
    record = tmp_path / "busy" / ".hydra" / "config.yaml"  # what Hydra wrote there for the run that holds it
    record.parent.mkdir(parents=True)
    record.write_text("the first run's config\n")
    with run_lock(tmp_path / "busy"):  # a run holding the directory while the second starts
        procs = {name: subprocess.Popen(
            [sys.executable, "-m", "engine.run", f"hydra.run.dir={tmp_path / str(n)}", *overrides, "model.device=cpu"],
            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for n, (name, (overrides, _)) in enumerate(cases.items())}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 1, (name, err)
            assert cases[name][1] in err, (name, err)
            assert "Traceback" not in out + err, (name, err)
    # the refused run wrote nothing there: the lock is taken before Hydra writes its record and log
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == [".hydra", ".minipaged.lock"]
    assert [p.name for p in record.parent.iterdir()] == ["config.yaml"]
    assert record.read_text() == "the first run's config\n"


def test_jobs_started_together_get_run_directories_of_their_own(tmp_path):
    """The default hydra.run.dir has microseconds: two jobs started in the same second (as these two
    nearly always are) do not share one."""
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    # run from tmp_path, the checkout on the path whether or not it is installed (the GPU machine's is not)
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "engine.run", f"job.input={tmp_path / 'empty.parquet'}",
                               "model.device=cpu"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    runs = sorted((tmp_path / "outputs" / "generate").iterdir())
    assert len(runs) == 2 and all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.\d{6}", r.name) for r in runs), runs
    assert all((r / "generations.parquet").is_file() and (r / ".hydra" / "config.yaml").is_file() for r in runs)
    # an empty input is a run too: its summary (settings, no requests) and its steps (none), which analyze reads
    for r in runs:
        assert pq.read_table(r / "summary.parquet").column("num_requests").to_pylist() == [0]
        assert pq.read_table(r / "steps.parquet").num_rows == 0


# -- job level: the run directory and the input under a resumed run ---------------------------------
def small_job(make_config, tmp_path, *extra):
    path = write(tmp_path / "in.parquet", id=[f"r{i}" for i in range(8)], prompt=[f"prompt {i}" for i in range(8)])
    return path, make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=256", "sampling.max_tokens=2",
                             "sampling.ignore_eos=true", "job.flush_every=2", *extra)


def parts(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted((directory / "generations.parts").glob("part-*.parquet"))}


def test_a_second_run_on_the_same_directory_stops_at_once(make_config, tmp_path, one_thread):
    _, cfg = small_job(make_config, tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    with run_lock(run):
        with pytest.raises(JobError, match=rf"{run} is in use by another run \(pid {os.getpid()}\); wait for it"):
            generate_job(cfg, run)
    assert not (run / "generations.parts").exists()
    generate_job(cfg, run)  # the lock is gone with its holder
    assert pq.read_table(run / "generations.parquet").num_rows == 8


def test_resuming_after_the_input_changed_is_refused(make_config, tmp_path, one_thread):
    path, cfg = small_job(make_config, tmp_path)
    pq.write_table(pq.read_table(path), path, compression="none")
    run = tmp_path / "run"
    run.mkdir()
    generate_job(cfg, run)
    before, size = parts(run), path.stat().st_size
    table = pq.read_table(path)  # one letter of one prompt changed: the same size, the same row count
    prompts = table["prompt"].to_pylist()
    prompts[3] = prompts[3].replace("prompt", "Prompt")
    pq.write_table(table.set_column(1, "prompt", pa.array(prompts)), path, compression="none")
    assert path.stat().st_size == size
    with pytest.raises(JobError, match=rf"job.input: {path} changed \(same size, other bytes\) since the rows in "
                                       rf"{run} were generated from it"):
        generate_job(cfg, run)
    assert parts(run) == before  # the finished rows are kept


def test_an_output_directory_that_is_a_file(make_config, tmp_path):
    _, cfg = small_job(make_config, tmp_path)
    (tmp_path / "out").write_text("")
    with pytest.raises(JobError, match=rf"cannot write {tmp_path / 'out' / '.minipaged.lock'}: Not a directory"):
        generate_job(cfg, tmp_path / "out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory(make_config, tmp_path):
    _, cfg = small_job(make_config, tmp_path)
    run = tmp_path / "run"
    run.mkdir(mode=0o555)
    with pytest.raises(JobError, match=rf"cannot write {run}/.minipaged.lock: Permission denied"):
        generate_job(cfg, run)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_write_that_fails_half_way_keeps_the_finished_rows(make_config, tmp_path, monkeypatch, one_thread, code):
    """The disk fills up (or the directory turns read-only) after two parts: one line naming the file, the
    parts saved before kept, and a run started again once the space is back completes from them."""
    import jobs.parquet

    _, cfg = small_job(make_config, tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    real_write, written = pq.write_table, []

    def write_table(table, where, **kwargs):
        if len(written) == 2:
            Path(where).write_bytes(b"PAR1 torn by the full disk")
            raise OSError(code, os.strerror(code))
        written.append(where)
        real_write(table, where, **kwargs)

    monkeypatch.setattr(jobs.parquet.pq, "write_table", write_table)
    with pytest.raises(JobError) as err:
        generate_job(cfg, run)
    assert str(err.value) == (f"cannot write {run}/generations.parts/part-000002.parquet: {os.strerror(code)}; the 4 rows "
                              f"saved before are kept in {run}/generations.parts; fix it and run again with "
                              f"hydra.run.dir={run} to resume")
    before = parts(run)
    assert list(before) == ["part-000000.parquet", "part-000001.parquet"]
    assert not list((run / "generations.parts").glob(".*"))  # no temporary file left behind
    monkeypatch.undo()
    generate_job(cfg, run)
    assert all(parts(run)[name] == data for name, data in before.items())
    rows = pq.read_table(run / "generations.parquet").to_pylist()
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(8)] and all(r["output_tokens"] == 2 for r in rows)
    assert pq.read_table(run / "summary.parquet")["resumed_rows"].to_pylist() == [4]


# -- row level -------------------------------------------------------------------------------------
@pytest.mark.parametrize("row, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, "max_tokens must be >= 1, got -3"),
    ({"max_tokens": 2.5}, "max_tokens 2.5 is not a valid int"),
    ({"max_tokens": float("nan")}, "max_tokens nan is not a valid int"),
    ({"max_tokens": float("inf")}, "max_tokens inf is not a valid int"),
    ({"max_tokens": "many"}, "max_tokens 'many' is not a valid int"),
    ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
    ({"temperature": float("nan")}, "temperature nan is not a valid float"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
])
def test_bad_per_row_sampling_values(row, message):
    with pytest.raises(RequestError) as err:
        row_sampling(SamplingParams(max_tokens=4), row)
    assert str(err.value) == message


def test_bad_rows_become_error_rows_and_the_others_complete(tmp_path):
    ids = ["ok1", "null", "empty", "long", "mt0", "mtfrac", "mtnan", "temp", "utf8", "ok2"]
    prompts = [b"hello", None, b"", b"x" * 600, b"a", b"b", b"c", b"d", b"caf\xe9 \xff", b"world"]
    max_tokens = [None, None, None, None, 0, 2.5, float("nan"), None, None, 5]
    temperature = [None] * 7 + [-1.0, None, None]
    prompts = pa.array(prompts, pa.binary()).view(pa.string())  # a string column holding bytes that are not UTF-8
    write(tmp_path / "in.parquet", id=ids, prompt=prompts, max_tokens=max_tokens, temperature=temperature)
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "engine.run", f"job.input={tmp_path / 'in.parquet'}",
                             f"hydra.run.dir={out}", "model.device=cpu", "model.max_model_len=512", "sampling.max_tokens=3",
                             "sampling.ignore_eos=true"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(out / "generations.parquet").to_pylist()
    assert [r["id"] for r in rows] == ids  # every row, in input order
    by_id = {r["id"]: r for r in rows}
    assert by_id["ok1"]["finish_reason"] == "length" and by_id["ok1"]["output_tokens"] == 3
    assert by_id["ok2"]["finish_reason"] == "length" and by_id["ok2"]["output_tokens"] == 5
    expected = {
        "null": "prompt is null", "empty": "prompt is empty",
        "long": "prompt has 600 tokens; model.max_model_len 512 leaves no room for output",
        "mt0": "max_tokens must be >= 1, got 0", "mtfrac": "max_tokens 2.5 is not a valid int",
        "mtnan": "max_tokens nan is not a valid int", "temp": "temperature must be >= 0, got -1.0",
        "utf8": "prompt is not valid UTF-8 (invalid continuation byte at byte 3)",
    }
    for i, message in expected.items():
        assert by_id[i]["finish_reason"] == "error" and by_id[i]["error"] == message, by_id[i]
        assert by_id[i]["output_tokens"] == 0 and by_id[i]["output_token_ids"] is None
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert by_id["utf8"]["prompt"] == "caf\ufffd \ufffd"  # shown with replacement characters
    assert summary["num_requests"] == 2 and summary["num_errors"] == 8 and summary["resumed_rows"] == 0

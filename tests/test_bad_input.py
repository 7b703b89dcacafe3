"""Bad input: job-level problems stop the job with one clear line (no traceback) and a non-zero exit;
row-level problems become finish_reason "error" rows while every other row completes."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.config import ConfigError, validate
from engine.engine import LLMEngine, RequestError, resolve_device
from jobs import JobError
from jobs.generate import default_sampling, read_prompts, row_sampling

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}  # one thread: the tiny model gains nothing from more


def job(path, prompt_column="prompt", id_column=None):
    return SimpleNamespace(input=str(path), prompt_column=prompt_column, id_column=id_column)


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
    with pytest.raises(JobError, match=r"column 'prompt' .* holds int64, not strings"):
        read_prompts(job(path))


# -- job level: settings ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["cache.block_size=0"], r"cache.block_size must be >= 1, got 0"),
    (["cache.num_blocks=3", "model.max_model_len=512"], r"a pool of 3 blocks of 16 tokens .* cannot hold one sequence of model.max_model_len 512"),
    (["+cache.blok_size=3"], r"unknown config key 'cache.blok_size'; did you mean cache.block_size\? \(cache keys: block_size, "),
    (["+job.inptu=x"], r"unknown config key 'job.inptu'"),
    (["model.dtype=bf16"], r"model.dtype must be one of"),
    (["job.flush_every=0"], r"job.flush_every must be >= 1"),
    (["sampling.max_tokens=0"], r"sampling.max_tokens must be >= 1"),
])
def test_impossible_settings(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(*overrides))


def test_a_pool_sized_from_memory_must_hold_one_sequence(make_config, tmp_path):
    from jobs.generate import generate
    from jobs.results import ResultWriter

    cfg = make_config("model.device=cpu", "model.max_model_len=512", "cache.kv_budget_gb=0.0001")  # 12 blocks of 16
    validate(cfg)
    writer = ResultWriter(tmp_path, pa.int64(), 10, cfg)
    with pytest.raises(ConfigError, match=r"a pool of 12 blocks .* cannot hold one sequence"):
        generate(cfg, [{"id": 0, "prompt": "hi"}], writer)
    assert not writer.parts_dir.exists()  # nothing written for a job that cannot start


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
    cases = {
        "missing input": ([f"job.input={tmp_path / 'nope.parquet'}"], "error: job.input: no such file"),
        "bad setting": (["cache.block_size=0"], "error: cache.block_size must be >= 1, got 0"),
        "appended unknown key": (["+cache.blok_size=3"], "error: unknown config key 'cache.blok_size'"),
        "bad value": (["cache.block_size=abc"], "error: cache.block_size must be a whole number, got 'abc'"),
    }
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "engine.run", *overrides, f"hydra.run.dir={tmp_path / str(n)}", "model.device=cpu"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for n, (name, (overrides, _)) in enumerate(cases.items())}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, (name, err)
        assert cases[name][1] in err, (name, err)
        assert "Traceback" not in out + err, (name, err)


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
        row_sampling(default_sampling(SimpleNamespace(sampling=SimpleNamespace(
            temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4, ignore_eos=False, seed=0, stop_token_ids=[]))), row)
    assert str(err.value) == message


def test_bad_rows_become_error_rows_and_the_others_complete(tmp_path):
    ids = ["ok1", "null", "empty", "long", "mt0", "mtfrac", "mtnan", "temp", "ok2"]
    prompts = ["hello", None, "", "x" * 600, "a", "b", "c", "d", "world"]
    max_tokens = [None, None, None, None, 0, 2.5, float("nan"), None, 5]
    temperature = [None] * 7 + [-1.0, None]
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
    }
    for i, message in expected.items():
        assert by_id[i]["finish_reason"] == "error" and by_id[i]["error"] == message, by_id[i]
        assert by_id[i]["output_tokens"] == 0 and by_id[i]["output_token_ids"] is None
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert summary["num_requests"] == 2 and summary["num_errors"] == 7 and summary["resumed_rows"] == 0

"""The command line: --help, our messages for what Hydra would reject, non-finite values, Ctrl-C during
start-up, each error printed once on one line with no traceback; and the CPU thread count."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import run
from engine.config import (AnalyzeJob, CacheConfig, ConfigError, ModelConfig, SamplingConfig, SchedulerConfig,
                           cpu_threads, key_help, validate)
from engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def engine_run(*args: str, env=ENV) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- --help ----------------------------------------------------------------------------------------
def test_help_lists_the_jobs_and_describes_the_keys():
    proc = engine_run("--help")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    for job in ("generate", "bench", "analyze"):
        assert f"\n  job={job} " in out
    assert "_schema" not in out
    block_size = next(line for line in out.splitlines() if line.strip().startswith("cache.block_size=16 "))
    assert block_size.endswith(key_help(CacheConfig)["block_size"])
    assert "job.input=null" in out and "job.num_prompts" not in out  # the keys of the job chosen, generate


def test_help_lists_the_keys_of_the_job_chosen(make_config):
    bench = run.help_text(make_config("job=bench"))
    assert "job.num_prompts=256" in bench and "job.input=" not in bench
    assert "job.root=???" in run.help_text(make_config("job=analyze"))


@pytest.mark.parametrize("schema", [ModelConfig, CacheConfig, SchedulerConfig, SamplingConfig, AnalyzeJob])
def test_every_key_has_a_description(schema):
    hidden = {(AnalyzeJob, "name")}  # job=NAME sets it; --help leaves it out
    assert [key for key, text in key_help(schema).items() if not text and (schema, key) not in hidden] == []


# -- overrides checked before Hydra ----------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["cache.blok_size=3"], "unknown config key 'cache.blok_size'; did you mean cache.block_size? (cache keys: "
                            "block_size, num_blocks, kv_budget_gb, gpu_memory_utilization, check_invariants, "
                            "enable_prefix_caching, cascade_attention)"),
    (["+cache.blok_size=3"], "unknown config key 'cache.blok_size'; did you mean cache.block_size?"),
    (["job=bench", "job.num_promts=3"], "unknown config key 'job.num_promts'; did you mean job.num_prompts?"),
    (["job.num_prompts=3"], "unknown config key 'job.num_prompts'; it is a key of job=bench (job keys of "
                            "job=generate: name, input,"),
    (["model.path.x=3"], "unknown config key 'model.path.x': model.path is a value, not a group of keys"),
    (["+cache.block_size=3"], "cache.block_size is a known key: set it without the +, as cache.block_size=..."),
    (["sampling.max_tokens=2.5"], "sampling.max_tokens must be a whole number or null, got 2.5"),
    (["cache.kv_budget_gb=lots"], "cache.kv_budget_gb must be a number or null, got 'lots'"),
    (["sampling.ignore_eos=maybe"], "sampling.ignore_eos must be true or false or null, got 'maybe'"),
    (["--multirun", "cache.block_size=8,abc"], "cache.block_size must be a whole number, got 'abc'"),
    (["model=qwen3"], "model: no option 'qwen3'; options: llama-3.2-1b, qwen2.5-0.5b, qwen3-0.6b, tiny"),
    (["job=generate_schema"], "job: no option 'generate_schema'; options: analyze, bench, generate"),
])
def test_overrides_hydra_would_reject_get_our_message(args, message):
    with pytest.raises(ConfigError) as err:
        run.check_overrides(args)
    assert str(err.value).startswith(message)


def test_valid_overrides_pass():
    run.check_overrides(["-m", "job=bench", "job.num_prompts=3", "job.input_len=[1,8]", "cache.block_size=8,16",
                         "cache.num_blocks=null", "model=qwen3-0.6b", "model.path=Qwen/Qwen3-0.6B",
                         "sampling.stop_token_ids=[1,2]", "++cache.block_size=32", "~cache.kv_budget_gb",
                         "cache.num_blocks=${scheduler.max_num_seqs}", "hydra.run.dir=x", "hydra/launcher=basic"])


@pytest.mark.parametrize("override", ["sampling.temperature=inf", "sampling.temperature=nan", "sampling.top_p=nan",
                                      "cache.gpu_memory_utilization=nan", "cache.kv_budget_gb=inf",
                                      "job.flush_interval_s=inf", "model.rope_theta=-inf"])
def test_float_keys_must_be_finite(make_config, override):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key} must be a finite number, got {value}$"):
        validate(make_config(override))


# -- the entry point: one line, once, no traceback -------------------------------------------------
def test_errors_print_once_on_one_line(qwen3_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in qwen3_checkpoint[0].iterdir():
        (broken / file.name).write_bytes(b"\x00" * 64 if file.suffix == ".safetensors" else file.read_bytes())
    cases = {
        "unknown key": (["cache.blok_size=3"], "unknown config key 'cache.blok_size'; did you mean cache.block_size?"),
        "appended unknown key": (["+cache.blok_size=3"], "did you mean cache.block_size?"),
        "decimal for an int": (["sampling.max_tokens=2.5"], "sampling.max_tokens must be a whole number or null, got 2.5"),
        "infinite temperature": (["sampling.temperature=inf"], "sampling.temperature must be a finite number, got inf"),
        "corrupt weights": ([f"model.path={broken}"], f"model.path: cannot read the weights in {broken}/model.safetensors"),
        "hub id offline": (["model.path=test-org/absent"], "model.path 'test-org/absent' is neither a directory nor in "
                                                           "the local Hugging Face cache"),
    }
    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    procs = {name: engine_run(*args, f"hydra.run.dir={tmp_path / str(n)}", "model.device=cpu", env=env)
             for n, (name, (args, _)) in enumerate(cases.items())}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, (name, err)
        errors = [line for line in err.splitlines() if cases[name][1] in line]
        assert len(errors) == 1 and errors[0].startswith("error: "), (name, err)
        assert "Traceback" not in out + err, (name, err)


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("args, where, message", [
    ([], "engine.run.validate", run.STARTUP_INTERRUPTED),  # before the job starts
    (["job=bench"], "engine.models.loader.init_random_weights", "interrupted: job=bench stopped before it finished"),
])
def test_ctrl_c_during_start_up(monkeypatch, capsys, tmp_path, args, where, message):
    monkeypatch.setattr(where, interrupt)
    monkeypatch.setattr(sys, "argv", ["engine.run", *args, f"hydra.run.dir={tmp_path}", "model.device=cpu"])
    with pytest.raises(SystemExit) as exit:
        run.main()
    assert exit.value.code == 130
    assert capsys.readouterr().err == f"error: {message}\n"


# -- CPU threads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cores, hidden_size, asked, threads", [
    (64, 64, None, 1), (64, 1023, None, 1), (64, 1024, None, 4), (64, 4096, None, 16), (64, 65536, None, 64),
    (2, 1024, None, 2), (2, 4096, None, 2), (2, 64, 3, 3),
])
def test_cpu_threads(monkeypatch, cores, hidden_size, asked, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert cpu_threads(ModelConfig(cpu_threads=asked), hidden_size) == threads


@pytest.mark.parametrize("overrides, threads", [([], 1), (["model.cpu_threads=2"], 2)])
def test_the_engine_sets_its_cpu_threads(make_config, overrides, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        LLMEngine(make_config("model.device=cpu", "model.max_model_len=64", *overrides))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)

"""The command line: --help, our messages for what Hydra would reject, non-finite values, Ctrl-C during
start-up, each error printed once on one line with no traceback; and the CPU thread count."""
import gc
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from engine.config import CacheConfig, ModelConfig, SamplingConfig, SchedulerConfig, cpu_threads
from engine.engine import LLMEngine
from engine.errors import ConfigError
from engine.generation_config import resolve_sampling
from jobs import cli as run
from jobs.common import run_dir_override
from jobs.config import AnalyzeJob, key_help, validate

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
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
    qwen2 = next(line for line in out.splitlines() if line.strip().startswith("model=qwen2.5-0.5b "))
    assert qwen2.endswith("real ones: model.path=Qwen/Qwen2.5-0.5B or a checkpoint directory.")  # both comment lines


def test_a_group_options_help_is_its_whole_opening_comment():
    """Not the first line alone, which ends mid-sentence where a comment takes two."""
    assert run.group_options("model")["qwen2.5-0.5b"] == (
        "Qwen2.5-0.5B's architecture with random weights (benchmarks; q/k/v biases start at zero); real ones: "
        "model.path=Qwen/Qwen2.5-0.5B or a checkpoint directory.")
    assert run.group_options("job")["analyze"] == ("compare the runs of a sweep (job.root=<sweep dir>): sweep.parquet, "
                                                   "an aligned table, PNG plots (jobs/analyze.py).")
    assert run.opening_comment("# one\n#\n# two\nkey: 1  # not this\n# nor this\n") == "one two"
    assert run.opening_comment("key: 1\n# after a key\n") == ""


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
                            f"{', '.join(OmegaConf.load(ROOT / 'conf' / 'cache' / 'default.yaml'))})"),
    (["+cache.blok_size=3"], "unknown config key 'cache.blok_size'; did you mean cache.block_size?"),
    (["job=bench", "job.num_promts=3"], "unknown config key 'job.num_promts'; did you mean job.num_prompts?"),
    (["job.num_prompts=3"], "unknown config key 'job.num_prompts'; it is a key of job=bench (job keys of "
                            "job=generate: name, input,"),
    (["model.path.x=3"], "unknown config key 'model.path.x': model.path is a value, not a group of keys"),
    (["+cache.block_size=3"], "cache.block_size is a known key: set it without the +, as cache.block_size=..."),
    (["sampling.max_tokens=2.5"], "sampling.max_tokens must be a whole number or null, got 2.5"),
    (["cache.kv_budget_gb=lots"], "cache.kv_budget_gb must be a number or null, got 'lots'"),
    (["sampling.ignore_eos=maybe"], "sampling.ignore_eos must be true or false or null, got 'maybe'"),
    (["sampling.ignore_eos=2"], "sampling.ignore_eos must be true or false or null, got 2"),  # OmegaConf: true
    (["-m", "cache.enable_prefix_caching=true,0"], "cache.enable_prefix_caching must be true or false, got 0"),
    (["~job"], "~job: removing a key (~) or placing a config group elsewhere (@) is not supported; set the key's "
               "value instead"),
    (["~cache.kv_budget_gb"], "~cache.kv_budget_gb: removing a key (~)"),
    (["cache@other=default"], "cache@other=default: removing a key (~) or placing a config group elsewhere (@)"),
    (["--multirun", "cache.block_size=8,abc"], "cache.block_size must be a whole number, got 'abc'"),
    (["-m", "job=bench", "job.output_len=[4,8],abc"], "job.output_len must be a list such as [1, 2], got 'abc'"),
    (["model=qwen3"], "model: no option 'qwen3'; options: " + ", ".join(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))),
    (["job=generate_schema"], "job: no option 'generate_schema'; options: analyze, bench, generate"),
    (["job.input=a.parquet", "sampling.stop=[a,"], "cannot parse the override 'sampling.stop=[a,': no viable "
                                                   "alternative at input '[a,' (quote a value"),
])
def test_overrides_hydra_would_reject_get_our_message(args, message):
    with pytest.raises(ConfigError) as err:
        run.check_overrides(args)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_valid_overrides_pass():
    run.check_overrides(["-m", "job=bench", "job.num_prompts=3", "job.input_len=[1,8]", "cache.block_size=8,16",
                         "cache.num_blocks=null", "model=qwen3-0.6b", "model.path=Qwen/Qwen3-0.6B",
                         "sampling.stop_token_ids=[1,2]", "++cache.block_size=32", "sampling.ignore_eos=false",
                         "cache.num_blocks=${scheduler.max_num_seqs}", "hydra.run.dir=x", "hydra/launcher=basic",
                         "~hydra/job_logging"])
    # sweeps of lists, which Hydra runs (the check once read each of their values as its text: '[4,8]')
    run.check_overrides(["-m", "job=bench", "job.output_len=[4,8],[8,16]", "job.input_len=choice([1,8],[2,9])",
                         "sampling.stop_token_ids=[1],[2]", "sampling.stop=['a b'],[c]"])


@pytest.mark.parametrize("override", ["sampling.temperature=inf", "sampling.temperature=nan", "sampling.top_p=nan",
                                      "cache.gpu_memory_utilization=nan", "cache.kv_budget_gb=inf",
                                      "job.flush_interval_s=inf", "model.rope_theta=-inf"])
def test_float_keys_must_be_finite(make_config, override):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key} must be a finite number, got {value}$"):
        validate(make_config(override))


@pytest.mark.parametrize("overrides, message", [
    # it said "unknown config key 'job.name': job is a value, not a group of keys": a known key, of a group
    (["job.name=foo"], "job.name=foo: the job is chosen with job=NAME, not job.name; job has no option 'foo'; "
                       "options: analyze, bench, generate"),
    (["job=bench", "job.name=analyze"], "job.name=analyze: the job is chosen with job=NAME, not job.name; write "
                                        "job=analyze instead"),
    (["job=analyze", "job.root=''"], "job.root is empty: give a sweep directory, e.g. job.root=multirun/bench/<time>, "
                                     "got ''"),  # it analyzed the working directory
    (["job=analyze", "job.root=runs", "job.out=''"], "job.out must name a directory, or be null (job.root), got ''"),
])
def test_job_keys_that_cannot_work_are_named(make_config, overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(make_config(*overrides))
    assert str(err.value) == message
    validate(make_config("job=bench", "job.name=bench"))  # the job chosen, named again: nothing wrong


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
        "unset variable": (["job.input=${oc.env:MINIPAGED_TEST_UNSET}"],
                           "job.input: KeyError raised while resolving interpolation: \"Environment variable "
                           "'MINIPAGED_TEST_UNSET' not found\""),
        "missing key": (["sampling.max_tokens=${job.nope}"], "sampling.max_tokens: Interpolation key 'job.nope' not found"),
        "job.name": (["job.name=foo"], "job.name=foo: the job is chosen with job=NAME, not job.name"),
        "empty job.root": (["job=analyze", "job.root="], "job.root is empty: give a sweep directory"),
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


def test_a_sweep_checks_every_run_before_the_first(tmp_path):
    """A value that cannot work in the sweep's second run stops it before the first runs (configuration.md:
    every value is checked before anything runs), naming that run."""
    proc = engine_run("-m", "job=bench", "job.num_prompts=2", "job.input_len=[4,8]", "job.output_len=[2,4]",
                      "cache.block_size=16,0", f"hydra.sweep.dir={tmp_path / 'sweep'}", "model.device=cpu")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err.splitlines()[-1] == ("error: sweep run #1 (job=bench job.num_prompts=2 job.input_len=[4,8] "
                                    "job.output_len=[2,4] cache.block_size=0 model.device=cpu): cache.block_size "
                                    "must be >= 1, got 0"), err
    assert not (tmp_path / "sweep").exists()


def test_a_failed_run_logs_its_error_and_a_run_names_its_model_and_input(qwen3_checkpoint, tmp_path):
    """run.log gets the error line as stderr does (not the console twice), and it starts with the model path and
    the input file."""
    path, _ = qwen3_checkpoint
    prompts = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), prompts)
    cases = {  # name: (overrides, the error), one failing in validate, one when the engine is up
        "validate": (["sampling.top_k=-2"], "sampling.top_k must be >= 1, or -1 or 0 (off), got -2"),
        "engine": ([f"model.path={path}", f"job.input={prompts}", "sampling.logprobs=21"],
                   "sampling.logprobs must be <= 20 (the vocabulary size or 20, the most the sampler returns), got 21"),
    }
    procs = {name: engine_run(*args, f"hydra.run.dir={tmp_path / name}", "model.device=cpu")
             for name, (args, _) in cases.items()}
    logs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        message = cases[name][1]
        assert proc.returncode == 1 and err.splitlines().count(f"error: {message}") == 1, (name, err)
        assert message not in out, (name, out)  # printed once, on stderr
        logs[name] = (tmp_path / name / "run.log").read_text()
        assert logs[name].splitlines()[-1].endswith(f"[minipaged][ERROR] - {message}"), (name, logs[name])
        assert list((tmp_path / name).rglob("*.parquet")) == [], name  # stopped before any work
    assert f"job=generate: model.path={path}\n" in logs["engine"]
    assert f"input: {prompts}\n" in logs["engine"]


def test_a_default_run_names_the_shipped_sample_as_its_input(make_config, caplog):
    from jobs import generate

    with caplog.at_level(logging.INFO, logger="minipaged"):
        run.log_start(make_config(), generate)
    sample = ROOT / "jobs" / "sample_prompts.parquet"
    assert caplog.messages == ["job=generate: model=tiny, random weights (model.path is null)",
                               f"input: {sample} (job.input is null: the shipped sample)"]


README_CHAT_KWARGS = "job.chat_template_kwargs={enable_thinking: false}"  # the README's override for Qwen3


def test_chat_template_kwargs_from_the_command_line(make_config, chat_checkpoint, monkeypatch, tmp_path, frozen_gc):
    assert f"'{README_CHAT_KWARGS}'" in README
    run.check_overrides([README_CHAT_KWARGS])
    cfg = make_config(README_CHAT_KWARGS)
    validate(cfg)
    assert OmegaConf.to_container(cfg.job.chat_template_kwargs) == {"enable_thinking": False}
    # the whole way, from the command line to the template: chat_checkpoint's template takes a keyword, brief
    prompts = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hello"]}), prompts)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(sys, "argv", ["engine.run", f"job.input={prompts}", f"model.path={chat_checkpoint}",
                                      "model.device=cpu", "model.max_model_len=128", "sampling.max_tokens=2",
                                      "job.chat_template=true", "job.chat_template_kwargs={brief: true}",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    run.main()
    templated = AutoTokenizer.from_pretrained(chat_checkpoint).apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, return_dict=False,
        brief=True)
    row = pq.read_table(tmp_path / "run" / "generations.parquet").to_pylist()[0]
    assert row["error"] is None and row["prompt_tokens"] == len(templated)


def test_the_readmes_newline_stop_string_is_a_newline(make_config, caplog):
    """The README's command for a stop string of two newlines, as bash hands it over, reaches SamplingParams as
    two newlines; the README's former example, a backslash and an n, is warned about."""
    command = next(line for line in README.splitlines() if line.startswith("python -m engine.run $'sampling.stop="))
    quoted = re.search(r"\$'[^']*'", command).group()
    assert quoted == run.NEWLINE_STOP  # the warning shows the same
    argument = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, text=True, check=True).stdout
    run.check_overrides([argument])
    cfg = make_config(argument)
    assert resolve_sampling(cfg.sampling, {}).stop == ("\n\n",)
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        caplog.clear()
        run.warn_escaped_newlines(cfg.sampling)
        assert caplog.messages == []
        run.warn_escaped_newlines(make_config(r"sampling.stop=['\n\n',END]").sampling)
    assert caplog.messages == [r"sampling.stop '\n\n' holds a backslash and an n, not a newline; to pass a newline, "
                               f"let the shell write one, e.g. {run.NEWLINE_STOP} in bash or zsh"]


@pytest.fixture
def frozen_gc():
    """run.main freezes the garbage collector's objects (for a quick exit); the test process unfreezes them."""
    yield
    gc.unfreeze()


def test_main_freezes_the_heap_before_the_exit(monkeypatch, capsys, frozen_gc):
    """The interpreter's exit would otherwise run full collections over every object torch and the rest made
    (0.5 s of the exit on the tiny job): main freezes them, on every way out."""
    gc.unfreeze()
    monkeypatch.setattr(sys, "argv", ["engine.run", "cache.blok_size=3"])
    with pytest.raises(SystemExit):
        run.main()
    assert gc.get_freeze_count() > 0


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("args, where, message", [
    ([], "jobs.cli.validate", run.STARTUP_INTERRUPTED),  # before the job starts
    (["job=bench"], "engine.models.loader.init_random_weights", "interrupted: job=bench stopped before it finished"),
])
def test_ctrl_c_during_start_up(monkeypatch, capsys, tmp_path, args, where, message, frozen_gc):
    monkeypatch.setattr(where, interrupt)
    monkeypatch.setattr(sys, "argv", ["engine.run", *args, f"hydra.run.dir={tmp_path}", "model.device=cpu"])
    with pytest.raises(SystemExit) as exit:
        run.main()
    assert exit.value.code == 130
    assert capsys.readouterr().err == f"error: {message}\n"


# Python's -X importtime writes a line to stderr as each import ends: SIGINT is sent as the line of one of these
# comes, from the entry point's own first imports to Hydra's start (torch's import still running at the third
# and fourth, numpy's C extension half made at the second; transformers' second of imports still to come at the last)
START_UP_IMPORTS = ["jobs", "numpy._core.multiarray", "numpy", "torch._C", "jobs.cli", "pyarrow"]


def test_ctrl_c_at_any_point_of_the_start_up_exits_130_with_one_line(tmp_path):
    """Ctrl-C during start-up once misbehaved by where it landed: swallowed inside numpy's import (the job then
    ran to its end, exit 0), an ImportError or AttributeError of a half-imported module, or a traceback between
    the handlers (exit -2). At each point, now: the one line, exit 130."""
    for n, module in enumerate(START_UP_IMPORTS):
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "engine.run", "model.device=cpu",
                                 f"hydra.run.dir={tmp_path / str(n)}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("import time:") and line.rsplit("|", 1)[1].strip() == module:
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.communicate(timeout=300)[1].splitlines(keepends=True)
        errors = [line for line in lines if not line.startswith("import time:")]
        assert any(line.rsplit("|", 1)[-1].strip() == module for line in lines), f"{module} was not imported"
        assert (proc.returncode, errors) == (130, [f"error: {run.STARTUP_INTERRUPTED}\n"]), module


def test_the_start_up_handler_logs_its_line_to_the_run_log(tmp_path):
    """Once Hydra has opened run.log, the start-up handler writes its line there too, as fail does."""
    code = ("import logging, os, signal, sys, time\n"
            "logging.basicConfig(filename=sys.argv[1])\n"
            "from jobs import exit_interrupted_at_start_up\n"
            "signal.signal(signal.SIGINT, exit_interrupted_at_start_up)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(60)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run.log")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stderr) == (130, f"error: {run.STARTUP_INTERRUPTED}\n")
    assert (tmp_path / "run.log").read_text() == f"ERROR:minipaged:{run.STARTUP_INTERRUPTED}\n"


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


@pytest.mark.parametrize("name", ["plain-run_1.x", "job.flush_every=8,job.input=a.jsonl", "it's here", "a b", "$HOME",
                                  "back\\slash", 'say "hi"', "trail\\", "x\\'y"])
def test_the_resume_hint_is_an_override_the_shell_and_hydra_read_back(tmp_path, name):
    """The hydra.run.dir=... that a stopped job prints to resume with: a shell's words, then Hydra's override
    grammar (the oracle: both parsers), give back the directory, a sweep's (named after its overrides) too."""
    directory = tmp_path / name
    words = shlex.split(run_dir_override(directory))
    assert len(words) == 1
    override = OverridesParser.create().parse_overrides(words)[0]
    assert (override.key_or_group, override.value()) == ("hydra.run.dir", str(directory))

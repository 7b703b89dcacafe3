"""executor=ray (jobs/ray_executor.py) on one local Ray of 2 CPUs, shared by the module: two CPU engines on
the tiny model write the rows executor=local writes; an engine killed mid-run or a driver stopped mid-run
leaves every id exactly once; the bench splits its workload; bad executor settings get a message naming
the key; the local executor never imports Ray; Ray's notice about its actors' arguments stays off stderr, and
everything else written there comes out."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from engine.errors import ConfigError
from engine.sequence import SamplingParams
from jobs import cli as engine_run
from jobs import JobError
from jobs.bench import workload
from jobs.config import validate
from jobs.generate import generate_job
from jobs.results import ResultWriter

ray = pytest.importorskip("ray")
from jobs import bench, ray_executor  # noqa: E402 (imports Ray)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NUM_ROWS = 20
ERROR_ROW = 7  # max_tokens 0: an error row
COMMON = ["model.device=cpu", "sampling.max_tokens=5", "job.flush_every=4"]
RAY = ["executor=ray", "executor.num_engines=2", "executor.gpus_per_engine=0", "executor.batch_size=3"]


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(NUM_ROWS)],
                             "prompt": [f"prompt {i} " * (1 + i % 4) for i in range(NUM_ROWS)],
                             "max_tokens": [0 if i == ERROR_ROW else None for i in range(NUM_ROWS)]}), path)
    return path


def generate(prompts, directory: Path, *overrides) -> pa.Table:
    directory.mkdir(exist_ok=True)
    generate_job(config(f"job.input={prompts}", *COMMON, *overrides), directory)
    return pq.read_table(directory / "generations.parquet")


@pytest.fixture(scope="module")
def local(prompts, tmp_path_factory) -> pa.Table:
    return generate(prompts, tmp_path_factory.mktemp("local"))


@pytest.fixture(scope="module")
def local_rows(local) -> list[dict]:
    return local.to_pylist()


def stats(directory: Path) -> tuple[pa.Table, dict]:
    return pq.read_table(directory / "steps.parquet"), pq.read_table(directory / "summary.parquet").to_pylist()[0]


ACTOR_ARGS_NOTICE = ("[2026-12-01 14:51:56,339 E 13341 13341] core_worker.cc:2465: Actor with class name: "
                     "'MapWorker(MapBatches(GenerateEngine))' and ID: '6e8acae71cfb057f534c4d5601000000' has constructor "
                     "arguments in the object store and max_restarts > 0. If the arguments in the object store go out "
                     "of scope or are lost, the actor restart will fail.\n")  # as Ray 2.60 writes it


def test_stderr_without_drops_only_the_notice(capfd):
    other_error = "[2026-12-01 14:51:56,400 E 13341 13341] core_worker.cc:2700: Failed to register actor: boom\n"
    with ray_executor.stderr_without(ray_executor.RAY_ACTOR_ARGS_NOTICE):
        os.write(2, b"\rgenerate:  50%")  # a progress bar's update: no newline
        os.write(2, ACTOR_ARGS_NOTICE.encode())
        os.write(2, other_error.encode())
    os.write(2, ACTOR_ARGS_NOTICE.encode())  # outside: as written
    assert capfd.readouterr().err == "\rgenerate:  50%" + other_error + ACTOR_ARGS_NOTICE


def test_a_ray_job_starts_without_rays_notice_on_stderr(tmp_path):
    # before the module's cluster starts: this job starts a Ray of its own
    result = subprocess.run([sys.executable, "-m", "engine.run", "executor=ray", "executor.num_engines=1",
                             "executor.gpus_per_engine=0", "sampling.max_tokens=2", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "TQDM_DISABLE": "1"})
    assert result.returncode == 0, result.stderr
    assert "core_worker.cc" not in result.stderr and "constructor arguments" not in result.stderr
    assert pq.read_table(tmp_path / "generations.parquet").num_rows == 16


def test_two_engines_write_the_rows_the_local_executor_writes(cluster, prompts, local, local_rows, tmp_path):
    table = generate(prompts, tmp_path, *RAY)
    assert table.to_pylist() == local_rows  # greedy: the same rows, in input order, each id once
    assert table.schema.equals(local.schema, check_metadata=False)
    assert local_rows[ERROR_ROW]["finish_reason"] == "error"  # a row error stays a row error
    steps, summary = stats(tmp_path)
    assert steps.column_names[0] == "engine" and set(steps["engine"].to_pylist()) == {0, 1}
    assert sum(steps["finished"].to_pylist()) == NUM_ROWS - 1 == summary["num_requests"]
    assert summary["num_errors"] == 1 and summary["num_engines"] == 2 and summary["num_steps"] == steps.num_rows
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in local_rows)
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] or 0 for r in local_rows)
    assert 0 < summary["ray_init_s"] <= summary["startup_s"] <= max(summary["engine_done_s"]) <= summary["wall_time_s"]


def test_the_rows_stream_to_the_engines_as_they_free_up(cluster, prompts, local_rows, tmp_path, monkeypatch):
    """20 rows in batches of 3 (7 batches): when the first batch comes back, the driver has read only the
    batches the two engines hold (two each) and the one that replaces it, not the whole input."""
    batches_of, read, seen = ray_executor.batches_of, [], []

    def counted(rows, batch_rows):
        for batch in batches_of(rows, batch_rows):
            read.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(ray_executor, "batches_of", counted)
    monkeypatch.setattr(ray_executor, "after_batch", lambda collector: seen.append(len(read)))
    assert generate(prompts, tmp_path, *RAY).to_pylist() == local_rows
    assert seen[0] == 2 * ray_executor.IN_FLIGHT_PER_ENGINE + 1 < len(read) == 7 and sum(read) == NUM_ROWS


def test_an_engine_of_two_tensor_parallel_ranks_is_a_configuration(cluster, prompts, local_rows, tmp_path):
    """One Ray engine whose model is split over two CPU ranks (its workers are the actor's own processes)."""
    table = generate(prompts, tmp_path, "executor=ray", "executor.num_engines=1", "executor.gpus_per_engine=0",
                     "model.tensor_parallel_size=2")
    assert table.to_pylist() == local_rows
    assert stats(tmp_path)[1]["num_engines"] == 1


def test_an_engine_killed_mid_run_is_restarted_and_each_row_written_once(cluster, prompts, local_rows, tmp_path,
                                                                         monkeypatch):
    """Once the driver has taken its first batch (of one row: the engines are nearly always inside a batch),
    engine 0 is killed, and the driver waits until Ray has restarted it (it registers again, as engine 2):
    the batch it held runs again, on it or on the other engine."""
    killed = []

    def kill_first_engine(collector):
        if not killed:
            killed.append(ray.get(collector.handles.remote())[0])
            ray.kill(killed[0], no_restart=False)
            deadline = time.monotonic() + 120
            while len(ray.get(collector.handles.remote())) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)

    monkeypatch.setattr(ray_executor, "after_batch", kill_first_engine)
    assert generate(prompts, tmp_path, *RAY, "executor.batch_size=1").to_pylist() == local_rows
    _, summary = stats(tmp_path)
    assert killed and len(summary["engine_ready_s"]) == 3  # the two engines, then the one restarted
    assert summary["num_requests"] + summary["num_errors"] == NUM_ROWS


class DriverKilled(BaseException):
    """The driver dying at once: nothing is saved on the way out (unlike SIGINT and SIGTERM)."""


def test_a_killed_driver_resumes_with_each_row_written_once(cluster, prompts, local_rows, tmp_path, monkeypatch):
    flush = ResultWriter.flush

    def flush_then_die(writer):
        flush(writer)
        raise DriverKilled

    monkeypatch.setattr(ResultWriter, "flush", flush_then_die)
    with pytest.raises(DriverKilled):
        generate(prompts, tmp_path, *RAY)
    monkeypatch.undo()
    saved = pq.read_table(tmp_path / "generations.parts")["row"].to_pylist()
    assert len(saved) == 4 and not (tmp_path / "generations.parquet").exists()  # job.flush_every rows
    assert generate(prompts, tmp_path, *RAY).to_pylist() == local_rows
    _, summary = stats(tmp_path)
    assert summary["resumed_rows"] == 4 and summary["num_requests"] + summary["num_errors"] == NUM_ROWS - 4


def test_the_bench_splits_its_workload_over_the_engines(cluster, tmp_path, monkeypatch):
    cfg = config("job=bench", "job.num_prompts=6", "job.input_len=[4,12]", "job.output_len=[2,4]", *RAY)
    monkeypatch.setattr(bench, "run_dir", lambda: tmp_path)
    bench.run(cfg)
    steps, summary = stats(tmp_path)
    requests = workload(cfg.job, SamplingParams(), cfg.model.vocab_size)  # ignore_eos: every max_tokens is drawn
    assert summary["num_requests"] == 6 and summary["workload"] == "random"
    assert summary["output_tokens"] == sum(s.max_tokens for _, s in requests)
    assert summary["prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert set(steps["engine"].to_pylist()) == {0, 1} and sum(steps["finished"].to_pylist()) == 6


def test_an_engines_own_error_stops_the_job_with_its_message(cluster, prompts, qwen3_checkpoint, tmp_path):
    path, _ = qwen3_checkpoint  # its tokenizer has no chat template
    with pytest.raises(JobError, match="job.chat_template is true, but model '.*' has no chat template"):
        generate(prompts, tmp_path, *RAY, "executor.num_engines=1", "job.chat_template=true", f"model.path={path}")


def test_without_a_gpu_the_number_of_engines_must_be_set(cluster):
    with pytest.raises(ConfigError, match=r"executor.num_engines: Ray sees 0 GPUs, so there is no default .* set "
                                          r"executor.num_engines \(with executor.gpus_per_engine=0"):
        engine_count("executor=ray")
    with pytest.raises(ConfigError, match="executor.num_engines 2 x executor.gpus_per_engine 1 needs 2 GPUs, Ray sees 0"):
        engine_count("executor=ray", "executor.num_engines=2")
    with pytest.raises(ConfigError, match="executor.num_engines 2 x executor.gpus_per_engine 2 needs 4 GPUs, Ray sees 0"):
        engine_count("executor=ray", "executor.num_engines=2", "model.tensor_parallel_size=2")  # a GPU per rank
    assert engine_count(*RAY) == 2


def engine_count(*overrides) -> int:
    cfg = config(*overrides)
    return ray_executor.engine_count(cfg.executor, ray_executor.gpus_per_engine(cfg))


@pytest.mark.parametrize("overrides, message", [
    (["executor=rya"], "executor: no option 'rya'; options: local, ray"),
    (["executor=ray", "executor.num_engine=2"], "unknown config key 'executor.num_engine'; did you mean "
                                                "executor.num_engines?"),
    (["executor=ray", "executor.batch_size=many"], "executor.batch_size must be a whole number, got 'many'"),
])
def test_bad_executor_overrides_get_a_message_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        engine_run.check_overrides(overrides)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("override, message", [
    ("executor.num_engines=0", "executor.num_engines must be >= 1 or null (one per GPU), got 0"),
    ("executor.gpus_per_engine=-1", "executor.gpus_per_engine must be >= 0 or null, got -1.0"),
    ("executor.batch_size=0", "executor.batch_size must be >= 1, got 0"),
    ("executor.address=' '", "executor.address must be a Ray address such as auto"),
])
def test_bad_executor_values_get_a_message_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        validate(config("executor=ray", override))
    assert str(err.value).startswith(message)


def test_the_local_executor_does_not_import_ray(tmp_path):
    script = ("import runpy, sys\n"
              f"sys.argv = ['engine.run', 'hydra.run.dir={tmp_path}', 'sampling.max_tokens=2']\n"
              "runpy.run_module('engine.run', run_name='__main__')\n"
              "assert 'ray' not in sys.modules, 'the local executor imported ray'\n")
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert pq.read_table(tmp_path / "generations.parquet").num_rows == 16

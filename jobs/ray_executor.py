"""executor=ray: one job over several engines, each in a Ray actor, the rows spread over them by Ray Data.

Driver (this process). The input rows that no earlier run saved (jobs.generate.pending_rows: the same
resume as executor=local) go to Ray's object store in blocks of BATCH_ROWS rows (row number, the row's
fields pickled). Ray Data's map_batches hands them, executor.batch_size rows at a time (fewer when the
rows would not give every engine one batch), to a pool of executor.num_engines actors holding
executor.gpus_per_engine GPUs each. An actor builds one engine with the Python API (engine.LLM on the
job's config) and runs each batch to completion through LLM.stream; it returns the batch's result rows
(jobs.results.PART_SCHEMA; a row that cannot run stays an error row). The driver takes the output stream
and hands the rows to the job's ResultWriter, as executor=local does: generations.parquet, its parts and
resuming are the same. `job=bench` hands each engine row numbers of the synthetic workload instead, which
every engine draws alike (jobs.bench.workload).

Faults. An actor that dies (a crash, out of memory, ray.kill) is restarted by Ray (max_restarts=-1) and
the batch it was running is run again (max_task_retries=-1). A batch's rows come back together, and the
driver drops a row it has already taken (a batch run twice), so each row is saved once. A killed driver
leaves the parts it saved: run again with the same hydra.run.dir. A bad setting that an engine finds
when it is built (a pool too small, a checkpoint it cannot read, no chat template for conversations)
stops the job with the engine's message.

Statistics. Each engine registers with a StatsCollector actor once built and sends it its new steps after
every batch. steps.parquet: every engine's steps with an `engine` column, the engine's index in
registration order (an actor restarted by Ray registers again, under a new index). summary.parquet: one
row for the job: the settings (from the first engine), the counts, engine/stats.py's figures over all the
steps (step counts, preemptions and prefix-cache hits summed, peaks the largest, means over every step),
and wall_time_s from the job's start (Ray's start-up and the model loads included) to its last row, so
that output_tok_per_s is the job's end-to-end rate. The start-up and the tail, in seconds:

    ray_init_s      starting Ray or attaching to it
    startup_s       from the job's start until every engine of the pool was ready: ray_init_s, the actors'
                    processes, the model load and (CUDA) the warm-up
    load_s          the slowest engine's own construction: model load and warm-up
    tail_s          from the first engine's end (its last batch) to the last engine's: engines idle at the end
    engine_ready_s, engine_done_s   per engine: when it was ready, and when it finished its last batch
"""
import contextlib
import itertools
import logging
import math
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import ray.data
import torch
from ray.data import ActorPoolStrategy, DataContext

from engine.config import ConfigError, UserError
from engine.llm import LLM, Request
from engine.stats import STEPS_SCHEMA, StatsRecorder, StepStats
from jobs import JobError
from jobs.bench import shape, workload
from jobs.common import Progress, run_dir, run_summary, write_stats
from jobs.generate import (chat_kwargs, check_chat_input, default_sampling, new_counts, pending_rows,
                           result_rows, tally, to_request)
from jobs.inputs import Columns, InputFiles
from jobs.results import PART_SCHEMA, ResultWriter

log = logging.getLogger("minipaged")
ENGINES_READY_TIMEOUT_S = 3600  # the pool's actors must all be built by then (model loads included)
ENGINE_STEPS_SCHEMA = pa.schema([("engine", pa.int64()), *STEPS_SCHEMA])  # steps.parquet of executor=ray
# Ray Data keeps its actors' constructor arguments in the object store, so Ray's core worker logs this line
# (at ERROR, to the driver's stderr, once per process) as the engines' pool starts. The restarts it warns
# about work here (Ray Data holds those objects while the job runs), and Ray has no switch for this line
# alone: RAY_BACKEND_LOG_LEVEL=fatal would hide every error of Ray's C++, and print a line of its own.
RAY_ACTOR_ARGS_NOTICE = (r"\[[^\]\n]* E [^\]\n]*\] core_worker\.cc:\d+: Actor with class name: [^\n]*"
                         r"has constructor arguments in the object store[^\n]*\n?")
# stderr_without's filter, run by a Python of its own: it outlives this process, so what is written just
# before a crash (a fatal error of Ray's C++) still comes out.
LINE_FILTER = """\
import os, re, sys
drop = re.compile(sys.argv[1].encode())
while chunk := os.read(0, 1 << 16):
    sys.stdout.buffer.write(drop.sub(b"", chunk))
    sys.stdout.buffer.flush()
"""


# -- the engines (Ray actors) -------------------------------------------------------------------------
class Engine:
    """One engine in a Ray actor: map_batches' callable class. Once built it registers with the collector;
    after each batch it reports its new steps (step_time_s leaves out the waits between batches).
    Subclasses prepare in setup() and turn a batch into output rows in run()."""

    def __init__(self, cfg, collector, *args):
        constructed = time.time()
        try:
            self.llm = LLM.from_config(cfg)
            self.setup(cfg, *args)
        except UserError as err:  # raised from the first batch: Ray keeps a task's exception, not a constructor's
            self.failed = err
            return
        self.failed, self.collector, self.reported = None, collector, 0
        settings = run_summary(self.llm.engine, cfg, 0, 0, 0, 0)  # the config part of summary.parquet
        me = ray.get_runtime_context().current_actor
        self.index = ray.get(collector.register.remote(me, settings, constructed, time.time()))

    def setup(self, cfg, *args) -> None:
        pass

    def run(self, batch: pa.Table) -> pa.Table:
        raise NotImplementedError

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.failed:
            raise self.failed
        self.llm.engine.stats.restart_clock()
        out = self.run(batch)
        steps = self.llm.engine.stats.steps[self.reported:]
        self.reported += len(steps)
        table = pa.Table.from_pylist([asdict(s) for s in steps], schema=STEPS_SCHEMA)
        ray.get(self.collector.add_steps.remote(self.index, table, time.time()))
        return out


class GenerateEngine(Engine):
    """job=generate: a batch of (row, pickled fields) in, its result rows (PART_SCHEMA) out."""

    def setup(self, cfg, columns: Columns) -> None:
        check_chat_input(cfg.job, columns, self.llm.check_chat_template)
        self.chat_template, self.chat_kwargs = cfg.job.chat_template, chat_kwargs(cfg.job)

    def run(self, batch: pa.Table) -> pa.Table:
        requests = (to_request(row, pickle.loads(fields), self.llm.default_sampling, self.chat_template)
                    for row, fields in zip(batch["row"].to_pylist(), batch["fields"].to_pylist()))
        rows = [row for out in self.llm.stream(requests, chat_template_kwargs=self.chat_kwargs)
                for row in result_rows(out)]
        return pa.Table.from_pylist(rows, schema=PART_SCHEMA)


class BenchEngine(Engine):
    """job=bench: a batch of request numbers of the workload in, each request's token counts out."""

    def setup(self, cfg) -> None:
        self.requests = workload(cfg.job, default_sampling(cfg), self.llm.engine.model.arch.vocab_size)

    def run(self, batch: pa.Table) -> pa.Table:
        requests = (Request(i, prompt_token_ids=self.requests[i][0], sampling_params=self.requests[i][1])
                    for i in batch["id"].to_pylist())
        return pa.Table.from_pylist([{"id": out.request_id, "prompt_tokens": len(out.prompt_token_ids),
                                      "output_tokens": sum(len(c.token_ids) for c in out.outputs)}
                                     for out in self.llm.stream(requests)])


@ray.remote(num_cpus=0)
class StatsCollector:
    """The engines' registrations and steps, for the driver's steps.parquet and summary.parquet."""

    def __init__(self):
        self.engines: list[dict] = []

    def register(self, handle, settings: dict, constructed: float, ready: float) -> int:
        self.engines.append({"handle": handle, "settings": settings, "constructed": constructed, "ready": ready,
                             "done": None, "steps": []})
        return len(self.engines) - 1

    def add_steps(self, index: int, steps: pa.Table, done: float) -> None:
        engine = self.engines[index]
        engine["steps"].append(steps.add_column(0, "engine", pa.array([index] * steps.num_rows, pa.int64())))
        engine["done"] = done

    def handles(self) -> list:
        return [engine["handle"] for engine in self.engines]

    def report(self) -> list[dict]:
        return [{k: v for k, v in engine.items() if k != "handle"} for engine in self.engines]


def after_batch(collector) -> None:
    """Called after each output batch the driver takes in (a test puts a fault here)."""


# -- the driver ---------------------------------------------------------------------------------------
def start_ray(executor) -> bool:
    """Start a local Ray (executor.address null) or attach to executor.address; False when this process
    already runs Ray (left as it is)."""
    if ray.is_initialized():
        return False
    if executor.address is None:  # a CPU for each engine's host loop, and one more
        num_cpus = (executor.num_engines or torch.cuda.device_count() or 1) + 1
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        try:
            ray.init(address=executor.address, log_to_driver=False)
        except ConnectionError as err:
            raise ConfigError(f"executor.address: cannot attach to Ray at {executor.address!r} ({err})") from None
    return True


@contextlib.contextmanager
def stderr_without(pattern: str) -> Iterator[None]:
    """While inside, what this process writes to file descriptor 2 (Python's and C++'s alike) goes through
    a filter that drops the matches of the regular expression `pattern` and passes the rest on as it comes.
    Meant for a short stretch: no process may be started inside (it would inherit the filter's pipe)."""
    sys.stderr.flush()
    original = os.dup(2)
    drop = subprocess.Popen([sys.executable, "-c", LINE_FILTER, pattern], stdin=subprocess.PIPE, stdout=original,
                            start_new_session=True)  # Ctrl-C stops the job, not its stderr
    os.dup2(drop.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)
        os.close(original)
        drop.stdin.close()  # the pipe's last writer: the filter writes out the rest and ends
        drop.wait()


def engine_count(executor) -> int:
    """executor.num_engines, or one engine per executor.gpus_per_engine GPUs that Ray sees; ConfigError
    when the pool cannot be placed."""
    gpus, per_engine = ray.cluster_resources().get("GPU", 0), executor.gpus_per_engine
    if executor.num_engines is None:
        count = int(gpus // per_engine) if per_engine else 0
        if not count:
            raise ConfigError(f"executor.num_engines: Ray sees {gpus:g} GPUs, so there is no default "
                              f"(one engine per {per_engine:g} GPUs); set executor.num_engines (with "
                              f"executor.gpus_per_engine=0 for engines on the CPU)")
        return count
    if executor.num_engines * per_engine > gpus:
        raise ConfigError(f"executor.num_engines {executor.num_engines} x executor.gpus_per_engine {per_engine:g} "
                          f"needs {executor.num_engines * per_engine:g} GPUs, Ray sees {gpus:g}"
                          + ("; executor.gpus_per_engine=0 runs the engines on the CPU" if not gpus else ""))
    return executor.num_engines


def engine_error(err: ray.exceptions.RayError) -> UserError | None:
    """The UserError (a setting or the input) that an engine raised, from Ray's wrapping of it."""
    cause = getattr(err, "cause", None)  # a RayTaskError's: the exception the actor raised
    return cause if isinstance(cause, UserError) else None


def execute(cfg, engine: type, dataset: Callable[[int], ray.data.Dataset], num_rows: int,
            take: Callable[[pa.Table], Iterable[int]], engine_args: tuple = ()) -> tuple[pa.Table, dict]:
    """Run the rows of dataset(batch_size) (built once Ray runs, in blocks of batch_size rows: a block is
    what one actor call gets) through a pool of `engine` actors, built with
    (cfg, the collector, *engine_args); take() gets each output batch and returns the output tokens of
    each request it took (for the progress bar). Returns steps.parquet's table and the summary's columns
    that come from the engines (job_timings)."""
    start = time.time()
    started_ray = start_ray(cfg.executor)
    try:
        ray_ready = time.time()
        num_engines = engine_count(cfg.executor)
        collector = StatsCollector.remote()
        context = DataContext.get_current()
        context.enable_progress_bars = False
        context.wait_for_min_actors_s = ENGINES_READY_TIMEOUT_S  # every engine ready before the first batch
        context.raise_original_map_exception = True  # an engine's UserError reaches engine_error
        batch_size = min(cfg.executor.batch_size, math.ceil(num_rows / num_engines))  # every engine gets rows
        # Ray Data's actors default to max_restarts=-1, max_task_retries=-1: a dead actor is restarted and
        # its batch run again. One batch at a time per actor: the next goes to whichever engine is free.
        outputs = dataset(batch_size).map_batches(
            engine, batch_size=batch_size, batch_format="pyarrow", fn_constructor_args=(cfg, collector, *engine_args),
            num_cpus=1, num_gpus=cfg.executor.gpus_per_engine,
            compute=ActorPoolStrategy(size=num_engines, max_tasks_in_flight_per_actor=1))
        log.info("ray: %d engine(s), %g GPU(s) each, batches of up to %d rows", num_engines,
                 cfg.executor.gpus_per_engine, batch_size)
        progress, batches = Progress(num_rows), iter(outputs.iter_batches(batch_size=None, batch_format="pyarrow"))
        try:
            with stderr_without(RAY_ACTOR_ARGS_NOTICE):  # Ray Data starts the pool for the first batch
                first = list(itertools.islice(batches, 1))
            for batch in itertools.chain(first, batches):
                for output_tokens in take(batch):
                    progress.finished(output_tokens)
                after_batch(collector)
        except ray.exceptions.RayError as err:
            raise (engine_error(err) or err) from None
        finally:
            batches.close()  # on the way out of a failure too: Ray Data stops, and its actors with it
            progress.close()
        end = time.time()
        engines = ray.get(collector.report.remote())
    finally:
        if started_ray:
            ray.shutdown()
    return job_timings(engines, num_engines, start, ray_ready, end)


def job_timings(engines: list[dict], num_engines: int, start: float, ray_ready: float,
                end: float) -> tuple[pa.Table, dict]:
    """steps.parquet's table (every engine's steps) and the summary's columns that come from the engines."""
    steps = pa.concat_tables([t for e in engines for t in e["steps"]] or [ENGINE_STEPS_SCHEMA.empty_table()])
    ready = sorted(e["ready"] - start for e in engines)
    done = [e["done"] - start for e in engines if e["done"] is not None]
    settings = engines[0]["settings"]
    recorder = StatsRecorder()
    recorder.steps = [StepStats(**row) for row in steps.drop_columns(["engine"]).to_pylist()]
    figures = recorder.summary(settings["num_blocks"], settings["block_size"], settings["max_model_len"])
    timings = {**settings, **figures, "wall_time_s": end - start, "num_engines": num_engines,
               "ray_init_s": ray_ready - start, "startup_s": ready[min(num_engines, len(ready)) - 1],
               "load_s": max(e["ready"] - e["constructed"] for e in engines),
               "tail_s": max(done) - min(done) if done else 0.0,
               "engine_ready_s": [e["ready"] - start for e in engines],
               "engine_done_s": [None if e["done"] is None else e["done"] - start for e in engines]}
    log.info("ray: %.2f s end to end: start-up %.2f s (Ray %.2f s, slowest model load %.2f s), then %.2f s of "
             "generation, of which a tail of %.2f s with engines idle", timings["wall_time_s"], timings["startup_s"],
             timings["ray_init_s"], timings["load_s"], timings["wall_time_s"] - timings["startup_s"], timings["tail_s"])
    return steps, timings


def job_summary(timings: dict, counts: dict) -> dict:
    """summary.parquet's row: the engines' settings and figures, the counts, throughput over the job's wall time."""
    wall = timings["wall_time_s"]
    summary = {**timings, **counts}
    summary.update(output_tok_per_s=counts["output_tokens"] / wall,
                   total_tok_per_s=(counts["prompt_tokens"] + counts["output_tokens"]) / wall)
    return summary


def blocks_dataset(tables: Iterable[pa.Table]) -> ray.data.Dataset:
    """A dataset of these tables, each a block, put in Ray's object store by the driver (which keeps only
    references; the store spills to disk past its size). No read task: the engines may hold every CPU."""
    return ray.data.from_arrow_refs([ray.put(table) for table in tables])


def pending_dataset(source: InputFiles, columns: Columns, writer: ResultWriter, block_rows: int) -> ray.data.Dataset:
    """The rows not saved yet, in blocks of block_rows: row number and the row's fields, pickled."""
    rows = pending_rows(source, columns, writer)
    return blocks_dataset(pa.table({"row": pa.array([row for row, _ in chunk], pa.int64()),
                                    "fields": pa.array([pickle.dumps(f) for _, f in chunk], pa.binary())})
                          for chunk in iter(lambda: list(itertools.islice(rows, block_rows)), []))


def run_generate(cfg, source: InputFiles, columns: Columns, writer: ResultWriter, directory: Path) -> None:
    """job=generate executor=ray: the rows not saved yet through the engines, each row's results to the
    writer once; then steps.parquet and summary.parquet."""
    counts, taken = new_counts(), np.zeros(source.num_rows, bool)

    def take(batch: pa.Table) -> Iterable[int]:
        for row, results in itertools.groupby(batch.to_pylist(), key=lambda r: r["row"]):
            if not taken[row]:  # else a batch run again after its engine died had returned it already
                taken[row] = True
                results = list(results)
                writer.add(*results)
                yield tally(counts, results)

    steps, timings = execute(cfg, GenerateEngine, lambda rows: pending_dataset(source, columns, writer, rows),
                             source.num_rows - writer.resumed, take, (columns,))
    writer.flush()  # every row saved before the stats: a kill from here on loses no work
    summary = job_summary(timings, counts)
    summary["resumed_rows"] = writer.resumed
    write_stats(steps, cfg, directory, summary)


def run_bench(cfg) -> None:
    """job=bench executor=ray: the workload's requests split over the engines; no floor (it is one device's)."""
    if cfg.job.baseline != "none":
        raise JobError(f"job.baseline={cfg.job.baseline} runs on one device: use executor=local")
    num_prompts = shape(cfg.job).num_prompts
    counts, taken = new_counts(), np.zeros(num_prompts, bool)

    def take(batch: pa.Table) -> Iterable[int]:
        for request in batch.to_pylist():
            if not taken[request["id"]]:  # else a batch run again after its engine died had returned it already
                taken[request["id"]] = True
                counts["num_requests"] += 1
                counts["prompt_tokens"] += request["prompt_tokens"]
                counts["output_tokens"] += request["output_tokens"]
                yield request["output_tokens"]

    def request_numbers(block_rows: int) -> ray.data.Dataset:
        return blocks_dataset(pa.table({"id": pa.array(range(lo, min(lo + block_rows, num_prompts)), pa.int64())})
                              for lo in range(0, num_prompts, block_rows))

    steps, timings = execute(cfg, BenchEngine, request_numbers, num_prompts, take)
    summary = job_summary(timings, counts)
    summary["workload"] = cfg.job.workload
    write_stats(steps, cfg, run_dir(), summary)

"""executor=ray: one job over several engines, each in a Ray actor, the rows streamed to them in batches.

Driver (this process). It starts the executor.num_engines Engine actors first, each holding
executor.gpus_per_engine GPUs (unset: model.tensor_parallel_size, a GPU per rank), so the engines build
while the rows are read. The job's rows (key, fields) (job=generate: the input rows that no earlier run
saved, the same resume as executor=local; job=bench: request numbers of its workload, which every engine
draws alike) are read as the engines have room, executor.batch_size rows at a time (fewer when the rows
would not give every engine one batch; the key, the fields pickled): each engine holds two batches at
most, the one it runs and the next, so the driver never holds more of the input than that. An actor builds
one engine with the Python API (engine.LLM on the job's config), hands it to the job's Processor
(jobs/processor.py: setup), and runs each batch to completion through LLM.stream, the Processor turning
rows into requests and results into output rows (a row that cannot run stays an error row). The driver
hands each finished batch's rows to the job (`take`), as executor=local does: generations.parquet, its
parts and resuming are the same. (Ray Data's map_batches, used before, needs its input whole in the object
store before the first batch; the rows here come from a generator on the driver.)

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
from collections.abc import Callable, Iterator
from dataclasses import asdict

import pyarrow as pa
import ray
import torch

from engine.errors import ConfigError, UserError
from engine.stats import STEPS_SCHEMA, StatsRecorder, StepStats
from jobs.common import Progress
from jobs.processor import Processor, Rows, Run, new_llm

log = logging.getLogger("minipaged")
ENGINES_READY_TIMEOUT_S = 3600  # a batch must come back by then (model loads included)
IN_FLIGHT_PER_ENGINE = 2  # an engine's batches handed over at once: the one it runs and the next
ENGINE_STEPS_SCHEMA = pa.schema([("engine", pa.int64()), *STEPS_SCHEMA])  # steps.parquet of executor=ray
# Ray keeps large constructor arguments of an actor in the object store, and then its core worker logs this
# line (at ERROR, to the driver's stderr, once per process) as the engines start. The restarts it warns
# about work here (the driver holds those objects while the job runs), and Ray has no switch for this line
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
@ray.remote(max_restarts=-1, max_task_retries=-1)  # a dead engine is restarted, and its batches run again
class Engine:
    """One engine in a Ray actor, running the job's Processor. Once built it registers with the collector;
    after each batch it reports its new steps (step_time_s leaves out the waits between batches) and its
    sampler's fallbacks so far."""

    def __init__(self, cfg, collector, processor: Processor):
        constructed = time.time()
        try:
            self.llm = new_llm(cfg, processor)
            processor.setup(self.llm)
        except UserError as err:  # raised from the first batch: Ray keeps a task's exception, not a constructor's
            self.failed = err
            return
        self.failed, self.collector, self.processor, self.reported = None, collector, processor, 0
        me = ray.get_runtime_context().current_actor
        self.index = ray.get(collector.register.remote(me, asdict(self.llm.settings()), constructed, time.time()))

    def run(self, batch: pa.Table) -> pa.Table:
        """The output rows of a batch of input rows (batch_table's), run to completion."""
        if self.failed:
            raise self.failed
        requests = (self.processor.preprocess(key, pickle.loads(fields))
                    for key, fields in zip(batch["row"].to_pylist(), batch["fields"].to_pylist()))
        rows = [row for out in self.llm.stream(requests, chat_template_kwargs=self.processor.chat_template_kwargs)
                for row in self.processor.postprocess(out)]
        stats = self.llm.stats(self.reported)
        self.reported += len(stats.steps)
        ray.get(self.collector.add_steps.remote(self.index, stats.table(), stats.sampler_fallbacks, time.time()))
        return pa.Table.from_pylist(rows, schema=self.processor.output_schema)


@ray.remote(num_cpus=0)
class StatsCollector:
    """The engines' registrations and steps, for the driver's steps.parquet and summary.parquet."""

    def __init__(self):
        self.engines: list[dict] = []

    def register(self, handle, settings: dict, constructed: float, ready: float) -> int:
        self.engines.append({"handle": handle, "settings": settings, "constructed": constructed, "ready": ready,
                             "done": None, "steps": [], "sampler_fallbacks": 0})
        return len(self.engines) - 1

    def add_steps(self, index: int, steps: pa.Table, sampler_fallbacks: int, done: float) -> None:
        engine = self.engines[index]
        engine["steps"].append(steps.add_column(0, "engine", pa.array([index] * steps.num_rows, pa.int64())))
        engine["done"], engine["sampler_fallbacks"] = done, sampler_fallbacks

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


def gpus_per_engine(cfg) -> float:
    """executor.gpus_per_engine, or where unset model.tensor_parallel_size: one GPU per rank."""
    per_engine = cfg.executor.gpus_per_engine
    return cfg.model.tensor_parallel_size if per_engine is None else per_engine


def engine_count(executor, per_engine: float) -> int:
    """executor.num_engines, or one engine per `per_engine` GPUs that Ray sees; ConfigError when the pool
    cannot be placed."""
    gpus = ray.cluster_resources().get("GPU", 0)
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


def run_on_ray(cfg, processor: Processor, rows: Rows, num_rows: int, take: Callable[[list[dict]], int]) -> Run:
    """executor=ray: the rows through a pool of Engine actors running `processor`; take() gets the output
    rows of each request once (a batch run again after its engine died returns its rows again), and
    returns its output tokens (for the progress bar). Returns steps.parquet's table (every engine's steps)
    and the summary's columns that come from the engines (job_timings)."""
    start = time.time()
    started_ray = start_ray(cfg.executor)
    try:
        ray_ready = time.time()
        per_engine = gpus_per_engine(cfg)
        num_engines = engine_count(cfg.executor, per_engine)
        collector = StatsCollector.remote()
        batch_size = min(cfg.executor.batch_size, math.ceil(num_rows / num_engines))  # every engine gets rows
        with stderr_without(RAY_ACTOR_ARGS_NOTICE):  # the engines start building now, while the rows are read
            engines = [Engine.options(num_cpus=1, num_gpus=per_engine).remote(cfg, collector, processor)
                       for _ in range(num_engines)]
        log.info("ray: %d engine(s), %g GPU(s) each, batches of up to %d rows", num_engines, per_engine, batch_size)
        progress = Progress(num_rows)
        try:
            stream_batches(engines, batches_of(rows, batch_size), take, progress, collector)
        finally:
            progress.close()
            for engine in engines:  # on the way out of a failure too
                ray.kill(engine)
        end = time.time()
        report = ray.get(collector.report.remote())
    finally:
        if started_ray:
            ray.shutdown()
    return Run(*job_timings(report, num_engines, start, ray_ready, end))


def stream_batches(engines: list, batches: Iterator[pa.Table], take: Callable[[list[dict]], int],
                   progress: Progress, collector) -> None:
    """Each engine holds IN_FLIGHT_PER_ENGINE batches at most (one running, the next queued behind it), the
    next read from `batches` only when an engine has room: the driver holds no more of the input than
    that. Each finished batch's rows go to take() once per request."""
    in_flight, taken = {}, set()

    def feed(engine) -> None:
        batch = next(batches, None)
        if batch is not None:
            in_flight[engine.run.remote(batch)] = engine

    for _ in range(IN_FLIGHT_PER_ENGINE):
        for engine in engines:
            feed(engine)
    while in_flight:
        done, _ = ray.wait(list(in_flight), num_returns=1, timeout=ENGINES_READY_TIMEOUT_S)
        if not done:
            raise UserError(f"ray: no engine finished a batch within {ENGINES_READY_TIMEOUT_S} s")
        engine = in_flight.pop(done[0])
        try:
            batch = ray.get(done[0])
        except ray.exceptions.RayError as err:
            raise (engine_error(err) or err) from None
        feed(engine)
        for key, request_rows in itertools.groupby(batch.to_pylist(), key=lambda row: row["row"]):
            if key not in taken:
                taken.add(key)
                progress.finished(take(list(request_rows)))
        after_batch(collector)


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
    timings = {**settings, **figures, "sampler_fallbacks": sum(e["sampler_fallbacks"] for e in engines),
               "wall_time_s": end - start, "num_engines": num_engines,
               "ray_init_s": ray_ready - start, "startup_s": ready[min(num_engines, len(ready)) - 1],
               "load_s": max(e["ready"] - e["constructed"] for e in engines),
               "tail_s": max(done) - min(done) if done else 0.0,
               "engine_ready_s": [e["ready"] - start for e in engines],
               "engine_done_s": [None if e["done"] is None else e["done"] - start for e in engines]}
    log.info("ray: %.2f s end to end: start-up %.2f s (Ray %.2f s, slowest model load %.2f s), then %.2f s of "
             "generation, of which a tail of %.2f s with engines idle", timings["wall_time_s"], timings["startup_s"],
             timings["ray_init_s"], timings["load_s"], timings["wall_time_s"] - timings["startup_s"], timings["tail_s"])
    return steps, timings


def batches_of(rows: Rows, batch_rows: int) -> Iterator[pa.Table]:
    """The rows in tables of batch_rows (the key, the fields pickled), read from `rows` as they are asked for."""
    rows = iter(rows)
    for chunk in iter(lambda: list(itertools.islice(rows, batch_rows)), []):
        yield pa.table({"row": pa.array([key for key, _ in chunk], pa.int64()),
                        "fields": pa.array([pickle.dumps(f) for _, f in chunk], pa.binary())})

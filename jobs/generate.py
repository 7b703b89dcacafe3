"""job=generate: prompts from Parquet -> generations.parquet, steps.parquet, summary.parquet.

Input: job.input (default: the sample shipped beside this file) with a prompt column (job.prompt_column)
and an id column: job.id_column when set (it must exist), else column "id" when present, else row
numbers. Ids are integers or strings, unique and not null. Optional per-row sampling columns:
max_tokens, temperature, top_p, top_k, seed. A row that cannot run (null or empty prompt, too long,
a bad per-row value) is written with finish_reason "error" and its message; every other row completes.

Crash safety (jobs/results.py): rows are saved in parts as they finish; a run started again with the same
hydra.run.dir skips the ids already saved. SIGINT and SIGTERM stop the run after saving what finished.
steps.parquet and summary.parquet describe the run that wrote them: the rows it computed (num_requests),
with resumed_rows counting the rows taken from earlier runs; a run with nothing left to compute leaves
them as they are.
"""
import contextlib
import dataclasses
import logging
import math
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from engine.config import check_pool
from engine.engine import LLMEngine, RequestError
from engine.sequence import SamplingParams, Sequence
from jobs import JobError
from jobs.common import drive, run_dir, run_summary, write_run_stats
from jobs.results import ResultWriter

log = logging.getLogger("minipaged")
SAMPLE_INPUT = Path(__file__).with_name("sample_prompts.parquet")
DEFAULT_ID_COLUMN = "id"
ROW_SAMPLING_COLUMNS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Interrupted(JobError):
    """SIGINT or SIGTERM: the finished rows are saved; exit code 130 (SIGINT) or 143 (SIGTERM)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the job happens to be, like SIGINT's KeyboardInterrupt."""


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _decoded(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Dictionary-encoded columns (pandas categories) as plain values."""
    return column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column


def read_prompts(job) -> pa.Table:
    """The input table with columns id, prompt and any per-row sampling columns; JobError if unusable."""
    path = Path(job.input) if job.input else SAMPLE_INPUT
    if not path.exists():
        raise JobError(f"job.input: no such file: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise JobError(f"job.input: {path} is not a readable Parquet file ({err})") from None
    columns = table.column_names
    if job.prompt_column not in columns:
        raise JobError(f"job.prompt_column: column {job.prompt_column!r} not in {path}; columns: {columns}")
    prompts = _decoded(table[job.prompt_column])
    if not (_is_text(prompts.type) or pa.types.is_null(prompts.type)):
        raise JobError(f"job.prompt_column: column {job.prompt_column!r} in {path} holds {prompts.type}, not strings")
    prompts = prompts.cast(pa.string())
    if job.id_column is not None and job.id_column not in columns:
        raise JobError(f"job.id_column: column {job.id_column!r} not in {path}; columns: {columns} "
                       f"(leave job.id_column unset to number the rows)")
    id_column = job.id_column or (DEFAULT_ID_COLUMN if DEFAULT_ID_COLUMN in columns else None)
    if id_column is None:
        log.info("no column %r in %s: the ids are row numbers", DEFAULT_ID_COLUMN, path)
        ids = pa.chunked_array([pa.array(range(table.num_rows), pa.int64())])
    else:
        ids = _decoded(table[id_column])
        if not (pa.types.is_integer(ids.type) or _is_text(ids.type)):
            raise JobError(f"job.id_column: column {id_column!r} in {path} holds {ids.type}; ids must be integers or strings")
        if _is_text(ids.type):
            ids = ids.cast(pa.string())
        if ids.null_count:
            raise JobError(f"job.id_column: column {id_column!r} in {path} has {ids.null_count} null ids")
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))
        if len(repeated):
            raise JobError(f"job.id_column: column {id_column!r} in {path} has {len(repeated)} duplicate ids, "
                           f"e.g. {repeated.field('values')[:5].to_pylist()}")
    extra = [c for c in ROW_SAMPLING_COLUMNS if c in columns and c not in (id_column, job.prompt_column)]
    return pa.table({"id": ids, "prompt": prompts, **{c: table[c] for c in extra}})


def _coerce(column: str, value, kind):
    """A per-row value as `kind`; RequestError when it is not one (3.5 is not an int, nan not a float)."""
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        if isinstance(value, bool):
            raise ValueError
        converted = kind(value)
        if kind is float and not math.isfinite(converted):
            raise ValueError
        return converted
    except (TypeError, ValueError, OverflowError):
        raise RequestError(f"{column} {value!r} is not a valid {kind.__name__}") from None


def row_sampling(defaults: SamplingParams, row: dict) -> SamplingParams:
    """The run's sampling settings with this row's own values where it has them; RequestError if one is bad."""
    overrides = {c: _coerce(c, row[c], kind) for c, kind in ROW_SAMPLING_COLUMNS.items() if row.get(c) is not None}
    if overrides.get("max_tokens", 1) < 1:
        raise RequestError(f"max_tokens must be >= 1, got {overrides['max_tokens']}")
    if overrides.get("temperature", 0.0) < 0:
        raise RequestError(f"temperature must be >= 0, got {overrides['temperature']}")
    if not 0 < overrides.get("top_p", 1.0) <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {overrides['top_p']}")
    return dataclasses.replace(defaults, **overrides)


def default_sampling(cfg) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                          ignore_eos=s.ignore_eos, seed=s.seed, stop_token_ids=tuple(s.stop_token_ids))


def error_row(row: dict, message: str) -> dict:
    return {"id": row["id"], "prompt": row["prompt"], "output_text": None, "output_token_ids": None,
            "finish_reason": "error", "prompt_tokens": None, "output_tokens": 0, "error": message}


def result_row(seq: Sequence, prompt: str, tokenizer) -> dict:
    return {"id": seq.request_id, "prompt": prompt,
            "output_text": tokenizer.decode(seq.output_token_ids, skip_special_tokens=True),
            "output_token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_token_ids), "output_tokens": len(seq.output_token_ids), "error": None}


@contextlib.contextmanager
def _sigterm_interrupts():
    """While inside: SIGTERM raises _Terminated (a KeyboardInterrupt) so it stops the job like SIGINT."""
    def handler(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _save(writer: ResultWriter | None) -> None:
    """Best effort, on the way out of a failed run: write the rows that finished."""
    if writer is None or not writer.buffer:
        return
    try:
        writer.flush()
    except Exception as err:  # the original error matters more
        log.error("could not save %d finished rows: %s", len(writer.buffer), err)


def generate(cfg, rows: list[dict], writer: ResultWriter) -> tuple[LLMEngine, dict]:
    """Compute `rows`, handing each result (or error row) to the writer; returns the engine and counts."""
    engine = LLMEngine(cfg)
    check_pool(engine.num_blocks, engine.block_size, engine.max_model_len)
    prompts, defaults, prompt_tokens = {}, default_sampling(cfg), 0
    for row in rows:
        try:
            if row["prompt"] is None:
                raise RequestError("prompt is null")
            if not row["prompt"]:
                raise RequestError("prompt is empty")
            token_ids = engine.tokenizer.encode(row["prompt"], add_special_tokens=False)
            engine.add_request(row["id"], token_ids, row_sampling(defaults, row))
            prompts[row["id"]] = row["prompt"]
            prompt_tokens += len(token_ids)
        except RequestError as err:
            writer.add(error_row(row, str(err)))
    num_requests = len(prompts)
    output_tokens = drive(engine, num_requests,
                          lambda seq: writer.add(result_row(seq, prompts.pop(seq.request_id), engine.tokenizer)))
    return engine, {"num_requests": num_requests, "num_errors": len(rows) - num_requests,
                    "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}


def run(cfg) -> None:
    writer = None
    try:
        with _sigterm_interrupts():
            table = read_prompts(cfg.job)
            directory = run_dir()
            writer = ResultWriter(directory, table["id"].type, cfg.job.flush_every, cfg, cfg.job.flush_interval_s)
            rows = [r for r in table.to_pylist() if r["id"] not in writer.done_ids]
            resumed = table.num_rows - len(rows)
            if table.num_rows == 0:
                log.warning("job.input has no rows: writing an empty generations.parquet")
            elif resumed:
                log.info("resuming: %d of %d rows already written in %s; computing the other %d",
                         resumed, table.num_rows, writer.parts_dir, len(rows))
            if rows:
                engine, counts = generate(cfg, rows, writer)
                writer.flush()  # every row saved before the stats: a kill from here on loses no work
                summary = run_summary(engine, cfg, counts["num_requests"], counts["num_errors"],
                                      counts["prompt_tokens"], counts["output_tokens"])
                summary["resumed_rows"] = resumed
                write_run_stats(engine, cfg, directory, summary)
            else:
                log.info("nothing left to compute: steps.parquet and summary.parquet are left as they were")
            writer.finalize(table["id"])
    except KeyboardInterrupt as err:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the save short
            signal.signal(sig, signal.SIG_IGN)
        _save(writer)
        name, code = ("SIGTERM", 143) if isinstance(err, _Terminated) else ("SIGINT", 130)
        where = f"finished rows are saved in {writer.parts_dir}; run again with hydra.run.dir=" \
                f"{writer.parts_dir.parent} to resume" if writer else "nothing was saved"
        raise Interrupted(f"interrupted by {name}: {where}", code) from None
    except OUT_OF_MEMORY as err:
        _save(writer)
        raise JobError(f"out of device memory ({str(err).splitlines()[0]}); finished rows are saved: lower "
                       f"scheduler.max_num_batched_tokens or cache.gpu_memory_utilization and run again with "
                       f"the same hydra.run.dir to resume") from None
    except BaseException:
        _save(writer)
        raise
    log.info("wrote %s: %d rows", writer.final_path, table.num_rows)

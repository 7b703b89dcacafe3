"""job=generate: input rows in, result rows out, through the Python API's streaming core (LLM.stream).

Input (jobs/inputs.py): job.input, a Parquet or JSONL file, a directory or a glob (default: the sample
shipped beside this file), read in record batches; a prompt column or OpenAI batch conversations; ids from
job.id_column, column "id" or row numbers; optional per-row sampling values. Rows are turned into
requests lazily: LLM.stream pulls and tokenizes them only while its window has room, so memory is bounded
by the rows in flight and the output buffer, not by the input's size. A row that cannot run (null, empty
or non-UTF-8 prompt, too long, a bad per-row value) is written with finish_reason "error" and its message;
every other row completes.

Output (jobs/results.py): rows are saved in parts as they finish, carrying their input row number; a run
started again with the same hydra.run.dir skips the rows saved (after checking the settings and the input's
fingerprint), and the final file is written at the end in input order, one row per input row, with the
input's extra columns (job.keep_columns) beside the results: generations.parquet, or generations.jsonl in
the OpenAI batch output format (job.output_format=openai). <run dir>/.minipaged.lock is held for the whole
run: a second run on the same directory stops at once. SIGINT and SIGTERM stop the run after saving what
finished; a write that fails (a full disk, a read-only directory) stops it, keeping the parts saved before.
steps.parquet and summary.parquet describe the run that wrote them: the rows it computed (num_requests),
with resumed_rows counting the rows taken from earlier runs; a run with nothing left to compute leaves
them as they are.
"""
import contextlib
import dataclasses
import logging
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import torch

from engine.config import ConfigError
from engine.engine import RequestError
from engine.llm import LLM, Request, RequestOutput, default_sampling  # noqa: F401 (default_sampling: for the bench)
from engine.sequence import SamplingParams
from jobs import JobError
from jobs.common import Progress, run_dir, run_lock, run_summary, write_run_stats
from jobs.inputs import CHAT_URL, ROW_SAMPLING, Columns, InputFiles, check_ids, input_rows, plan_columns
from jobs.parquet import OutputError
from jobs.results import ResultWriter, generations_schema

log = logging.getLogger("minipaged")
SAMPLE_INPUT = Path(__file__).with_name("sample_prompts.parquet")
BATCH_ROWS = 1024  # input rows per record batch, read and written
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Interrupted(JobError):
    """SIGINT or SIGTERM: the finished rows are saved; exit code 130 (SIGINT) or 143 (SIGTERM)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the job happens to be, like SIGINT's KeyboardInterrupt."""


# -- rows to requests, results to rows ---------------------------------------------------------------
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


def row_sampling(defaults: SamplingParams, values: dict) -> SamplingParams:
    """The run's sampling settings with this row's own values where it has them; RequestError if one is bad."""
    overrides = {c: _coerce(c, values[c], kind) for c, kind in ROW_SAMPLING.items() if values.get(c) is not None}
    if overrides.get("max_tokens", 1) < 1:
        raise RequestError(f"max_tokens must be >= 1, got {overrides['max_tokens']}")
    if overrides.get("temperature", 0.0) < 0:
        raise RequestError(f"temperature must be >= 0, got {overrides['temperature']}")
    if not 0 < overrides.get("top_p", 1.0) <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {overrides['top_p']}")
    return dataclasses.replace(defaults, **overrides)


def to_request(row: int, fields: dict, defaults: SamplingParams) -> Request:
    """The request of one input row (jobs.inputs.input_rows); a row known to be unusable carries its error."""
    prompt = messages = error = params = None
    if "messages" in fields:
        messages = fields["messages"]
        if fields["url"] != CHAT_URL:
            error = f"url {fields['url']!r} is not supported, only {CHAT_URL}"
        elif messages is None:
            error = "body has no messages"
    elif fields["prompt"] is not None:
        try:
            prompt = fields["prompt"].decode("utf-8")
        except UnicodeDecodeError as err:
            prompt = fields["prompt"].decode("utf-8", "replace")
            error = f"prompt is not valid UTF-8 ({err.reason} at byte {err.start})"
    try:
        params = row_sampling(defaults, fields["sampling"])
    except RequestError as err:
        error = error or str(err)
    return Request(row, prompt=prompt, messages=messages, sampling_params=params, error=error)


def result_row(out: RequestOutput) -> dict:
    """A part row (jobs.results.PART_SCHEMA) from a result of LLM.stream."""
    if out.error:
        return {"row": out.request_id, "prompt": out.prompt, "output_text": None, "output_token_ids": None,
                "finish_reason": "error", "prompt_tokens": None, "output_tokens": 0, "error": out.error}
    completion = out.outputs[0]
    return {"row": out.request_id, "prompt": out.prompt, "output_text": completion.text,
            "output_token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(completion.token_ids), "error": None}


def final_batches(source: InputFiles, columns: Columns) -> Iterator[pa.RecordBatch]:
    """The input's id column (named id; row numbers without one) and carried columns, batch by batch."""
    names = ([columns.id] if columns.id else []) + columns.keep
    if not names:  # nothing to read from the input
        for lo in range(0, source.num_rows, BATCH_ROWS):
            ids = range(lo, min(lo + BATCH_ROWS, source.num_rows))
            yield pa.RecordBatch.from_pydict({"id": pa.array(ids, pa.int64())})
        return
    lo = 0
    for batch in source.batches(names, BATCH_ROWS):
        if columns.id:
            batch = batch.rename_columns(["id", *columns.keep])
        else:
            batch = batch.add_column(0, "id", pa.array(range(lo, lo + batch.num_rows), pa.int64()))
        lo += batch.num_rows
        yield batch


# -- the job -----------------------------------------------------------------------------------------
def open_input(job) -> tuple[InputFiles, Columns, pa.DataType]:
    """The input files, what each column is, and the ids' type; JobError if the input cannot be used."""
    source = InputFiles(job.input if job.input is not None else str(SAMPLE_INPUT))
    columns = plan_columns(job, source, reserved=set(generations_schema(pa.int64()).names))
    return source, columns, check_ids(source, columns.id)


def generate(llm: LLM, requests: Iterator[Request], writer: ResultWriter, total: int) -> dict:
    """Run the requests, handing each result row to the writer; returns the counts of summary.parquet."""
    counts = {"num_requests": 0, "num_errors": 0, "prompt_tokens": 0, "output_tokens": 0}
    llm.engine.stats.restart_clock()  # time the generate loop, not the set-up before it
    progress = Progress(total)
    try:
        for out in llm.stream(requests):
            row = result_row(out)
            writer.add(row)
            counts["num_errors" if out.error else "num_requests"] += 1
            counts["prompt_tokens"] += row["prompt_tokens"] or 0
            counts["output_tokens"] += row["output_tokens"]
            progress.finished(row["output_tokens"])
    finally:
        progress.close()
    return counts


def generate_job(cfg, directory: Path) -> None:
    """The job in `directory` (Hydra's run directory)."""
    job, writer = cfg.job, None
    try:
        with _sigterm_interrupts(), run_lock(directory):
            source, columns, id_type = open_input(job)
            writer = ResultWriter(directory, source.num_rows, cfg, source.fingerprint(), job.flush_every,
                                  job.flush_interval_s)
            todo = source.num_rows - writer.resumed
            if source.num_rows == 0:
                log.warning("job.input has no rows: writing an empty output")
            elif writer.resumed:
                log.info("resuming: %d of %d rows already written in %s; computing the other %d",
                         writer.resumed, source.num_rows, writer.parts_dir, todo)
            if todo:
                llm = LLM.from_config(cfg)
                if columns.openai:
                    try:
                        llm.check_chat_template()
                    except ConfigError as err:
                        raise JobError(f"job.input is an OpenAI batch (conversations), but {err}") from None
                defaults = llm.default_sampling
                requests = (to_request(row, fields, defaults) for row, fields in input_rows(source, columns, BATCH_ROWS)
                            if writer.saved[row] < 0)
                counts = generate(llm, requests, writer, todo)
                writer.flush()  # every row saved before the stats: a kill from here on loses no work
                summary = run_summary(llm.engine, cfg, **counts)
                summary["resumed_rows"] = writer.resumed
                write_run_stats(llm.engine, cfg, directory, summary)
            else:
                log.info("nothing left to compute: steps.parquet and summary.parquet are left as they were")
            final = directory / ("generations.jsonl" if job.output_format == "openai" else "generations.parquet")
            schema = generations_schema(id_type, [source.schema.field(c) for c in columns.keep])
            writer.finalize(final_batches(source, columns), final, schema, job.output_format,
                            cfg.model.path or cfg.model.name)
    except KeyboardInterrupt as err:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the save short
            signal.signal(sig, signal.SIG_IGN)
        _save(writer)
        name, code = ("SIGTERM", 143) if isinstance(err, _Terminated) else ("SIGINT", 130)
        where = f"finished rows are saved in {writer.parts_dir}; run again with hydra.run.dir=" \
                f"{directory} to resume" if writer else "nothing was saved"
        raise Interrupted(f"interrupted by {name}: {where}", code) from None
    except OutputError as err:
        _save(writer)
        kept = f"the {(writer.saved >= 0).sum()} rows saved before are kept in {writer.parts_dir}; " if writer else ""
        raise JobError(f"{err}; {kept}fix it and run again with hydra.run.dir={directory} to resume") from None
    except OUT_OF_MEMORY as err:
        _save(writer)
        raise JobError(f"out of device memory ({str(err).splitlines()[0]}); finished rows are saved: lower "
                       f"scheduler.max_num_batched_tokens or cache.gpu_memory_utilization and run again with "
                       f"the same hydra.run.dir to resume") from None
    except BaseException:
        _save(writer)
        raise
    log.info("wrote %s: %d rows", final, source.num_rows)


def run(cfg) -> None:
    generate_job(cfg, run_dir())


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

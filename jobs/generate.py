"""job=generate: input rows in, result rows out, through the Python API's streaming core (LLM.stream).

Input (jobs/inputs.py): job.input, a Parquet or JSONL file, a directory or a glob (default: the sample
shipped beside this file), read in record batches; a prompt column (text or conversations) or OpenAI batch
conversations, conversations (and text with job.chat_template=true) going through the tokenizer's chat
template; ids from job.id_column, column "id" or row numbers; optional per-row sampling values, a column
per SamplingParams field. Rows are turned into
requests lazily: LLM.stream pulls and tokenizes them only while its window has room, so memory is bounded
by the rows in flight and the output buffer, not by the input's size. A row that cannot run (null, empty
or non-UTF-8 prompt, too long, a bad per-row value) is written with finish_reason "error" and its message;
every other row completes.

Output (jobs/results.py): rows are saved in parts as they finish, carrying their input row number; a run
started again with the same hydra.run.dir skips the rows saved (after checking the settings, the input's
fingerprint and the model's: the sampling values in effect and model.path's files), and the final file is
written at the end in input order, one row per input row and sample (SamplingParams.n; all the samples of
a row are saved together, so a resume keeps exactly one of each), with the input's extra columns
(job.keep_columns) beside the results: generations.parquet, or generations.jsonl in the OpenAI batch output
format (job.output_format=openai). <run dir>/.minipaged.lock is held for the whole
run: a second run on the same directory stops at once. SIGINT and SIGTERM stop the run after saving what
finished; a write that fails (a full disk, a read-only directory) stops it, keeping the parts saved before.
steps.parquet and summary.parquet describe the run that wrote them: the rows it computed (num_requests),
with resumed_rows counting the rows taken from earlier runs; a run with nothing left to compute leaves
them as they are.
"""
import dataclasses
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import torch
from omegaconf import OmegaConf

from engine.errors import ConfigError, RequestError
from engine.generation_config import model_stop_ids, silent_eos
from engine.llm import LLM, Request, RequestOutput
from engine.outputs import CompletionOutput
from engine.sequence import SamplingParams
from engine.tokenizer import load_tokenizer
from jobs import JobError, first_line
from jobs.common import (new_counts, run_dir, run_dir_override, run_lock, signal_handlers, summary_row, tally,
                         write_stats)
from jobs.executors import execute
from jobs.inputs import (CHAT_URL, Columns, InputFiles, body_message, check_ids, input_rows, openai_sampling,
                         plan_columns)
from jobs.parquet import OutputError
from jobs.processor import Processor
from jobs.results import PART_SCHEMA, ResultWriter, generations_schema, model_fingerprint, output_names

log = logging.getLogger("minipaged")
SAMPLE_INPUT = Path(__file__).with_name("sample_prompts.parquet")
BATCH_ROWS = 1024  # input rows per record batch, read and written
FINAL_FILES = {"parquet": "generations.parquet", "openai": "generations.jsonl"}  # by job.output_format
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Interrupted(JobError):
    """SIGINT or SIGTERM: the finished rows are saved; exit code 130 (SIGINT) or 143 (SIGTERM)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the job happens to be, like SIGINT's KeyboardInterrupt."""


# -- rows to requests, results to rows ---------------------------------------------------------------
def row_sampling(defaults: SamplingParams, values: dict) -> SamplingParams:
    """The run's sampling settings with this row's own values where it has them (the input's per-row
    columns are SamplingParams' fields); RequestError naming the field if one is bad."""
    try:
        return dataclasses.replace(defaults, **values)
    except ValueError as err:
        raise RequestError(str(err)) from None


def to_request(row: int, fields: dict, defaults: SamplingParams, chat_template: bool = False) -> Request:
    """The request of one input row (jobs.inputs.input_rows); a row known to be unusable carries its error.
    chat_template: a text prompt goes through the chat template as one user message."""
    prompt = messages = error = params = None
    if "url" in fields and fields["url"] != CHAT_URL:
        error = f"url {fields['url']!r} is not supported, only {CHAT_URL}"
    if "messages" in fields:
        messages = fields["messages"]
        error = error or fields.get("error")
        if messages is None:
            error = error or ("body has no messages" if "url" in fields else "prompt is null")
    elif fields["prompt"] is not None:
        try:
            prompt = fields["prompt"].decode("utf-8")
        except UnicodeDecodeError as err:
            prompt = fields["prompt"].decode("utf-8", "replace")
            error = f"prompt is not valid UTF-8 ({err.reason} at byte {err.start})"
        if chat_template and prompt:
            messages = [{"role": "user", "content": prompt}]
    try:
        values = openai_sampling(fields["sampling"]) if "url" in fields else fields["sampling"]
        params = row_sampling(defaults, values)
    except RequestError as err:  # SamplingParams' (row_sampling): a renamed body field named as the body has it
        error = error or (body_message(str(err), fields["sampling"]) if "url" in fields else str(err))
    except ValueError as err:  # openai_sampling's, naming the body's field already
        error = error or str(err)
    return Request(row, prompt=prompt, messages=messages, sampling_params=params, error=error)


def stop_token_id(sample: CompletionOutput, eos_token_ids: frozenset[int]) -> int | None:
    """The stop id or EOS that ended the sample; None where something else did (a stop string, the length, a
    structured output's grammar completing on a token of its text)."""
    if isinstance(sample.stop_reason, int):
        return sample.stop_reason
    ended_by_eos = sample.finish_reason == "stop" and sample.stop_reason is None and sample.token_ids \
        and sample.token_ids[-1] in eos_token_ids
    return sample.token_ids[-1] if ended_by_eos else None


def result_rows(out: RequestOutput, eos_token_ids: frozenset[int] = frozenset(), logprobs_k: int | None = None,
                prompt_logprobs_k: int | None = None) -> list[dict]:
    """The part rows (jobs.results.PART_SCHEMA) of a result of LLM.stream: one per sample, or one error row;
    eos_token_ids: the model's (LLM.eos_token_ids), for stop_token_id; the k's: the request's logprobs and
    prompt_logprobs (its top entries are the last k of each position)."""
    if out.error:
        return [{"row": out.request_id, "sample_index": 0, "prompt": out.prompt, "finish_reason": "error",
                 "output_tokens": 0, "error": out.error}]
    prompt_logprobs, prompt_top = flat_logprobs(out.prompt_token_ids, out.prompt_logprobs, prompt_logprobs_k)
    rows = []
    for c in out.outputs:
        by_string = isinstance(c.stop_reason, str)
        logprobs, top = flat_logprobs(c.token_ids, c.logprobs, logprobs_k)
        rows.append({
            "row": out.request_id, "sample_index": c.index, "prompt": out.prompt, "output_text": c.text,
            "output_token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason if by_string else None,
            "stop_token_id": stop_token_id(c, eos_token_ids),
            "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(c.token_ids), "error": None,
            "reasoning": c.reasoning,
            "output_logprobs": logprobs, "top_logprobs": top, "prompt_logprobs": prompt_logprobs,
            "prompt_top_logprobs": prompt_top})
    return rows


def flat_logprobs(token_ids: list[int], positions: list | None, k: int | None) -> tuple[list | None, list | None]:
    """The API's logprobs ({token: Logprob} per position, or None) as two output columns: the logprob of
    each token (None for the first prompt token), and the k most likely [{token_id, logprob}] by rank
    (None when k is 0). A position holds its token first, then the k most likely (k + 1 entries), or k
    entries where its token is one of them."""
    if positions is None:
        return None, None
    logprobs = [None if p is None else p[t].logprob for t, p in zip(token_ids, positions)]
    if not k:
        return logprobs, None
    top = [None if p is None else [{"token_id": t, "logprob": lp.logprob}
                                   for t, lp in sorted(list(p.items())[len(p) > k:], key=lambda item: item[1].rank)]
           for p in positions]
    return logprobs, top


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
    source = InputFiles(job.input if job.input is not None else str(SAMPLE_INPUT), job.prompt_column)
    columns = plan_columns(job, source, reserved=output_names())
    return source, columns, check_ids(source, columns.id)


class GenerateProcessor(Processor):
    """job=generate's rows and results: an input row (row number, jobs.inputs.input_rows' fields) becomes a
    request (to_request), a result its part rows (result_rows, jobs.results.PART_SCHEMA)."""

    output_schema = PART_SCHEMA

    def __init__(self, job, columns: Columns, samples: int):
        self.job, self.columns = job, columns
        self.samples = samples  # each row's n, unless a row sets its own
        self.chat_template_kwargs = chat_kwargs(job, columns)
        self.reasoning_parser = job.reasoning_parser
        self.defaults: SamplingParams | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.logprobs_k: dict[int, tuple[int | None, int | None]] = {}  # rows in flight: their two k's

    def max_sequences(self, num_rows: int) -> int | None:
        return None if "n" in self.columns.sampling else num_rows * self.samples

    def setup(self, llm: LLM) -> None:
        check_chat_input(self.job, self.columns, llm.check_chat_template)
        self.defaults = llm.default_sampling
        self.eos_token_ids = llm.eos_token_ids
        if {"structured_outputs", "response_format"} & set(self.columns.sampling):  # rows may carry constraints
            llm.prepare_structured_outputs()

    def preprocess(self, key: int, fields: dict) -> Request:
        request = to_request(key, fields, self.defaults, self.job.chat_template)
        sampling = request.sampling_params or self.defaults
        self.logprobs_k[key] = (sampling.logprobs, sampling.prompt_logprobs)  # until its result comes
        return request

    def postprocess(self, out: RequestOutput) -> list[dict]:
        return result_rows(out, self.eos_token_ids, *self.logprobs_k.pop(out.request_id, (None, None)))


def generate_job(cfg, directory: Path) -> None:
    """The job in `directory` (Hydra's run directory)."""
    job, writer = cfg.job, None
    try:
        with _signals_interrupt(), run_lock(directory):
            source, columns, id_type = open_input(job)
            writer = ResultWriter(directory, source.num_rows, cfg, source.fingerprint(), job.flush_every,
                                  job.flush_interval_s, model_fingerprint(cfg))
            todo = source.num_rows - writer.resumed
            # an input without rows still starts the local engine for the run's summary (its settings); Ray's
            # engines, which report only on rows, are not started for none
            empty_run = source.num_rows == 0 and cfg.executor.name == "local"
            if source.num_rows == 0:
                log.warning("job.input has no rows: writing an empty output%s",
                            " and the run's summary" if empty_run else "")
            elif writer.resumed:
                log.info("resuming: %d of %d rows already written in %s; computing the other %d",
                         writer.resumed, source.num_rows, writer.parts_dir, todo)
            if todo or empty_run:
                compute(cfg, source, columns, writer, directory)
            elif source.num_rows:
                log.info("nothing left to compute: steps.parquet and summary.parquet are left as they were")
            final = directory / FINAL_FILES[job.output_format]
            asked = {name: cfg.sampling[name] is not None or name in columns.sampling
                     for name in ("logprobs", "prompt_logprobs")}
            schema = generations_schema(id_type, [source.schema.field(c) for c in columns.keep], **asked,
                                        reasoning=job.reasoning_parser is not None)
            tokenizer = load_tokenizer(cfg.model) if job.output_format == "openai" else None
            silent = silent_eos(model_stop_ids(cfg.model), tokenizer.eos_token_id) if tokenizer else frozenset()
            written = writer.finalize(final_batches(source, columns), final, schema, job.output_format,
                                      cfg.model.path or cfg.model.name, tokenizer if asked["logprobs"] else None,
                                      silent)
            remove_other_final_files(final)
    except KeyboardInterrupt as err:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the save short
            signal.signal(sig, signal.SIG_IGN)
        _save(writer)
        name, code = ("SIGTERM", 143) if isinstance(err, _Terminated) else ("SIGINT", 130)
        where = f"finished rows are saved in {writer.parts_dir}; run again with {run_dir_override(directory)} " \
                f"to resume" if writer else "nothing was saved"
        raise Interrupted(f"interrupted by {name}: {where}", code) from None
    except OutputError as err:
        _save(writer)
        kept = f"the {(writer.saved >= 0).sum()} rows saved before are kept in {writer.parts_dir}; " if writer else ""
        raise JobError(f"{err}; {kept}fix it and run again with {run_dir_override(directory)} to resume") from None
    except OUT_OF_MEMORY as err:
        _save(writer)
        raise JobError(f"out of device memory ({first_line(err)}); finished rows are saved: lower "
                       f"scheduler.max_num_batched_tokens or cache.gpu_memory_utilization and run again with "
                       f"the same hydra.run.dir to resume") from None
    except BaseException:
        _save(writer)
        raise
    log.info("wrote %s: %d %s", final, written, "lines" if job.output_format == "openai" else "rows")


def remove_other_final_files(final: Path) -> None:
    """Removes the final file of the other job.output_format that an earlier run left beside `final`: its rows
    are the same run's, in a format no longer asked for, and would read as current."""
    for name in set(FINAL_FILES.values()) - {final.name}:
        stale = final.with_name(name)
        if stale.exists():
            stale.unlink()
            log.info("removed %s, written by an earlier run with the other job.output_format", stale)


def compute(cfg, source: InputFiles, columns: Columns, writer: ResultWriter, directory: Path) -> None:
    """The rows no earlier run saved, through the executor, each row's results to the writer once; then
    steps.parquet and summary.parquet."""
    counts = new_counts()

    def take(rows: list[dict]) -> int:
        writer.add(*rows)
        return tally(counts, rows)

    run = execute(cfg, GenerateProcessor(cfg.job, columns, cfg.sampling.n or 1), pending_rows(source, columns, writer),
                  source.num_rows - writer.resumed, take, directory)
    writer.flush()  # every row saved before the stats: a kill from here on loses no work
    summary = summary_row(cfg.job.name, run, counts)
    summary["resumed_rows"] = writer.resumed
    write_stats(run.steps, cfg, directory, summary)


def pending_rows(source: InputFiles, columns: Columns, writer: ResultWriter) -> Iterator[tuple[int, dict]]:
    """(row number, fields) of the input rows that no earlier run saved (jobs.inputs.input_rows), in order."""
    return ((row, fields) for row, fields in input_rows(source, columns, BATCH_ROWS) if writer.saved[row] < 0)


def chat_kwargs(job, columns: Columns) -> dict | None:
    """job.chat_template_kwargs as a dict; JobError where no prompt goes through the chat template (they would
    change nothing, silently)."""
    if not job.chat_template_kwargs:
        return None
    if not (columns.conversation or job.chat_template):
        raise JobError(f"job.chat_template_kwargs is set, but no prompt goes through the chat template: "
                       f"job.prompt_column {job.prompt_column!r} holds text and job.chat_template is false (set "
                       f"job.chat_template=true to apply the template to text prompts)")
    return OmegaConf.to_container(job.chat_template_kwargs)


def check_chat_input(job, columns: Columns, check_chat_template: Callable[[], None]) -> None:
    """JobError when the input needs a chat template and check_chat_template (LLM's) finds none."""
    if columns.conversation or job.chat_template:
        try:
            check_chat_template()
        except ConfigError as err:
            raise JobError(f"{chat_input(job, columns)}, but {err}") from None


def chat_input(job, columns: Columns) -> str:
    """What makes the input need a chat template, in words."""
    if columns.openai:
        return "job.input is an OpenAI batch (conversations)"
    if columns.conversation:
        return f"job.prompt_column {job.prompt_column!r} holds conversations"
    return "job.chat_template is true"


def run(cfg) -> None:
    generate_job(cfg, run_dir())


def _signals_interrupt():
    """While inside: SIGINT raises KeyboardInterrupt and SIGTERM _Terminated (a KeyboardInterrupt), so both
    stop the job after saving what finished, also where the job was started with SIGINT ignored (a
    non-interactive shell's background command inherits that, and Python then keeps it)."""
    def terminated(signum, frame):
        raise _Terminated()

    return signal_handlers({signal.SIGINT: signal.default_int_handler, signal.SIGTERM: terminated})


def _save(writer: ResultWriter | None) -> None:
    """Best effort, on the way out of a failed run: write the rows that finished."""
    if writer is None or not writer.buffer:
        return
    try:
        writer.flush()
    except Exception as err:  # the original error matters more
        log.error("could not save %d finished rows: %s", len(writer.buffer), err)

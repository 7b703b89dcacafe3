"""job=generate: prompts from Parquet -> generations.parquet, steps.parquet, summary.parquet.

Input: job.input (default: the sample shipped beside this file) with a prompt column (job.prompt_column)
and an optional id column (job.id_column; row numbers when absent), plus optional per-row sampling
columns (max_tokens, temperature, top_p, top_k, seed). A row that cannot run is written with
finish_reason "error" and its message; every other row completes.
"""
import dataclasses
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.engine import LLMEngine, RequestError
from engine.sequence import SamplingParams, Sequence
from jobs import JobError
from jobs.common import drive, run_dir, run_summary, write_run_stats
from jobs.results import ResultWriter

log = logging.getLogger("minipaged")
SAMPLE_INPUT = Path(__file__).with_name("sample_prompts.parquet")
ROW_SAMPLING_COLUMNS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


def read_prompts(job) -> pa.Table:
    """The input table with columns id, prompt and any per-row sampling columns; JobError if unusable."""
    path = Path(job.input) if job.input else SAMPLE_INPUT
    if not path.is_file():
        raise JobError(f"job.input: no such file: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise JobError(f"job.input: {path} is not a readable Parquet file ({err})") from None
    if job.prompt_column not in table.column_names:
        raise JobError(f"job.prompt_column: column {job.prompt_column!r} not in {path}; columns: {table.column_names}")
    if job.id_column in table.column_names:
        ids = table[job.id_column]
    else:
        log.info("no id column %r in %s: ids are row numbers", job.id_column, path)
        ids = pa.array(range(table.num_rows), pa.int64())
    if pa.types.is_null(ids.type) or ids.null_count:
        raise JobError(f"job.id_column: column {job.id_column!r} has null ids")
    if len(set(ids.to_pylist())) != table.num_rows:
        duplicated = pa.compute.value_counts(ids).filter(pa.compute.greater(pa.compute.value_counts(ids).field("counts"), 1))
        raise JobError(f"job.id_column: duplicate ids in {job.id_column!r}, e.g. {duplicated.field('values')[:5].to_pylist()}")
    extra = [c for c in ROW_SAMPLING_COLUMNS if c in table.column_names]
    return pa.table({"id": ids, "prompt": table[job.prompt_column], **{c: table[c] for c in extra}})


def row_sampling(defaults: SamplingParams, row: dict) -> SamplingParams:
    """The run's sampling settings with this row's own values where it has them; RequestError if one is bad."""
    overrides = {}
    for column, kind in ROW_SAMPLING_COLUMNS.items():
        value = row.get(column)
        if value is None:
            continue
        try:
            overrides[column] = kind(value)
        except (TypeError, ValueError):
            raise RequestError(f"{column} {value!r} is not a {kind.__name__}") from None
    if overrides.get("max_tokens", 1) < 1:
        raise RequestError(f"max_tokens must be >= 1, got {overrides['max_tokens']}")
    if not 0 < overrides.get("top_p", 1.0) <= 1 or overrides.get("temperature", 0.0) < 0:
        raise RequestError("temperature must be >= 0 and top_p in (0, 1]")
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


def run(cfg) -> None:
    table = read_prompts(cfg.job)
    directory = run_dir()
    writer = ResultWriter(directory, table["id"].type, cfg.job.flush_every, cfg)
    rows = [r for r in table.to_pylist() if r["id"] not in writer.done_ids]
    if len(rows) < table.num_rows:
        log.info("resuming: %d of %d rows already written in %s", table.num_rows - len(rows), table.num_rows, directory)
    engine = LLMEngine(cfg)
    prompts, defaults, prompt_tokens = {}, default_sampling(cfg), 0
    for row in rows:
        try:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise RequestError("prompt is null or empty")
            token_ids = engine.tokenizer.encode(row["prompt"], add_special_tokens=False)
            engine.add_request(row["id"], token_ids, row_sampling(defaults, row))
            prompts[row["id"]] = row["prompt"]
            prompt_tokens += len(token_ids)
        except RequestError as err:
            writer.add(error_row(row, str(err)))
    num_errors = len(rows) - len(prompts)
    try:
        output_tokens = drive(engine, len(prompts),
                              lambda seq: writer.add(result_row(seq, prompts[seq.request_id], engine.tokenizer)))
    except KeyboardInterrupt:
        writer.flush()
        raise JobError(f"interrupted: finished rows are saved in {writer.parts_dir}; run again with "
                       f"hydra.run.dir={directory} to resume") from None
    writer.finalize()
    summary = run_summary(engine, cfg, len(prompts), num_errors, prompt_tokens, output_tokens)
    write_run_stats(engine, cfg, directory, summary)

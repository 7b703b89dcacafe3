"""Crash-safe, resumable generations output, and the final file, written without holding all the rows.

Parts. Finished rows are flushed, job.flush_every at a time (or once the oldest unsaved row is
job.flush_interval_s old), to <run dir>/generations.parts/part-NNNNNN.parquet, each written atomically
(jobs/parquet.py). A part row is the result of one sample of one input row, with its input row number
(`row`) and `sample_index`; the samples of a row are always saved in the same part, so a row is saved
whole or not at all. Ids and carried input columns are not stored: the final file takes them from the
input. Each part's metadata holds the run's config and the input's fingerprint (jobs/inputs.py).

Resume. A run started again in the same directory checks each part's settings, input fingerprint and
model fingerprint against its own, then reads the parts' `row` columns into `saved`: one int32 per input
row, the index of the part that holds it, -1 if none (4 MB for a million rows). Those rows are not
computed again; a row found in two parts keeps the first. The model fingerprint (model_fingerprint) holds
what the settings do not: the sampling values in effect (the sampling.* keys with the checkpoint's
generation_config.json defaults resolved), the dtype in effect (model.dtype auto resolved for the device)
and model.path's files (those a checkpoint is read from, loader.HUB_FILES): weights by size and mtime
(hashing gigabytes at every start would cost more than it guards), the others (config, generation config,
tokenizer, chat template) by a hash of their bytes.

Finalize. The final file is written in input order, one batch of input rows at a time: the input is read
again (id and carried columns) in batches, saved[lo:hi] names the parts that hold rows [lo, hi), each of
them is read (a small cache keeps the last few, since consecutive batches mostly share parts), its rows in
[lo, hi) are taken and sorted by (row, sample_index), and the batch goes to the output with the input's
columns beside it (repeated for each sample); the input row numbers travel beside the table, not in it,
so no carried column can take their place (nor an output column's: plan_columns leaves those out). Memory:
one batch of results and the cached parts, whatever the number of rows. The job admits rows in
input order into a bounded window, so rows finish nearly in order and a part spans a narrow range of rows;
a part holding a straggler is read once more for each batch it has rows in. The output is written to a
temporary file and renamed: generations.parquet (job.output_format=parquet) or generations.jsonl in the
OpenAI batch output format (job.output_format=openai), one line per request as `vllm run-batch` writes,
with chat-completions logprobs (choices[].logprobs.content) when they were asked for: each token's text
from the tokenizer and its bytes (for a byte-level tokenizer the token's own bytes, which a character cut
across tokens needs; else its text's UTF-8), and with job.reasoning_parser each message's
reasoning_content (generations.parquet: a reasoning column).
"""
import dataclasses
import functools
import itertools
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import decoders

from engine.engine import dtype_name
from engine.generation_config import read_generation_config, resolve_sampling
from engine.models.loader import HUB_FILES, resolve_model_path
from jobs import JobError
from jobs.common import signal_handlers
from jobs.inputs import file_hash, fingerprint_change
from jobs.parquet import (META_CONFIG, OutputError, atomic_path, flatten, remove_temporaries, schema_with_metadata,
                          write_atomic)

log = logging.getLogger("minipaged")
PART_GLOB = "part-*.parquet"
META_INPUT, META_MODEL = b"minipaged.input", b"minipaged.model"
CACHED_PARTS = 8

# The settings that decide what a row's output is: parts written under other values cannot be mixed in.
# Left out: model.device (auto/cuda name the same device), how the steps run (cache.*, scheduler.*,
# model.cpu_threads, model.enforce_eager, model.piecewise_graphs: placement, batching and launching do not
# change greedy outputs, and a smaller pool or eager steps are natural fixes to retry with), job.flush_*, and
# what only shapes the final file (job.keep_columns, job.output_format). Paths compare as the files they name.
OUTPUT_SETTINGS = ("model", "sampling", "job.input", "job.prompt_column", "job.id_column", "job.chat_template",
                   "job.chat_template_kwargs", "job.reasoning_parser")
IGNORED_SETTINGS = ("model.device", "model.cpu_threads", "model.enforce_eager", "model.piecewise_graphs")
PATH_SETTINGS = ("job.input", "model.path", "model.tokenizer")

RESULT_FIELDS = [
    ("sample_index", pa.int32()), ("prompt", pa.string()), ("output_text", pa.string()),
    ("output_token_ids", pa.list_(pa.int32())), ("finish_reason", pa.string()), ("stop_reason", pa.string()),
    ("stop_token_id", pa.int32()), ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()), ("error", pa.string()),
]
TOP_LOGPROBS = pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))
LOGPROB_FIELDS = {  # the columns of SamplingParams.logprobs and prompt_logprobs, present only when asked for
    "logprobs": [("output_logprobs", pa.list_(pa.float32())), ("top_logprobs", TOP_LOGPROBS)],
    "prompt_logprobs": [("prompt_logprobs", pa.list_(pa.float32())), ("prompt_top_logprobs", TOP_LOGPROBS)],
}
REASONING_FIELD = ("reasoning", pa.string())  # job.reasoning_parser's reasoning; in generations.parquet only with one
PART_SCHEMA = pa.schema([("row", pa.int64()), *RESULT_FIELDS, REASONING_FIELD, *sum(LOGPROB_FIELDS.values(), [])])


def generations_schema(id_type: pa.DataType, kept: list[pa.Field] = (), logprobs: bool = False,
                       prompt_logprobs: bool = False, reasoning: bool = False) -> pa.Schema:
    """generations.parquet: id, the result columns (reasoning with a reasoning parser, the logprob ones
    when asked for), then the input columns carried along."""
    asked = [*([REASONING_FIELD] if reasoning else []), *(LOGPROB_FIELDS["logprobs"] if logprobs else []),
             *(LOGPROB_FIELDS["prompt_logprobs"] if prompt_logprobs else [])]
    return pa.schema([("id", id_type), *RESULT_FIELDS, *asked, *kept])


def output_names() -> set[str]:
    """Every column name generations.parquet may have (the reasoning and logprob ones included): no carried
    input column may take one."""
    return set(generations_schema(pa.int64(), logprobs=True, prompt_logprobs=True, reasoning=True).names)


def model_fingerprint(cfg) -> dict:
    """{"sampling": the SamplingParams in effect, as JSON values; "dtype": model.dtype in effect (auto
    resolved: engine.engine.dtype_name); "files": model.path's files (HUB_FILES) by name: "<size> bytes, mtime
    <ns>" for weights, "blake2b <hash>" for the others}; no files without one."""
    path = resolve_model_path(cfg.model)
    with _quiet():  # the engine logs where each sampling value came from; once is enough
        sampling = dataclasses.asdict(resolve_sampling(cfg.sampling, read_generation_config(path)))
    sampling["top_k"] = sampling["top_k"] if sampling["top_k"] > 0 else -1  # off: -1 and 0 alike
    files = {}
    for file in sorted({f for pattern in HUB_FILES for f in path.glob(pattern)} if path else ()):
        if file.is_file():
            stat = file.stat()
            files[file.name] = f"{stat.st_size} bytes, mtime {stat.st_mtime_ns}" if file.suffix == ".safetensors" \
                else f"blake2b {file_hash(file)}"
    fingerprint = {"sampling": sampling, "dtype": dtype_name(cfg.model), "files": files}
    return json.loads(json.dumps(fingerprint))  # tuples as lists, as read back


@contextmanager
def _quiet():
    """The project's info lines left out inside."""
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def model_change(before: dict, now: dict) -> str | None:
    """How the sampling values in effect, the dtype in effect (where `before` has it: parts written since)
    and model.path's files differ from `before` (model_fingerprint's), in words; None if they do not."""
    changes = []
    sampling = _changed(before["sampling"], now["sampling"])
    if sampling:
        changes.append("the sampling values in effect changed (" + ", ".join(
            f"{k}: {before['sampling'].get(k)!r} -> {now['sampling'].get(k)!r}" for k in sampling) + ")")
    if "dtype" in before and before["dtype"] != now["dtype"]:
        changes.append(f"the model's dtype in effect changed (model.dtype: {before['dtype']} -> {now['dtype']})")
    old, new = before["files"], now["files"]
    files = _changed(old, new)
    if files:
        changes.append("model.path's files changed (" + ", ".join(
            f"{k} is new" if k not in old else f"{k} is gone" if k not in new else f"{k}: {old[k]} -> {new[k]}"
            for k in files) + ")")
    return "; ".join(changes) or None


def _in_effect(key: str, model: dict | None) -> bool:
    """Whether a part's model fingerprint (None: it has none) holds setting `key` in effect, for model_change
    to compare: then its value as set may differ (unset -> the checkpoint's value, auto -> float32 on the CPU)."""
    return model is not None and (key.startswith("sampling.") or (key == "model.dtype" and "dtype" in model))


def _changed(before: dict, now: dict) -> list:
    """The keys whose values differ (or that only one of them has), sorted."""
    return sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))


def output_settings(config: dict) -> dict:
    """The flattened settings of OUTPUT_SETTINGS from a resolved config (a plain dict), a path made absolute
    (against the working directory) where it names a local file, directory or glob."""
    flat = flatten(config)
    return {k: local_path(v) if k in PATH_SETTINGS else v for k, v in flat.items()
            if any(k == s or k.startswith(s + ".") for s in OUTPUT_SETTINGS) and k not in IGNORED_SETTINGS}


def local_path(value):
    """value as an absolute path where it is a local path (absolute, existing, or a glob); else (a hub id such
    as org/name, None) as it is."""
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    return str(path.resolve()) if path.is_absolute() or path.exists() or any(c in value for c in "*?[") else value


class ResultWriter:
    """The parts of a run directory: resumed from, added to, merged into the final file. fingerprint: the
    input's (jobs.inputs), model: model_fingerprint's; None leaves that check out."""

    def __init__(self, run_dir: Path, num_rows: int, cfg=None, fingerprint: list | None = None,
                 flush_every: int = 256, flush_interval_s: float = 0.0, model: dict | None = None):
        self.parts_dir = run_dir / "generations.parts"
        self.cfg, self.fingerprint, self.model = cfg, fingerprint, model
        self.flush_every, self.flush_interval_s = flush_every, flush_interval_s
        self.buffer: list[dict] = []
        self._oldest = 0.0  # when the oldest buffered row was added
        self.parts: list[Path] = []
        self.saved = np.full(num_rows, -1, np.int32)  # input row -> index in self.parts of the part holding it
        if self.parts_dir.is_dir():
            self._load_parts()
        self.resumed = int((self.saved >= 0).sum())  # rows computed by earlier runs
        self._next = 1 + max((int(p.stem.split("-")[1]) for p in self.parts), default=-1)

    def _load_parts(self) -> None:
        remove_temporaries(self.parts_dir)  # a part being written when a run was killed
        self.parts = sorted(p for p in self.parts_dir.glob(PART_GLOB) if p.stem.split("-")[1].isdigit())
        current = output_settings(_plain(self.cfg)) if self.cfg is not None else None
        for index, part in enumerate(self.parts):
            try:
                schema = pq.read_schema(part)
                rows = pq.read_table(part, columns=["row"])["row"].to_numpy()
            except (pa.ArrowInvalid, OSError) as err:
                raise JobError(f"cannot read {part} ({err}); delete it to compute its rows again") from None
            except KeyError:
                schema = None
            lacking = [name for name in PART_SCHEMA.names if schema is None or name not in schema.names]
            if lacking:
                raise JobError(f"{part} has no column {lacking[0]} (written by an older MiniPaged): use a new "
                               f"hydra.run.dir")
            self._check_same_run(part, schema.metadata or {}, current)
            if len(rows) and (rows.min() < 0 or rows.max() >= len(self.saved)):
                raise JobError(f"{part} holds row {rows.max()}, the input has {len(self.saved)} rows: not the "
                               f"same input; use a new hydra.run.dir")
            fresh = rows[self.saved[rows] < 0]
            self.saved[fresh] = index

    def _check_same_run(self, part: Path, metadata: dict, current: dict | None) -> None:
        """JobError if the part was written with other output settings, from another input or with other
        sampling values or dtype in effect or model files."""
        run_dir = self.parts_dir.parent
        model = json.loads(metadata[META_MODEL]) if self.model is not None and META_MODEL in metadata else None
        if current is not None:
            before = output_settings(json.loads(metadata.get(META_CONFIG, b"{}")))
            changed = sorted(k for k in before.keys() & current.keys()
                             if before[k] != current[k] and not _in_effect(k, model))
            if changed:
                diff = ", ".join(f"{k}: {before[k]!r} -> {current[k]!r}" for k in changed[:5])
                raise JobError(f"{run_dir} holds rows generated with other settings ({diff}); "
                               f"run with the same settings to resume, or use a new hydra.run.dir")
        if self.fingerprint is not None and META_INPUT in metadata:
            change = fingerprint_change(json.loads(metadata[META_INPUT]), self.fingerprint)
            if change:
                raise JobError(f"job.input: {change} since the rows in {run_dir} were generated from it; resuming "
                               f"would mix two inputs: restore it or use a new hydra.run.dir")
        if model is not None:
            change = model_change(model, self.model)
            if change:
                raise JobError(f"{change} since the rows in {run_dir} were generated: resuming would mix rows of two "
                               f"configurations; restore them or use a new hydra.run.dir")

    def add(self, *rows: dict) -> None:
        """Buffer the result rows of one input row (PART_SCHEMA's fields, one per sample), then flush when
        flush_every or flush_interval_s says so: the samples of a row are saved in the same part."""
        if not self.buffer:
            self._oldest = time.monotonic()
        self.buffer.extend(rows)
        if len(self.buffer) >= self.flush_every or (
                self.flush_interval_s and time.monotonic() - self._oldest >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next part (atomically). SIGINT and SIGTERM wait until the part and
        the bookkeeping are both done: raised in between, the interrupt would leave the part written and its
        rows still buffered, and the save on the way out would write them a second time."""
        if not self.buffer:
            return
        with _signals_deferred():
            self._write_part()

    def _write_part(self) -> None:
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputError(f"cannot write {self.parts_dir}: {err.strerror or err}") from None
        path = self.parts_dir / f"part-{self._next:06d}.parquet"
        extra = {key: json.dumps(value).encode()
                 for key, value in ((META_INPUT, self.fingerprint), (META_MODEL, self.model)) if value is not None}
        table = pa.Table.from_pylist(self.buffer, schema=PART_SCHEMA)
        write_atomic(table, path, self.cfg, extra)
        self._next += 1
        self.parts.append(path)
        rows = table["row"].to_numpy()
        self.saved[rows[self.saved[rows] < 0]] = len(self.parts) - 1
        self.buffer = []

    def missing(self) -> np.ndarray:
        """Input rows with no saved result (after a flush)."""
        return np.flatnonzero(self.saved < 0)

    def results(self, input_batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[np.ndarray, pa.Table]]:
        """Per input batch, in input order, one row per input row and sample: the input row numbers, and a
        table of the batch's id, the result columns from the parts and the batch's other (carried) columns,
        repeated for each sample. JobError if a row has no result."""
        self.flush()
        missing = self.missing()
        if missing.size:
            raise JobError(f"no result for {missing.size} rows, e.g. input rows {missing[:5].tolist()}; run "
                           f"again to compute them")
        read = functools.lru_cache(CACHED_PARTS)(lambda index: pq.read_table(self.parts[index], schema=PART_SCHEMA))
        lo = 0
        for batch in input_batches:
            hi = lo + batch.num_rows
            if hi > len(self.saved):
                lo = hi
                break
            results = self._rows(lo, hi, read)
            rows = results["row"].to_numpy()
            inputs = batch.take(pa.array(rows - lo))
            carried = [c for c in batch.schema.names if c != "id"]
            result_names = [name for name in PART_SCHEMA.names if name != "row"]
            yield rows, pa.Table.from_arrays(
                [inputs.column("id"), *(results[name] for name in result_names), *(inputs.column(c) for c in carried)],
                ["id", *result_names, *carried])
            lo = hi
        if lo != len(self.saved):
            raise JobError(f"job.input changed during the run: it no longer has the {len(self.saved)} rows it had")

    def _rows(self, lo: int, hi: int, read: Callable[[int], pa.Table]) -> pa.Table:
        """The saved results of input rows [lo, hi), in row order."""
        where = self.saved[lo:hi]
        pieces = []
        for index in np.unique(where):
            part = read(int(index))
            rows = part["row"].to_numpy()
            take = np.flatnonzero((rows >= lo) & (rows < hi))
            take = take[where[rows[take] - lo] == index]
            samples = np.stack([rows[take], part["sample_index"].to_numpy()[take]], axis=1)
            _, first = np.unique(samples, axis=0, return_index=True)  # a sample twice in one part: the first
            pieces.append(part.take(take[first]))
        table = pa.concat_tables(pieces) if pieces else PART_SCHEMA.empty_table()
        return table.take(np.lexsort((table["sample_index"].to_numpy(), table["row"].to_numpy())))

    def finalize(self, input_batches: Iterator[pa.RecordBatch], path: Path, schema: pa.Schema,
                 output_format: str = "parquet", model: str = "", tokenizer=None,
                 silent_eos: frozenset[int] = frozenset()) -> int:
        """Write the final file at `path` (atomically), in input order: one row per input row and sample
        (Parquet), or one line per input row with a choice per sample (OpenAI; `tokenizer` names the tokens
        of the logprobs, needed when the schema has them; silent_eos, the EOS ids whose stop has a null
        stop_reason: engine.generation_config.silent_eos). Returns the rows (lines) written."""
        written = 0
        with atomic_path(path) as tmp:
            if output_format == "openai":
                created, pieces = int(time.time()), TokenPieces(tokenizer) if tokenizer is not None else None
                batch = uuid.uuid4().hex[:12]
                with open(tmp, "w", encoding="utf-8") as out:
                    for rows, table in self.results(input_batches):
                        samples = table.select([n for n in schema.names if n in OPENAI_FIELDS]).to_pylist()
                        lines = [json.dumps(openai_line(int(row), [s for _, s in group], model, created, pieces,
                                                              silent_eos, batch)) + "\n"
                                 for row, group in itertools.groupby(zip(rows, samples), lambda r: r[0])]
                        out.writelines(lines)
                        written += len(lines)
            else:
                with pq.ParquetWriter(tmp, schema_with_metadata(schema, self.cfg)) as out:
                    for _, table in self.results(input_batches):
                        out.write_table(table.select(schema.names).cast(schema))
                        written += table.num_rows
        return written


@contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM are held (not lost) inside the block and raised again when it is left. Held by
    Python handlers that only note them: a signal mask holds them for one thread only, and the kernel hands
    a process's signal to any thread that does not block it (Ray's, pyarrow's), after which Python raises
    it in the main thread all the same. Off the main thread a plain block: Python runs its handlers, and so
    raises KeyboardInterrupt, only in the main thread."""
    noted = []
    try:
        with signal_handlers({s: lambda signum, _frame: noted.append(signum) for s in (signal.SIGINT, signal.SIGTERM)}):
            yield
    finally:
        for s in noted:
            signal.raise_signal(s)


# the result columns an OpenAI output line is made of
OPENAI_FIELDS = ("id", "sample_index", "output_text", "output_token_ids", "finish_reason", "stop_reason",
                 "stop_token_id", "prompt_tokens", "output_tokens", "error", "reasoning", "output_logprobs",
                 "top_logprobs")


class TokenPieces:
    """A token id's text (the tokenizer's decode of it alone) and bytes, cached. The bytes of a byte-level
    BPE token (GPT-2's alphabet: Qwen, Llama 3, the tiny model) are its own, from its characters; of an
    added token or another tokenizer's, its text's UTF-8."""

    def __init__(self, tokenizer):
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # slow to import; few jobs need it

        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_of = {c: b for b, c in bytes_to_unicode().items()} \
            if backend is not None and isinstance(backend.decoder, decoders.ByteLevel) else None
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self.cache:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            own = self.byte_of is not None and token_id not in self.added and all(c in self.byte_of for c in piece)
            self.cache[token_id] = text, [self.byte_of[c] for c in piece] if own else list(text.encode("utf-8"))
        return self.cache[token_id]


def openai_logprobs(sample: dict, pieces: TokenPieces) -> dict:
    """A choice's chat-completions logprobs: {"content": per output token {token, logprob, bytes,
    top_logprobs: the k most likely, each {token, logprob, bytes}}}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = pieces(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    tops = sample["top_logprobs"] or [None] * len(sample["output_logprobs"])
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(x["token_id"], x["logprob"]) for x in top or ()]}
                        for t, lp, top in zip(sample["output_token_ids"], sample["output_logprobs"], tops)]}


def openai_message(sample: dict) -> dict:
    """A choice's assistant message: the content, and with a reasoning parser (a sample with a reasoning
    field, null where the output had none) its reasoning_content, as vLLM's server writes it."""
    message = {"role": "assistant", "content": sample["output_text"]}
    if "reasoning" in sample:
        message["reasoning_content"] = sample["reasoning"]
    return message


def openai_line(row_number: int, samples: list[dict], model: str, created: int,
                pieces: TokenPieces | None = None, silent_eos: frozenset[int] = frozenset(), batch: str = "") -> dict:
    """One line of an OpenAI batch output file (the shape `vllm run-batch` writes) from the result rows of
    one input row (a choice per sample), with ids made from `batch` (the file's own token, so that two runs'
    ids differ) and the input row number; logprobs where the samples have them (`pieces` names their
    tokens). stop_reason as vLLM's: the stop string or stop id, null for an EOS of silent_eos."""
    first = samples[0]
    tag = f"{batch}-{row_number}" if batch else str(row_number)
    head = {"id": f"minipaged-{tag}", "custom_id": str(first["id"])}
    request_id = f"minipaged-batch-{tag}"
    if first["finish_reason"] == "error":
        return {**head, "response": {"status_code": 400, "request_id": request_id, "body": None},
                "error": first["error"]}
    completion = sum(s["output_tokens"] for s in samples)
    usage = {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
             "total_tokens": first["prompt_tokens"] + completion}
    choices = [{"index": s["sample_index"], "message": openai_message(s),
                "logprobs": openai_logprobs(s, pieces) if s.get("output_logprobs") is not None else None,
                "finish_reason": s["finish_reason"],
                "stop_reason": s["stop_reason"] if s["stop_reason"] is not None else
                None if s["stop_token_id"] in silent_eos else s["stop_token_id"]}
               for s in samples]
    body = {"id": f"chatcmpl-{tag}", "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}
    return {**head, "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)

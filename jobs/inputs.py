"""job.input: where the rows come from, what each column is, and the input's fingerprint.

job.input names a Parquet file, a JSONL file (*.jsonl or *.ndjson, in any case, or compressed: *.jsonl.gz,
*.jsonl.zst, *.jsonl.zstd), a directory (every such file below it; names starting with "." or "_" are skipped, as Spark
and pyarrow do) or a glob (`data/part-*.parquet`). The files are read in sorted path order as one table,
in record batches, and the rows are numbered across them (row numbers are what the saved results refer
to). All files of one input share one format (JSONL, compressed or not, or Parquet). Their schemas are
unified: a column absent from a file is null there, integers widen to floats; a column whose types clash
stops the job, naming the file, unless it holds a per-row value (row_value: a sampling column, a field of an
OpenAI body): a JSONL first pass that meets one of two JSON types (a number in some rows, a string in others;
a number in a list of strings; two rows' tools of other shapes) starts again reading that value as its JSON
text in every row, so that each row's value reaches SamplingParams (or openai_sampling) as written and a row
whose value is of the wrong type is an error row (_MixedValues). A file that is neither says what it is
(empty, compressed, text, ...).

JSONL is read in chunks of whole lines (CHUNK_BYTES, or one line when it is longer: each chunk is parsed
as one block, so a line of any length reads). A first pass parses every chunk to infer one schema for the
whole input (pyarrow's streaming reader fixes the schema from its first block, so a field that is missing
or null in the first lines would fail later); the later passes parse each chunk again with it. A file
without a line adds no rows and no columns. Message contents: OpenAI's format allows a list of parts
([{"type": "text", "text": ...}, ...]) in place of a string, and a JSON column holds one type: when the
first pass finds a list content anywhere, it starts again with every string content of body.messages
(and of the prompt column's conversations) read as one text part, so that both kinds of line share a type.
Memory: one chunk or record batch at a time, plus the id column while the ids are checked.

Columns. A text input has a prompt column (job.prompt_column; string, binary decoded as UTF-8 row by
row, or a conversation: a list of structs with fields role and content), an id column (job.id_column;
unset: column "id" when present, else row numbers) and optional per-row sampling columns, one per
SamplingParams field (ROW_SAMPLING: max_tokens, temperature, stop, n, ...). An OpenAI batch input (columns
custom_id and body, body holding messages: `vllm run-batch`'s input) gives conversations: custom_id is the
id, body.messages the conversation, body's other fields the per-row sampling values (openai_sampling); a
url other than /v1/chat/completions is an error row. A message's content is a string or a list of text
parts, joined with newlines as vLLM joins them; a part of another type makes its row an error row. Every
other input column is carried to generations.parquet (job.keep_columns: null for all, or a list), except
those named like an output column (the per-row sampling columns included: they are read as values).
Decimal values become ints when whole, else floats (int() would cut a decimal 2.5 to 2).

Fingerprint (for resuming): per file, its path, size and BLAKE2b hash of every byte. A resume compares it
with the one saved with the results and names the file that differs. Hashing reads the input once more
per start (about a second per GB, small beside generating from it); size and mtime would miss a rewrite
of the same size, and a hash of the Parquet footer would miss an edit that keeps the sizes and
statistics (one letter of an uncompressed prompt). A copy or a touch that keeps the bytes is no change.
"""
import dataclasses
import decimal
import difflib
import glob
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from engine.llm import joined_text
from engine.sequence import FIELD_KINDS, SamplingParams
from jobs import JobError, first_line

log = logging.getLogger("minipaged")
CHUNK_BYTES = 1 << 20
DEFAULT_ID_COLUMN = "id"
ROW_SAMPLING = [f.name for f in dataclasses.fields(SamplingParams)]  # per-row columns: every sampling field
INT_SAMPLING = [name for name, (element, many, _) in FIELD_KINDS.items() if element is int and not many]
EXACT_INTS = pa.decimal128(38, 0)  # every 64-bit int (a seed takes -2^63 to 2^64 - 1), exactly
INT64 = (-2**63, 2**63 - 1)  # the ids' range
UNIFORM_KEYS = re.compile(rb'"(structured_outputs|response_format|stop)"')  # JSONL lines that uniform_values rewrites
# fields of body that are not sampling values: the model (the job's), the messages, and those of OpenAI's request
# that do not change what is generated (a user or metadata tag, storage, streaming: a batch answers whole)
OPENAI_IGNORED = ("model", "messages", "user", "metadata", "store", "service_tier", "stream", "stream_options",
                  "parallel_tool_calls", "prediction")
# fields of OpenAI's request that would change what is generated and that the engine does not do: an error row
OPENAI_UNSUPPORTED = ("logit_bias", "tools", "tool_choice", "functions", "function_call", "reasoning_effort",
                      "audio", "modalities", "web_search_options")
CHAT_URL = "/v1/chat/completions"
JSONL_CODECS = {f"{kind}{suffix}": codec for kind in (".jsonl", ".ndjson")  # by name, in any case
                for suffix, codec in (("", None), (".gz", "gzip"), (".zst", "zstd"), (".zstd", "zstd"))}
PART_LISTS = re.compile(rb'"content"\s*:\s*\[')  # a message content given as a list of parts
MAGIC = {b"\x1f\x8b": "gzip-compressed (a gzip-compressed JSONL file must be named *.jsonl.gz)",
         b"\x28\xb5\x2f\xfd": "zstd-compressed (a zstd-compressed JSONL file must be named *.jsonl.zst)",
         b"BZh": "bzip2-compressed, which is not supported (recompress it as *.jsonl.gz or *.jsonl.zst)",
         b"\xfd7zXZ": "xz-compressed, which is not supported (recompress it as *.jsonl.gz or *.jsonl.zst)",
         b"PK\x03\x04": "a zip archive, which is not supported (unpack it)"}


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _plain_type(kind: pa.DataType) -> pa.DataType:
    """Dictionary-encoded columns (pandas categories) read as their values."""
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def is_jsonl(path: Path) -> bool:
    return any(path.name.lower().endswith(suffix) for suffix in JSONL_CODECS)


def jsonl_codec(path: Path) -> str | None:
    """The compression of a JSONL file, from its name (None: plain)."""
    return next(codec for suffix, codec in JSONL_CODECS.items() if path.name.lower().endswith(suffix))


def what_file(path: Path) -> str:
    """What a file that is not readable Parquet holds, from its first bytes, in words."""
    with open(path, "rb") as f:
        head = f.read(256)
    if not head:
        return "it is empty (0 bytes)"
    kind = next((what for magic, what in MAGIC.items() if head.startswith(magic)), None)
    if kind:
        return f"it is {kind}"
    try:
        first = head.decode("utf-8").splitlines()[0]
    except UnicodeDecodeError:
        return f"it starts with bytes {head[:8]!r}, neither Parquet nor JSONL"
    if first.lstrip().startswith("{"):
        return "it looks like JSONL: name it *.jsonl"
    return f"it is text starting {first[:40]!r}, neither Parquet nor JSONL"


def resolve_paths(spec: str) -> list[Path]:
    if not spec.strip():  # Path("") is the working directory: never read it by accident
        raise JobError("job.input is empty")
    if any(c in spec for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not paths:
            raise JobError(f"job.input: no file matches {spec}")
        return paths
    root = Path(spec)
    if root.is_dir():
        paths = sorted(p for p in root.rglob("*") if (p.suffix == ".parquet" or is_jsonl(p)) and p.is_file()
                       and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts))
        if not paths:
            raise JobError(f"job.input: no *.parquet or *.jsonl file in directory {root} (nor *.jsonl.gz, "
                           f"*.jsonl.zst, *.jsonl.zstd)")
        return paths
    if not root.is_file():
        raise JobError(f"job.input: no such file: {root}")
    return [root]


def file_hash(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def fingerprint_change(before: list, now: list) -> str | None:
    """How the input files differ from when `before` was taken, naming a file; None if they do not. A file is
    the one its path names: a relative path (against the working directory) and the absolute one are one file."""
    old = {os.path.realpath(path): (path, size, digest) for path, size, digest in before}
    new = {os.path.realpath(path): (path, size, digest) for path, size, digest in now}
    for key, (path, size, digest) in new.items():
        if key not in old:
            return f"{path} is new"
        if old[key][1:] != (size, digest):
            how = f"{old[key][1]} -> {size} bytes" if old[key][1] != size else "same size, other bytes"
            return f"{path} changed ({how})"
    gone = sorted(old[key][0] for key in old.keys() - new.keys())
    return f"{gone[0]} is gone" if gone else None


class _PartLists(Exception):
    """The first pass over JSONL met a message content that is a list of parts: start again, reading
    every content as a list."""


class _MixedValues(Exception):
    """The first pass over JSONL met a per-row value (row_value) given as two JSON types (a number in some
    rows, a string in others): start again, reading that value as its JSON text in every row (json_text_values),
    so that each row's value is read as written and a row whose value is of the wrong type is an error row,
    not the whole input."""

    def __init__(self, path: tuple[str, ...], message: str):
        super().__init__(message)
        self.path = path


class InputFiles:
    """The files of job.input read as one table: `schema` (unified), `num_rows`, `batches()`.
    conversation_column: the column whose conversations' string contents become text parts when the
    input also has contents that are lists of parts (as body.messages' do)."""

    def __init__(self, spec: str, conversation_column: str | None = None):
        self.paths = resolve_paths(spec)
        self.format = "jsonl" if is_jsonl(self.paths[0]) else "parquet"
        mixed = [p for p in self.paths if is_jsonl(p) != (self.format == "jsonl")]
        if mixed:
            raise JobError(f"job.input: {spec} mixes JSONL and Parquet files ({self.paths[0]}, {mixed[0]})")
        self.conversation_column, self.content_as_parts = conversation_column, False
        self.json_text: set[tuple[str, ...]] = set()  # per-row values read as JSON text (_MixedValues)
        while True:  # each restart reads one more thing differently: at most 1 + the per-row values
            try:
                self._scan()
                break
            except _PartLists:
                self.content_as_parts = True
            except _MixedValues as mixed:
                if mixed.path in self.json_text:
                    raise JobError(str(mixed)) from None
                log.warning("%s: each row's value is read as written (a row whose value is of the wrong type is an "
                            "error row)", mixed)
                self.json_text.add(mixed.path)

    def _scan(self) -> None:
        """Set the unified schema (no columns for JSONL files without a line) and the number of rows."""
        self.schema, self.num_rows = None, 0
        for path, schema, num_rows in (self._scan_parquet() if self.format == "parquet" else self._scan_jsonl()):
            names = schema.names
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise JobError(f"job.input: {path} has duplicate column names {repeated}")
            try:
                self.schema = schema if self.schema is None else pa.unify_schemas([self.schema, schema],
                                                                                   promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
                message = f"job.input: the column types of {path} clash with the rows before it ({first_line(err)})"
                value = clashing_value(self.schema, schema) if self.format == "jsonl" else None
                if value is not None:
                    raise _MixedValues(value, message) from None
                raise JobError(message) from None
            self.num_rows += num_rows
        if self.schema is None:
            self.schema = pa.schema([])

    def _scan_parquet(self):
        for path in self.paths:
            try:
                meta = pq.read_metadata(path)
            except (pa.ArrowException, OSError) as err:
                raise _not_parquet(path, err) from None
            yield path, meta.schema.to_arrow_schema(), meta.num_rows

    def _scan_jsonl(self):
        for path in self.paths:
            for table in self._jsonl_tables(path, None):
                yield path, table.schema, table.num_rows

    def _jsonl_tables(self, path: Path, schema: pa.Schema | None, exact: list[str] = INT_SAMPLING
                      ) -> Iterator[pa.Table]:
        """The file's chunks of whole lines that hold rows, parsed (with `schema` when given; else with the
        columns of `exact` and the bodies' integer fields read exactly: _exact_ints)."""
        options = pj.ParseOptions(explicit_schema=schema) if schema is not None else None
        line = 1
        try:
            with pa.input_stream(str(path), compression=jsonl_codec(path)) as stream:
                for chunk in line_chunks(stream):
                    lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
                    if UNIFORM_KEYS.search(chunk):
                        chunk = uniform_values(chunk)
                    if self.json_text:
                        chunk = json_text_values(chunk, self.json_text)
                    if self.content_as_parts:
                        chunk = contents_as_parts(chunk, self.conversation_column)
                    elif schema is None and PART_LISTS.search(chunk):
                        raise _PartLists()
                    table = _parse_jsonl(chunk, options, path, line, lines)
                    if schema is None:
                        table = _exact_ints(chunk, table, exact)
                    if table.num_rows:
                        yield table
                    line += lines
        except OSError as err:
            raise JobError(f"job.input: cannot read {path} ({err.strerror or err})") from None

    def batches(self, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        """Record batches of at most batch_size rows with `columns` (of the unified schema), in row order."""
        if not self.num_rows:  # columns of JSONL files without a line are not in the (empty) schema
            return
        schema = pa.schema([self.schema.field(c) for c in columns])
        for path in self.paths:
            pieces = self._jsonl_batches(path, columns) if self.format == "jsonl" else \
                self._parquet_batches(path, columns, batch_size)
            for piece in pieces:
                for start in range(0, piece.num_rows, batch_size):
                    yield _conform(piece.slice(start, batch_size), schema)

    def _jsonl_batches(self, path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
        for table in self._jsonl_tables(path, self.schema):
            yield from table.select(columns).to_batches()

    @staticmethod
    def _parquet_batches(path: Path, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        try:
            with pq.ParquetFile(path) as parquet:
                present = [c for c in columns if c in parquet.schema_arrow.names]
                yield from parquet.iter_batches(batch_size=batch_size, columns=present)
        except (pa.ArrowException, OSError) as err:
            raise _not_parquet(path, err) from None

    def first_beyond_int64(self, column: str) -> tuple[Path, int, int] | None:
        """(file, row, value) of the first integer of JSONL column `column` beyond the 64-bit range, the
        column read again exactly (pyarrow reads a column that holds one as floats, rounded); None if there is
        none (or a value is not whole)."""
        row = 0
        for path in self.paths:
            for table in self._jsonl_tables(path, None, exact=[column]):
                exact = column in table.schema.names and table.schema.field(column).type == EXACT_INTS
                values = table.column(column).to_pylist() if exact else []
                beyond = next((i for i, v in enumerate(values) if v is not None and not INT64[0] <= v <= INT64[1]),
                              None)
                if beyond is not None:
                    return path, row + beyond, int(values[beyond])
                row += table.num_rows
        return None

    def fingerprint(self) -> list:
        try:
            return [[str(p.resolve()), p.stat().st_size, file_hash(p)] for p in self.paths]
        except OSError as err:
            raise JobError(f"job.input: cannot read {err.filename} ({err.strerror})") from None


def _not_parquet(path: Path, err: Exception) -> JobError:
    """The error for a file of a Parquet input that pyarrow cannot read: pyarrow's reason for a Parquet file
    (its magic bytes are there), else what the file is."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        reason = first_line(err) if magic == b"PAR1" else what_file(path)
    except OSError as read_err:
        reason = read_err.strerror or str(read_err)
    return JobError(f"job.input: {path} is not a readable Parquet file ({reason})")


def line_chunks(stream) -> Iterator[bytes]:
    """The stream's bytes in chunks of whole lines: CHUNK_BYTES read at a time, cut after the last newline
    (a line longer than that makes its chunk longer). The last chunk may lack the final newline."""
    pending = bytearray()
    while block := stream.read(CHUNK_BYTES):
        cut = block.rfind(b"\n") + 1
        if not cut:
            pending += block
            continue
        yield bytes(pending + block[:cut])
        pending = bytearray(block[cut:])
    if pending:
        yield bytes(pending)


def _parse_jsonl(chunk: bytes, options: pj.ParseOptions | None, path: Path, line: int, lines: int) -> pa.Table:
    """A chunk of whole lines (lines of them, the first the file's line `line`) read by _read_chunk; JobError
    naming the file and the line when it is not JSONL."""
    where = f"{path}, lines {line}-{line + lines - 1}"
    try:
        return _read_chunk(chunk, options)
    except pa.ArrowInvalid as err:
        twice = re.search(r"Column\(/(.*)\) was specified twice", str(err))
        changed = re.search(r"Column\(/(.*)\) changed from (\w+) to (\w+)", str(err))
        repeated = twice[1] if twice else _repeated_key(chunk) if changed else None
        if repeated:
            raise JobError(f"job.input: {where} has a duplicate column name: key {repeated!r} "
                           f"twice in one row") from None
        if changed:
            message = f"job.input: {where}: column {changed[1]!r} holds both {changed[2]} and {changed[3]} values"
            value = row_value(tuple(changed[1].split("/")))
            if options is None and value is not None:
                raise _MixedValues(value, message) from None
            raise JobError(message) from None
        bad = _first_bad_line(chunk)
        if bad is not None:
            raise JobError(f"job.input: {path}, line {line + bad[0]} is not a JSON object ({bad[1]})") from None
        raise JobError(f"job.input: {where} is not readable JSONL ({first_line(err)})") from None


def _read_chunk(chunk: bytes, options: pj.ParseOptions | None) -> pa.Table:
    """The chunk's lines as one block (pyarrow's default block of 1 MiB stops at a longer line)."""
    return pj.read_json(io.BytesIO(chunk), read_options=pj.ReadOptions(block_size=len(chunk) + 1),
                        parse_options=options)


def _exact_ints(chunk: bytes, table: pa.Table, names: list[str]) -> pa.Table:
    """table, with each of its columns of `names` (the integer sampling columns: a seed, top_k, ...) and each
    integer field of its OpenAI bodies (BODY_INTS: body.seed, body.max_completion_tokens, ...) that came out as
    floats read again as EXACT_INTS: pyarrow makes a column of floats when one of its ints exceeds int64 (a
    seed of 2^63 or more), which rounds every int of 2^53 or more. A column with a value that is not whole stays
    floats (its row's error names it), each column on its own. The unified schema keeps EXACT_INTS where every
    file's chunks have it or int64."""
    for name in _float_fields(table.schema, names):
        exact = _exact_column(chunk, name, EXACT_INTS)
        if exact is not None:
            table = table.set_column(table.schema.get_field_index(name), name, exact)
    body = table.schema.field("body").type if "body" in table.schema.names else None
    for name in _float_fields(body, BODY_INTS) if body is not None and pa.types.is_struct(body) else []:
        exact = _exact_column(chunk, "body", pa.struct([(name, EXACT_INTS)]))
        if exact is not None:
            table = table.set_column(table.schema.get_field_index("body"), "body",
                                     _with_field(table.column("body"), name, pc.struct_field(exact, name)))
    return table


def _float_fields(fields, names: list[str]) -> list[str]:
    """The fields of `fields` (a schema or a struct type) named in `names` whose values are floats."""
    return [f.name for f in fields if f.name in names and pa.types.is_floating(f.type)]


def _exact_column(chunk: bytes, name: str, kind: pa.DataType) -> pa.ChunkedArray | None:
    """Column `name` of the chunk read again as `kind`; None where a value does not fit it (not whole)."""
    try:
        return _read_chunk(chunk, pj.ParseOptions(explicit_schema=pa.schema([(name, kind)]))).column(name)
    except pa.ArrowInvalid:
        return None


def _with_field(structs: pa.ChunkedArray, name: str, values: pa.ChunkedArray) -> pa.ChunkedArray:
    """The struct column with its field `name` replaced by `values` (same rows), in its place."""
    whole = structs.combine_chunks()
    fields = [pa.field(name, values.type) if f.name == name else f for f in whole.type]
    children = [values.combine_chunks() if f.name == name else child for f, child in zip(whole.type, whole.flatten())]
    return pa.chunked_array([pa.StructArray.from_arrays(children, fields=fields, mask=whole.is_null())])


def row_value(path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The per-row value that a JSON path of an input line is in (a list's elements are "[]", a struct's fields
    their names): a top-level SamplingParams field, or a field of an OpenAI body other than its messages (its
    sampling values, and those openai_sampling ignores or refuses, whose insides rows need not agree on:
    each row's tools); None for any other path."""
    if path[0] in ROW_SAMPLING:
        return path[:1]
    return path[:2] if len(path) >= 2 and path[0] == "body" and path[1] != "messages" else None


def clashing_value(first: pa.Schema, second: pa.Schema) -> tuple[str, ...] | None:
    """The path of a per-row value (row_value) whose types in two chunks' schemas do not unify (an int in one
    chunk, a string in another), if any."""
    for name in (n for n in first.names if n in second.names):
        a, b = first.field(name).type, second.field(name).type
        pairs = [((name,), a, b)]
        if name == "body" and pa.types.is_struct(a) and pa.types.is_struct(b):
            pairs = [(("body", a.field(i).name), a.field(i).type, b.field(b.get_field_index(a.field(i).name)).type)
                     for i in range(a.num_fields) if b.get_field_index(a.field(i).name) >= 0]
        for path, x, y in pairs:
            if row_value(path) is not None and not _unify(x, y):
                return path
    return None


def _unify(a: pa.DataType, b: pa.DataType) -> bool:
    try:
        pa.unify_schemas([pa.schema([("v", a)]), pa.schema([("v", b)])], promote_options="permissive")
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return False


def json_text_values(chunk: bytes, paths: set[tuple[str, ...]]) -> bytes:
    """The chunk's lines with the value at each of `paths` (("max_tokens",), ("body", "seed")), where a line has
    one, as its JSON text (input_rows reads it back); rewritten_lines' rules."""
    def as_text(row: dict) -> None:
        for *outer, key in paths:
            holder = row
            for name in outer:
                holder = holder.get(name) if isinstance(holder, dict) else None
            if isinstance(holder, dict) and holder.get(key) is not None:
                holder[key] = json.dumps(holder[key])
    return rewritten_lines(chunk, as_text)


def rewritten_lines(chunk: bytes, rewrite) -> bytes:
    """The chunk with rewrite(row) applied to each line's JSON object in place, and the line written again;
    blank lines and lines of other JSON values as they are. A chunk with a line that json cannot read, or that
    repeats a key, is left as it is, for pyarrow to report."""
    lines = []
    for line in chunk.splitlines(keepends=True):
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys) if line.strip() else None
        except ValueError:
            return chunk
        if not isinstance(row, dict):
            lines.append(line)
            continue
        rewrite(row)
        lines.append(json.dumps(row).encode() + b"\n")
    return b"".join(lines)


def _first_bad_line(chunk: bytes) -> tuple[int, str] | None:
    """(its index in the chunk, why) of the first line that is neither blank nor a JSON object; None if none is
    (pyarrow refused the chunk for another reason). Run only once a chunk has failed."""
    for index, text in enumerate(chunk.split(b"\n")):
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except ValueError as err:
            return index, str(err)
        if not isinstance(value, dict):
            return index, f"a JSON {type(value).__name__}"
    return None


def contents_as_parts(chunk: bytes, conversation_column: str | None) -> bytes:
    """The chunk's lines with every string content of body.messages and of the conversation column read
    as one text part ({"type": "text", "text": ...}); rewritten_lines' rules."""
    def as_parts(row: dict) -> None:
        body = row.get("body")
        for messages in (body.get("messages") if isinstance(body, dict) else None, row.get(conversation_column)):
            for message in messages if isinstance(messages, list) else ():
                if isinstance(message, dict) and isinstance(message.get("content"), str):
                    message["content"] = [{"type": "text", "text": message["content"]}]
    return rewritten_lines(chunk, as_parts)


def uniform_values(chunk: bytes) -> bytes:
    """The chunk's lines with the values that may take several JSON types made one: a structured_outputs
    value and body.response_format as JSON text (pyarrow would read them as structs of every row's keys at
    once, null where a row's schema has none, and a schema of one row can hold a key of another type than
    another row's), and a stop string (stop, body.stop) as a list of it, since rows may give either;
    rewritten_lines' rules."""
    def made_uniform(row: dict) -> None:
        for holder, key in ((row, "structured_outputs"), (row.get("body"), "response_format")):
            if isinstance(holder, dict) and isinstance(holder.get(key), (dict, list)):
                holder[key] = json.dumps(holder[key])
        for holder in (row, row.get("body")):
            if isinstance(holder, dict) and isinstance(holder.get("stop"), str):
                holder["stop"] = [holder["stop"]]
    return rewritten_lines(chunk, made_uniform)


class _RepeatedKey(ValueError):
    """A JSON object of an input line holds a key twice (json keeps the last value; pyarrow refuses it)."""

    def __init__(self, key: str):
        super().__init__(f"key {key!r} twice in one object")
        self.key = key


def _unique_keys(pairs: list[tuple]) -> dict:
    keys = [k for k, _ in pairs]
    repeated = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if repeated is not None:
        raise _RepeatedKey(repeated)
    return dict(pairs)


def _repeated_key(chunk: bytes) -> str | None:
    """The first key that a line of the chunk repeats inside one of its objects, if any. Run only once a
    chunk has failed: a type clash in a rewritten chunk may hide a repeated key, which the rewrite could not
    take (uniform_values, json_text_values)."""
    for text in chunk.split(b"\n"):
        try:
            json.loads(text, object_pairs_hook=_unique_keys) if text.strip() else None
        except _RepeatedKey as err:
            return err.key
        except ValueError:
            continue
    return None


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """The batch with `schema`'s columns and types: absent columns null, narrower types cast."""
    names = batch.schema.names
    arrays = [batch.column(f.name).cast(f.type) if f.name in names else pa.nulls(batch.num_rows, f.type)
              for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# -- what each column is ---------------------------------------------------------------------------
@dataclass
class Columns:
    id: str | None  # None: the ids are row numbers
    prompt: str | None  # the text column; None for an OpenAI batch
    openai: bool  # rows are OpenAI batch requests (custom_id, url, body.messages)
    conversation: bool  # the prompt column holds conversations (lists of {role, content})
    sampling: list[str]  # per-row sampling columns (of a text input) or fields of body (OpenAI)
    keep: list[str]  # input columns carried to generations.parquet
    has_url: bool = False  # an OpenAI batch with a url column

    def read(self) -> list[str]:
        """The input columns generating reads."""
        if self.openai:
            return ["body"] + (["url"] if self.has_url else [])
        return [self.prompt] + self.sampling


def is_openai_batch(schema: pa.Schema) -> bool:
    if "custom_id" not in schema.names or "body" not in schema.names:
        return False
    body = schema.field("body").type
    return pa.types.is_struct(body) and body.get_field_index("messages") >= 0


def plan_columns(job, source: InputFiles, reserved: set[str]) -> Columns:
    """Which input column is what; JobError naming the setting when a column asked for is not there.
    `reserved`: the output's own column names, which a carried input column must not take."""
    schema, where = source.schema, source.paths[0] if len(source.paths) == 1 else job.input
    names = schema.names
    if not names:  # JSONL without a line: no rows, and no columns to check
        return Columns(None, job.prompt_column, False, False, [], [])
    openai = is_openai_batch(schema)
    if job.id_column is not None and job.id_column not in names:
        raise JobError(f"job.id_column: column {job.id_column!r} not in {where}; columns: {names} "
                       f"(leave job.id_column unset to number the rows)")
    if openai:
        id_column, prompt = job.id_column or "custom_id", None
        body = schema.field("body").type
        sampling = [body.field(i).name for i in range(body.num_fields) if body.field(i).name not in OPENAI_IGNORED]
        conversation = True
    else:
        if job.prompt_column not in names:
            raise JobError(f"job.prompt_column: column {job.prompt_column!r} not in {where}; columns: {names}")
        kind = _plain_type(schema.field(job.prompt_column).type)
        conversation = is_conversation(kind)
        if not (conversation or _is_text(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                or pa.types.is_null(kind)):
            raise JobError(f"job.prompt_column: column {job.prompt_column!r} in {where} holds {kind}, neither strings "
                           f"nor conversations (lists of structs with fields role and content)")
        id_column = job.id_column or (DEFAULT_ID_COLUMN if DEFAULT_ID_COLUMN in names else None)
        prompt = job.prompt_column
        sampling = [c for c in ROW_SAMPLING if c in names and c not in (id_column, prompt)]
    candidates = [c for c in names if c not in (id_column, prompt)]
    if job.keep_columns is None:
        keep = [c for c in candidates if c not in reserved]
        if len(keep) < len(candidates):
            log.warning("job.keep_columns: input columns %s are not carried: generations.parquet has columns "
                        "of those names", [c for c in candidates if c in reserved])
    else:
        keep = list(job.keep_columns)
        repeated = sorted({c for c in keep if keep.count(c) > 1})
        if repeated:
            raise JobError(f"job.keep_columns: {', '.join(map(repr, repeated))} is listed more than once")
        for c in keep:
            if c not in candidates:
                raise JobError(f"job.keep_columns: {c!r} is not an input column other than the id and prompt; "
                               f"columns: {candidates}")
            if c in reserved:
                raise JobError(f"job.keep_columns: {c!r} is also a column of generations.parquet")
    return Columns(id_column, prompt, openai, conversation, sampling, keep, has_url=openai and "url" in names)


def is_conversation(kind: pa.DataType) -> bool:
    """A list of structs with fields role and content: a conversation."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    return all(kind.value_type.get_field_index(name) >= 0 for name in ("role", "content"))


def check_ids(source: InputFiles, column: str | None) -> pa.DataType:
    """The type of the ids (int64 for row numbers); JobError if they are null, repeated or neither
    integers nor strings. Reads the id column once and holds it while checking: duplicates are found by
    sorting, about 24 bytes a row for integer ids (a hash table of counts took 80)."""
    if column is None:
        return pa.int64()
    kind = _plain_type(source.schema.field(column).type)
    beyond = source.first_beyond_int64(column) if source.format == "jsonl" and pa.types.is_floating(kind) else None
    if beyond:
        path, row, value = beyond
        raise JobError(f"job.id_column: column {column!r} of {path} holds {value} (row {row} of the input), beyond the "
                       f"64-bit integer range (-2^63 to 2^63 - 1): give ids this large as strings")
    if not (pa.types.is_integer(kind) or _is_text(kind)):
        raise JobError(f"job.id_column: column {column!r} holds {kind}; ids must be integers or strings")
    ids = pa.chunked_array([b.column(0) for b in source.batches([column], 1 << 16)], source.schema.field(column).type)
    ids = ids.cast(kind).combine_chunks()
    if ids.null_count:
        raise JobError(f"job.id_column: column {column!r} has {ids.null_count} null ids")
    ordered = ids.take(pc.sort_indices(ids))
    del ids
    later = ordered.slice(1)
    repeated = pc.unique(later.filter(pc.equal(later, ordered.slice(0, len(later)))))
    if len(repeated):
        raise JobError(f"job.id_column: column {column!r} has {len(repeated)} duplicate ids, "
                       f"e.g. {repeated[:5].to_pylist()}")
    return pa.string() if _is_text(kind) else kind


def input_rows(source: InputFiles, columns: Columns, batch_size: int) -> Iterator[tuple[int, dict]]:
    """(row number, fields) of every input row, in order. Fields: "prompt" (bytes or None) or "messages"
    (a conversation, its messages without null fields, or None), "sampling" (the row's own values by
    column or body field; nulls left out) and, for an OpenAI batch, "url"."""
    row = 0
    within = ("body",) if columns.openai else ()
    as_text = {path[-1] for path in source.json_text if tuple(path[:-1]) == within}  # JSON text of mixed values
    for batch in source.batches(columns.read(), batch_size):
        if columns.openai:
            body = batch.column("body")
            prompts = pc.struct_field(body, "messages")
            sampling = pa.RecordBatch.from_struct_array(body).select(columns.sampling)
            urls = batch.column("url").to_pylist() if columns.has_url else [CHAT_URL] * batch.num_rows
        else:
            prompts = batch.column(0)
            if pa.types.is_dictionary(prompts.type):
                prompts = prompts.dictionary_decode()
            sampling = batch.select(columns.sampling)
            urls = [None] * batch.num_rows
        if columns.conversation:
            fields = [conversation_fields(m) for m in prompts.to_pylist()]
        else:
            fields = [{"prompt": p} for p in prompts.cast(pa.binary()).to_pylist()]
        for f, values, url in zip(fields, sampling.to_pylist(), urls):
            f["sampling"] = {k: json.loads(v) if k in as_text else _plain_number(v)
                             for k, v in values.items() if v is not None}
            if columns.openai:
                f["url"] = url
            yield row, f
            row += 1


def conversation_fields(messages: list[dict] | None) -> dict:
    """input_rows' fields of a conversation: "messages" without null fields, each content a string (text
    parts joined), and "error" when a content holds a part that is not text."""
    if messages is None:
        return {"messages": None}
    cleaned = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            message = {k: v for k, v in message.items() if v is not None}
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            try:
                message["content"] = joined_text(message["content"])
            except ValueError as err:
                return {"messages": cleaned, "error": f"messages[{i}].{err}"}
        cleaned.append(message)
    return {"messages": cleaned}


def _plain_number(value):
    """A decimal as an int when whole (exactly, whatever its size), else a float, inside lists too;
    anything else as it is. SamplingParams takes ints and floats: int() of a decimal 2.5 would be 2."""
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, list):
        return [_plain_number(v) for v in value]
    return value


def response_format_constraint(response_format) -> dict | None:
    """OpenAI's response_format (a mapping, or its JSON text) as SamplingParams.structured_outputs:
    {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema": {"schema": ...}} that
    schema ("name" and "strict" are OpenAI's bookkeeping: the schema is always enforced), {"type": "text"} none.
    ValueError naming response_format otherwise."""
    try:
        spec = json.loads(response_format) if isinstance(response_format, str) else response_format
    except ValueError:
        raise ValueError(f"response_format is not a JSON object, got {response_format!r}") from None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = spec.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise ValueError(f"response_format.json_schema must hold a schema object under 'schema', got {schema!r}")
        return {"json": schema["schema"]}
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


# SamplingParams field -> the body field its value is read from, when the body has that field
BODY_FIELDS = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
BODY_INTS = [*INT_SAMPLING, *BODY_FIELDS.values()]  # a body's integer fields, read exactly (_exact_ints)


def body_message(message: str, body: dict) -> str:
    """A SamplingParams message (it starts with the field's name) about a value that an OpenAI body gave
    under another name (openai_sampling), naming the body's field."""
    field = message.split(" ", 1)[0]
    source = BODY_FIELDS.get(field)
    return source + message[len(field):] if source in body else message


def openai_sampling(body: dict) -> dict:
    """SamplingParams values from the sampling fields of an OpenAI chat-completions body: max_completion_tokens
    (or max_tokens), logprobs (true/false) with top_logprobs, and the fields named as SamplingParams' (vLLM's
    extensions: top_k, min_p, stop_token_ids, ...). ValueError naming a field that is neither."""
    values = dict(body)
    if "max_completion_tokens" in values:  # OpenAI's newer name wins
        values["max_tokens"] = values.pop("max_completion_tokens")
    top = values.pop("top_logprobs", None)
    if "logprobs" in values:
        if not isinstance(values["logprobs"], bool):
            raise ValueError(f"logprobs must be true or false (top_logprobs gives how many), "
                             f"got {values['logprobs']!r}")
        values["logprobs"] = (top or 0) if values["logprobs"] else None
    elif top is not None:
        raise ValueError("top_logprobs needs logprobs: true")
    if "response_format" in values:
        values["structured_outputs"] = response_format_constraint(values.pop("response_format"))
    unsupported = next((name for name in OPENAI_UNSUPPORTED if name in values), None)
    if unsupported:
        raise ValueError(f"body field {unsupported!r} is not supported (it would change what is generated)")
    unknown = sorted(set(values) - set(ROW_SAMPLING))
    if unknown:
        close = difflib.get_close_matches(unknown[0], ROW_SAMPLING + ["max_completion_tokens", "top_logprobs"], n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"body has unknown field {unknown[0]!r}{hint}")
    return {k: v for k, v in values.items() if v is not None}

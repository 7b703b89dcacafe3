"""Parquet output with the project's metadata: a schema version and the resolved config.

Schema versions: 1, the first; 2, summary.parquet's mean_contiguous_kv_utilization_pct renamed
contiguous_kv_utilization_pct, with new columns in summary.parquet and steps.parquet (engine/stats.py);
3, generations.parquet has a row per sample (sample_index) and the columns stop_reason, stop_token_id and,
when asked for, the logprob columns (jobs/results.py).
Readers of several runs (jobs/analyze.py) accept every version listed in SCHEMA_VERSIONS.

Every file is written to a temporary name of its own beside its final path (hidden, with the writer's pid
and a random tag: two writers never share one) and renamed into place, so a reader never sees a partial
file. A write that fails (a full disk, a read-only directory, a directory that is a file) removes its
temporary file and raises OutputError naming the file; one killed mid-write leaves it, for the next run in
that directory to remove (remove_temporaries).
"""
import contextlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from jobs import JobError

log = logging.getLogger("minipaged")
TEMPORARY_NAME = re.compile(r"\..+\.\d+-[0-9a-f]+\.tmp")  # atomic_path's: .<name>.<pid>-<tag>.tmp
SCHEMA_VERSION = "3"
SCHEMA_VERSIONS = ("1", "2", "3")  # versions a reader of old runs understands
META_VERSION, META_CONFIG = b"minipaged.schema_version", b"minipaged.config"


class OutputError(JobError):
    """A file of the run could not be written; the message names it and the reason."""


def schema_with_metadata(schema: pa.Schema, cfg, extra: dict[bytes, bytes] | None = None) -> pa.Schema:
    config = OmegaConf.to_container(cfg, resolve=True) if cfg is not None else {}
    meta = dict(schema.metadata or {})
    meta.update({META_VERSION: SCHEMA_VERSION.encode(), META_CONFIG: json.dumps(config).encode(), **(extra or {})})
    return schema.with_metadata(meta)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; renamed onto `path` when the block ends, removed if it
    fails. OSError inside becomes OutputError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def remove_temporaries(directory: Path) -> None:
    """Remove the temporary files of atomic_path in `directory` whose writer was killed mid-write (SIGKILL: its
    own cleanup never ran), which would stay there for good. Only where no writer of ours is at work: a run
    directory whose lock this process has just taken (jobs/common.py)."""
    for tmp in directory.glob(".*.tmp"):
        if TEMPORARY_NAME.fullmatch(tmp.name):
            log.info("removing %s, left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)


def write_atomic(table: pa.Table, path: Path, cfg=None, extra: dict[bytes, bytes] | None = None) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table.replace_schema_metadata(schema_with_metadata(table.schema, cfg, extra).metadata), tmp)


def schema_version(schema: pa.Schema) -> str | None:
    """The project's schema version of a file with this schema; None for a file we did not write."""
    value = (schema.metadata or {}).get(META_VERSION)
    return value.decode() if value is not None else None


def schema_config(schema: pa.Schema) -> dict:
    """The resolved config stored with a file of this schema ({} when absent)."""
    return json.loads((schema.metadata or {}).get(META_CONFIG, b"{}"))


def flatten(tree, prefix: str = "") -> dict:
    """A resolved config (nested dicts) as {dotted key: value}; lists are values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return flat

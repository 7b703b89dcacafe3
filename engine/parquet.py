"""Parquet output with the project's metadata: a schema version and the resolved config.

Schema versions: 1, the first; 2, summary.parquet's mean_contiguous_kv_utilization_pct renamed
contiguous_kv_utilization_pct, with new columns in summary.parquet and steps.parquet (engine/stats.py).
Readers of several runs (jobs/analyze.py) accept every version listed in SCHEMA_VERSIONS.
"""
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

SCHEMA_VERSION = "2"
SCHEMA_VERSIONS = ("1", "2")  # versions a reader of old runs understands
META_VERSION, META_CONFIG = b"minipaged.schema_version", b"minipaged.config"


def with_metadata(table: pa.Table, cfg) -> pa.Table:
    config = OmegaConf.to_container(cfg, resolve=True) if cfg is not None else {}
    meta = dict(table.schema.metadata or {})
    meta.update({META_VERSION: SCHEMA_VERSION.encode(), META_CONFIG: json.dumps(config).encode()})
    return table.replace_schema_metadata(meta)


def write_atomic(table: pa.Table, path: Path, cfg=None) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(with_metadata(table, cfg), tmp)
    os.replace(tmp, path)


def read_config(path: Path) -> dict:
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(META_CONFIG, b"{}"))


def schema_version(schema: pa.Schema) -> str | None:
    """The project's schema version of a file with this schema; None for a file we did not write."""
    value = (schema.metadata or {}).get(META_VERSION)
    return value.decode() if value is not None else None


def schema_config(schema: pa.Schema) -> dict:
    """The resolved config stored with a file of this schema ({} when absent)."""
    return json.loads((schema.metadata or {}).get(META_CONFIG, b"{}"))

"""Parquet output with the project's metadata: a schema version and the resolved config."""
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf

SCHEMA_VERSION = "1"
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

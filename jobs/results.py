"""Crash-safe generations output.

Finished rows are flushed, a batch at a time, to Parquet parts in <run dir>/generations.parts/ (each
written atomically). A job started again in the same run directory reads the parts first and skips
the ids they hold; finalize() merges the parts into generations.parquet (atomically, each id once).
"""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.parquet import write_atomic


def generations_schema(id_type: pa.DataType) -> pa.Schema:
    return pa.schema([
        ("id", id_type), ("prompt", pa.string()), ("output_text", pa.string()),
        ("output_token_ids", pa.list_(pa.int32())), ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()), ("error", pa.string()),
    ])


class ResultWriter:
    def __init__(self, run_dir: Path, id_type: pa.DataType, flush_every: int, cfg=None):
        self.parts_dir = run_dir / "generations.parts"
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        self.final_path = run_dir / "generations.parquet"
        self.schema, self.flush_every, self.cfg = generations_schema(id_type), flush_every, cfg
        self.buffer: list[dict] = []
        self.parts = sorted(self.parts_dir.glob("part-*.parquet"))
        self.done_ids = {i for part in self.parts for i in pq.read_table(part, columns=["id"])["id"].to_pylist()}

    def add(self, row: dict) -> None:
        self.buffer.append(row)
        self.done_ids.add(row["id"])
        if len(self.buffer) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        path = self.parts_dir / f"part-{len(self.parts):06d}.parquet"
        write_atomic(pa.Table.from_pylist(self.buffer, schema=self.schema), path, self.cfg)
        self.parts.append(path)
        self.buffer = []

    def finalize(self) -> pa.Table:
        """Merge every part into generations.parquet, one row per id (the first one written)."""
        self.flush()
        table = pa.concat_tables([pq.read_table(p, schema=self.schema) for p in self.parts]) if self.parts \
            else self.schema.empty_table()
        ids = table["id"].to_pylist()
        first = sorted({i: n for n, i in reversed(list(enumerate(ids)))}.values())
        table = table.take(first)
        write_atomic(table, self.final_path, self.cfg)
        return table

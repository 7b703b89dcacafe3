"""Crash-safe, resumable generations output.

Finished rows are flushed, a batch at a time, to Parquet parts in <run dir>/generations.parts/
(part-000000.parquet, ...). Each part is written to a hidden temporary file and renamed, so a part
either exists whole or not at all; a temporary file left by a kill is ignored (and removed) on the next
start. A job started again in the same run directory reads the ids of the parts first and skips them,
after checking that the parts were written with the same settings (model, sampling, input). finalize()
merges the parts into generations.parquet: one row per input id, in input order, written atomically.
"""
import json
import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.parquet import META_CONFIG, write_atomic
from jobs import JobError

log = logging.getLogger("minipaged")
PART_GLOB = "part-*.parquet"

# The settings that decide what a row's output is: parts written under other values cannot be mixed in.
# Left out: model.device (auto/cuda name the same device), cache.*, scheduler.* (placement and batching
# do not change greedy outputs, and a smaller pool is a natural fix to retry with), job.flush_*.
OUTPUT_SETTINGS = ("model", "sampling", "job.input", "job.prompt_column", "job.id_column")
IGNORED_SETTINGS = ("model.device",)


def generations_schema(id_type: pa.DataType) -> pa.Schema:
    return pa.schema([
        ("id", id_type), ("prompt", pa.string()), ("output_text", pa.string()),
        ("output_token_ids", pa.list_(pa.int32())), ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()), ("error", pa.string()),
    ])


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def output_settings(config: dict) -> dict:
    """The flattened settings of OUTPUT_SETTINGS from a resolved config (a plain dict)."""
    flat = _flatten(config)
    return {k: v for k, v in flat.items()
            if any(k == s or k.startswith(s + ".") for s in OUTPUT_SETTINGS) and k not in IGNORED_SETTINGS}


class ResultWriter:
    def __init__(self, run_dir: Path, id_type: pa.DataType, flush_every: int, cfg=None,
                 flush_interval_s: float = 0.0):
        self.parts_dir = run_dir / "generations.parts"
        self.final_path = run_dir / "generations.parquet"
        self.schema, self.flush_every, self.cfg = generations_schema(id_type), flush_every, cfg
        self.flush_interval_s = flush_interval_s
        self.buffer: list[dict] = []
        self._oldest = 0.0  # when the oldest buffered row was added
        self.parts: list[Path] = []
        self.done_ids: set = set()
        self.resumed_ids: set = set()  # ids found in parts at start: computed by an earlier run
        if self.parts_dir.is_dir():
            self._load_parts()
        self._next = 1 + max((int(p.stem.split("-")[1]) for p in self.parts), default=-1)

    def _load_parts(self) -> None:
        for tmp in self.parts_dir.glob(".*.tmp"):  # a part being written when the job was killed
            log.info("removing %s, left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)
        self.parts = sorted(p for p in self.parts_dir.glob(PART_GLOB) if p.stem.split("-")[1].isdigit())
        current = output_settings(_plain(self.cfg)) if self.cfg is not None else None
        for part in self.parts:
            try:
                schema = pq.read_schema(part)
                ids = pq.read_table(part, columns=["id"])["id"]
            except (pa.ArrowInvalid, OSError, KeyError) as err:
                raise JobError(f"cannot read {part} ({err}); delete it to compute its rows again") from None
            if schema.field("id").type != self.schema.field("id").type:
                raise JobError(f"{part} holds ids of type {schema.field('id').type}, the input's are "
                               f"{self.schema.field('id').type}: not the same input; use a new hydra.run.dir")
            if current is not None:
                before = output_settings(json.loads((schema.metadata or {}).get(META_CONFIG, b"{}")))
                changed = sorted(k for k in before.keys() & current.keys() if before[k] != current[k])
                if changed:
                    diff = ", ".join(f"{k}: {before[k]!r} -> {current[k]!r}" for k in changed[:5])
                    raise JobError(f"{self.parts_dir.parent} holds rows generated with other settings ({diff}); "
                                   f"run with the same settings to resume, or use a new hydra.run.dir")
            self.done_ids.update(ids.to_pylist())
        self.resumed_ids = set(self.done_ids)

    def add(self, row: dict) -> None:
        if not self.buffer:
            self._oldest = time.monotonic()
        self.buffer.append(row)
        self.done_ids.add(row["id"])
        if len(self.buffer) >= self.flush_every or (
                self.flush_interval_s and time.monotonic() - self._oldest >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next part (atomically)."""
        if not self.buffer:
            return
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        path = self.parts_dir / f"part-{self._next:06d}.parquet"
        write_atomic(pa.Table.from_pylist(self.buffer, schema=self.schema), path, self.cfg)
        self._next += 1
        self.parts.append(path)
        self.buffer = []

    def finalize(self, ids: pa.Array | pa.ChunkedArray) -> pa.Table:
        """Write generations.parquet: one row for each of `ids` (the input's, in its order), taken from
        the parts (the first written when a row was written twice). JobError if an id has no row."""
        self.flush()
        table = pa.concat_tables([pq.read_table(p, schema=self.schema) for p in self.parts]) if self.parts \
            else self.schema.empty_table()
        row_of = {}
        for n, i in enumerate(table["id"].to_pylist()):
            row_of.setdefault(i, n)
        wanted = ids.to_pylist()
        missing = [i for i in wanted if i not in row_of]
        if missing:
            raise JobError(f"no result for {len(missing)} ids, e.g. {missing[:5]}; run again to compute them")
        table = table.take(pa.array([row_of[i] for i in wanted], pa.int64()))
        write_atomic(table, self.final_path, self.cfg)
        return table


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)

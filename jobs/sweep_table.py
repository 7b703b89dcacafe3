"""The sweep as an aligned Markdown table: the swept keys the metric columns do not show, then the
metrics of TABLE present in the sweep."""
import json
import math

import pyarrow as pa

from jobs.sweep_runs import shown_keys

# (header, column, format) of the printed table
TABLE = (
    ("block", "block_size", "{:d}"),
    ("blocks", "num_blocks", "{:d}"),
    ("KV MB", "kv_budget_bytes", lambda v: f"{v / 1e6:.2f}"),
    ("peak blk", "peak_blocks_used", "{:d}"),
    ("util% mean", "mean_paged_kv_utilization_pct", "{:.1f}"),
    ("util% peak", "peak_paged_kv_utilization_pct", "{:.1f}"),
    ("waste% mean", "mean_internal_waste_pct", "{:.1f}"),
    ("contig util%", "contiguous_kv_utilization_pct", "{:.1f}"),
    ("contig seqs", "contiguous_max_concurrent_seqs", "{:d}"),
    ("max seqs", "max_running_seqs", "{:d}"),
    ("mean seqs", "mean_running_seqs", "{:.1f}"),
    ("preempt", "preemptions", "{:d}"),
    ("BT bytes", "peak_block_table_bytes", "{:d}"),
    ("out tok/s", "output_tok_per_s", "{:.0f}"),
    ("wall s", "wall_time_s", "{:.2f}"),
)
SHOWN_KEYS = {"cache.block_size", "cache.num_blocks"}  # swept keys the table already shows as columns


def fmt(value, form) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return form(value) if callable(form) else form.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(sweep: pa.Table, swept: list[str]) -> str:
    """An aligned Markdown table: the swept keys the metric columns do not show, then the metrics."""
    rows = sweep.to_pylist()
    extra = [k for k in shown_keys(swept) if k not in SHOWN_KEYS]
    if not swept:
        extra = ["run"]
    columns = [(k, k, lambda v: v if isinstance(v, str) else json.dumps(v)) for k in extra]
    columns += [c for c in TABLE if c[1] in sweep.column_names]
    header = [h for h, _, _ in columns]
    body = [[fmt(row.get(col), form) for _, col, form in columns] for row in rows]
    widths = [max(len(x) for x in [h] + [r[i] for r in body]) for i, h in enumerate(header)]
    left = len(extra)  # text columns align left, numbers right

    def line(cells):
        padded = (c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i >= left else (":" + "-" * (w + 1)) for i, w in enumerate(widths))
    return "\n".join([line(header), rule + "|"] + [line(r) for r in body])

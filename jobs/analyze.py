"""job=analyze: compare the runs of a sweep.

    python -m engine.run job=analyze job.root=multirun/bench/<time>

Every summary.parquet below job.root is one run (read with pyarrow.dataset). A run whose summary is
missing, unreadable, foreign (no MiniPaged schema version) or lacks the columns compared here is
reported and skipped. Runs written by older schema versions are read with their columns renamed to
today's names; columns missing from some runs are null there.

The swept keys are the config keys (from each file's metadata) whose values differ between the runs,
ordered as they appear in the runs' Hydra overrides. Written to job.out (default job.root):
    sweep.parquet          one row per run, sorted by the swept keys: `run` (its directory relative to
                           job.root), one column per swept key (dotted name), then the summary's columns
    throughput.png, utilization.png, waste.png   against block size (one line per value of the other keys)
    steps_utilization.png  paged KV utilization over the steps of each run (from its steps.parquet)
    sweep.png              the four plots on one page
and an aligned table (Markdown) on stdout.
"""
import json
import logging
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from jobs.parquet import SCHEMA_VERSIONS, schema_config, schema_version, write_atomic
from jobs import JobError

log = logging.getLogger("minipaged")

REQUIRED = ("block_size", "num_blocks", "output_tok_per_s", "mean_paged_kv_utilization_pct", "mean_internal_waste_pct")
RENAMED = {"1": {"mean_contiguous_kv_utilization_pct": "contiguous_kv_utilization_pct"}}  # old name -> today's
NOT_RUNS = ("analyze",)  # Hydra run directories of these jobs hold no run to compare
SWEPT_META = b"minipaged.swept_keys"

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


# -- finding and reading the runs ------------------------------------------------------------------
def first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def find_runs(root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """summary.parquet files below root, and run directories that have none (with the reason)."""
    summaries = sorted(root.rglob("summary.parquet"))
    have = {p.parent for p in summaries}
    candidates = {p.parent for p in root.rglob(".hydra") if p.is_dir()}
    candidates |= {p.parent for name in ("steps.parquet", "generations.parquet") for p in root.rglob(name)}
    missing = []
    for run in sorted(candidates - have):
        try:
            job_name = OmegaConf.load(run / ".hydra" / "config.yaml").job.name
        except Exception:  # no or unreadable Hydra config: judge by the files alone
            job_name = None
        if job_name not in NOT_RUNS:
            missing.append((run, "no summary.parquet (the run failed or has not finished)"))
    return summaries, missing


def check_schema(path: Path) -> tuple[pa.Schema | None, str | None]:
    """The file's schema, or None and why the file is not a summary we can compare."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as err:
        return None, f"not a readable Parquet file ({first_line(err)})"
    version = schema_version(schema)
    if version is None:
        return None, "foreign file: no minipaged.schema_version in its metadata"
    if version not in SCHEMA_VERSIONS:
        return None, f"schema version {version} is unknown to this reader (knows {', '.join(SCHEMA_VERSIONS)})"
    names = set(schema.names) | {new for old, new in RENAMED.get(version, {}).items() if old in schema.names}
    lacking = [c for c in REQUIRED if c not in names]
    if lacking:
        return None, f"not a run summary: no column {', '.join(lacking)}"
    return schema, None


def read_summaries(paths: list[Path]) -> tuple[list[tuple[Path, dict, pa.Table]], list[tuple[Path, str]]]:
    """(summary path, flat config, one-row table) per usable run, and (path, reason) per skipped one."""
    good, skipped = [], []
    checked = []
    for path in paths:
        schema, reason = check_schema(path)
        if reason:
            skipped.append((path.parent, reason))
        else:
            checked.append((path, schema))
    if not checked:
        return good, skipped
    dataset = ds.dataset([str(p) for p, _ in checked], format="parquet", schema=checked[0][1].remove_metadata())
    fragments = {Path(f.path): f for f in dataset.get_fragments()}
    for path, schema in checked:
        try:
            fragment = fragments[Path(str(path))]
            table = fragment.to_table(schema=fragment.physical_schema)
        except (pa.ArrowException, OSError) as err:
            skipped.append((path.parent, f"unreadable ({first_line(err)})"))
            continue
        if table.num_rows != 1:
            skipped.append((path.parent, f"expected one row, found {table.num_rows}"))
            continue
        renames = RENAMED.get(schema_version(schema), {})
        table = table.rename_columns([renames.get(n, n) for n in table.column_names]).replace_schema_metadata(None)
        try:
            config = flatten(schema_config(schema))
        except ValueError:  # metadata that is not JSON: compare the run without its config
            config = {}
        good.append((path, config, table))
    return good, skipped


def combine(good: list[tuple[Path, dict, pa.Table]]) -> tuple[list, pa.Table, list[tuple[Path, str]]]:
    """Concatenate the one-row tables (columns missing somewhere are null there, numeric types widened);
    a run whose column types clash with the runs before it is skipped."""
    try:
        return good, pa.concat_tables([t for _, _, t in good], promote_options="permissive"), []
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    kept, table, skipped = [], None, []
    for entry in good:
        try:
            merged = entry[2] if table is None else pa.concat_tables([table, entry[2]], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            skipped.append((entry[0].parent, f"column types clash with the other runs ({first_line(err)})"))
            continue
        kept.append(entry)
        table = merged
    return kept, table, skipped


# -- swept keys ------------------------------------------------------------------------------------
def flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def override_keys(run: Path) -> list[str]:
    """The keys of the run's Hydra overrides, in the order given (empty when there is no record)."""
    try:
        overrides = OmegaConf.load(run / ".hydra" / "overrides.yaml")
    except Exception:
        return []
    return [str(o).split("=", 1)[0].lstrip("+~") for o in overrides]


def swept_keys(configs: list[dict], runs: list[Path]) -> list[str]:
    """Config keys (present in every run's config) whose values differ between runs, in override order."""
    with_config = [c for c in configs if c]
    if len(with_config) < 2:
        return []
    common = set.intersection(*(set(c) for c in with_config))
    swept = [k for k in common if len({json.dumps(c[k], sort_keys=True) for c in with_config}) > 1]
    order = []
    for run in runs:
        order += [k for k in override_keys(run) if k not in order]

    def position(key: str) -> tuple:
        hits = [i for i, k in enumerate(order) if key == k or key.startswith(k + ".")]
        return (min(hits) if hits else len(order), key)

    return sorted(swept, key=position)


def shown_keys(swept: list[str]) -> list[str]:
    """The swept keys worth a column or a label: a whole group swept (model=a,b) shows as its name."""
    groups = {k.rsplit(".", 1)[0] for k in swept if k.endswith(".name") and "." in k}
    return [k for k in swept if k.rsplit(".", 1)[0] not in groups or k.endswith(".name")]


def cell(value):
    """A config value as a sweep.parquet cell: scalars as they are, lists and dicts as JSON."""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def sort_key(value) -> tuple:
    if value is None:
        return (2, "")
    if isinstance(value, (bool, int, float)):
        return (0, float(value))
    return (1, str(value))


def build_sweep(root: Path, good: list, table: pa.Table, swept: list[str]) -> pa.Table:
    rows = table.to_pylist()
    runs = [p.parent.relative_to(root).as_posix() for p, _, _ in good]
    values = [{k: cell(config.get(k)) for k in swept} for _, config, _ in good]
    order = sorted(range(len(rows)), key=lambda i: ([sort_key(values[i][k]) for k in swept], runs[i]))
    columns = {"run": pa.array([runs[i] for i in order], pa.string())}
    for key in swept:
        column = [values[i][key] for i in order]
        try:
            columns[key] = pa.array(column)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed kinds across runs: keep them as text
            columns[key] = pa.array([None if v is None else str(v) for v in column], pa.string())
    sweep = pa.table(columns)
    ordered = table.take(order)
    for name in ordered.column_names:
        if name not in columns:
            sweep = sweep.append_column(ordered.schema.field(name), ordered[name])
    return sweep.replace_schema_metadata({SWEPT_META: json.dumps(swept).encode()})


# -- the table -------------------------------------------------------------------------------------
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


# -- the plots -------------------------------------------------------------------------------------
def short_key(key: str) -> str:
    """cache.block_size -> block_size; model.name -> model."""
    parts = key.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def label_of(row: dict, keys: list[str]) -> str:
    return ", ".join(f"{short_key(k)}={row[k]}" for k in keys)


def read_steps(root: Path, sweep: pa.Table) -> dict[str, pa.Table]:
    steps = {}
    for run in sweep["run"].to_pylist():
        path = root / run / "steps.parquet"
        try:
            steps[run] = pq.read_table(path, columns=["step", "paged_kv_utilization_pct"])
        except (pa.ArrowException, OSError) as err:
            log.warning("run %s: no steps plot (%s)", run, first_line(err))
    return steps


def plot(sweep: pa.Table, swept: list[str], steps: dict[str, pa.Table], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep.to_pylist()
    others = [k for k in shown_keys(swept) if k != "cache.block_size"]
    series: dict[str, list[dict]] = {}
    for row in rows:
        series.setdefault(label_of(row, others), []).append(row)
    block_sizes = sorted({r["block_size"] for r in rows})
    colors = plt.get_cmap("viridis")

    def against_block_size(ax, metrics, ylabel, title):
        for n, (label, group) in enumerate(series.items()):
            group = sorted(group, key=lambda r: r["block_size"])
            color = colors(0.85 * n / max(len(series) - 1, 1)) if len(series) > 1 else "C0"
            for column, name, style in metrics:
                if column not in sweep.column_names:
                    continue
                points = [(r["block_size"], r[column]) for r in group if r[column] is not None]
                if points:
                    xs, ys = zip(*points)
                    text = ", ".join(t for t in (label, name) if t) or None
                    ax.plot(xs, ys, style, color=color if len(series) > 1 else None, label=text, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if any(line.get_label() and not line.get_label().startswith("_") for line in ax.get_lines()):
            ax.legend(fontsize=8)

    def throughput(ax):
        against_block_size(ax, [("output_tok_per_s", "", "-")], "output tokens / s", "Throughput")
        ax.set_ylim(bottom=0)

    def utilization(ax):
        against_block_size(ax, [("mean_paged_kv_utilization_pct", "paged mean", "-"),
                                ("peak_paged_kv_utilization_pct", "paged peak", "--"),
                                ("contiguous_kv_utilization_pct", "contiguous mean", ":")],
                           "KV utilization (% of reserved slots)", "KV utilization: paged vs contiguous")
        ax.set_ylim(0, 105)

    def waste(ax):
        against_block_size(ax, [("mean_internal_waste_pct", "", "-")], "internal waste (% of allocated slots)",
                           "Internal fragmentation (mean over steps)")
        ax.set_ylim(bottom=0)

    def over_steps(ax):
        runs = [r for r in rows if r["run"] in steps]
        for n, row in enumerate(runs):
            table = steps[row["run"]]
            label = label_of(row, (["cache.block_size"] if "cache.block_size" in swept else []) + others) \
                or f"block_size={row['block_size']}"
            ax.plot(table["step"].to_pylist(), table["paged_kv_utilization_pct"].to_pylist(), linewidth=1,
                    color=colors(0.85 * n / max(len(runs) - 1, 1)), label=label)
        ax.set_xlabel("engine step")
        ax.set_ylabel("paged KV utilization (%)")
        ax.set_title("Paged KV utilization over the steps of each run")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        if runs:
            ax.legend(fontsize=8)

    written = []
    for name, draw in (("throughput", throughput), ("utilization", utilization), ("waste", waste),
                       ("steps_utilization", over_steps)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        draw(ax)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out / f"{name}.png")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, draw in zip(axes.flat, (throughput, utilization, waste, over_steps)):
        draw(ax)
    device = {r.get("device_name") or r.get("device") for r in rows} - {None}
    fig.suptitle(f"Block-size sweep: {len(rows)} runs" + (f" on {', '.join(sorted(device))}" if device else ""))
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=80)
    plt.close(fig)
    return written + [out / "sweep.png"]


# -- the job ---------------------------------------------------------------------------------------
def analyze(root: Path, out: Path, cfg=None, plots: bool = True) -> tuple[pa.Table, list[tuple[Path, str]]]:
    """Read the runs below root, write sweep.parquet (and the plots) to out; returns the sweep table and
    the skipped runs with their reasons."""
    summaries, skipped = find_runs(root)
    good, unusable = read_summaries(summaries)
    good, table, clashing = combine(good) if good else ([], None, [])
    skipped = sorted(skipped + unusable + clashing)
    for run, reason in skipped:
        log.warning("skipped %s: %s", run.relative_to(root).as_posix(), reason)
    if not good:
        raise JobError(f"job.root: no usable summary.parquet below {root} ({len(skipped)} runs skipped)")
    swept = swept_keys([c for _, c, _ in good], [p.parent for p, _, _ in good])
    sweep = build_sweep(root, good, table, swept)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(sweep, out / "sweep.parquet", cfg)
    print(format_table(sweep, swept))
    if skipped:
        print(f"skipped {len(skipped)}: " + "; ".join(f"{r.relative_to(root).as_posix()} ({why})" for r, why in skipped))
    written = []
    if plots:
        try:
            written = plot(sweep, swept, read_steps(root, sweep), out)
        except ImportError as err:  # sweep.parquet is written; the plots need matplotlib
            log.warning("no plots: %s (pip install matplotlib)", err)
    log.info("%d runs (swept: %s), %d skipped; wrote %s%s", sweep.num_rows, ", ".join(swept) or "nothing",
             len(skipped), out / "sweep.parquet", "".join(f", {p.name}" for p in written))
    return sweep, skipped


def run(cfg) -> None:
    job = cfg.job
    if OmegaConf.is_missing(job, "root"):
        raise JobError("job.root: set it to a sweep directory, e.g. job.root=multirun/bench/<time>")
    root = Path(job.root)
    if not root.is_dir():
        raise JobError(f"job.root: no such directory: {root}")
    analyze(root, Path(job.out) if job.out else root, cfg, job.plots)

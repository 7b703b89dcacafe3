"""The sweep's plots (matplotlib, imported when drawn): throughput, KV utilization and internal waste
against block size (one line per value of the other swept keys), and each run's paged KV utilization
over its steps (from its steps.parquet); each alone and the four on one page."""
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs import first_line
from jobs.sweep_runs import shown_keys

log = logging.getLogger("minipaged")


def short_key(key: str) -> str:
    """cache.block_size -> block_size; model.name -> model."""
    parts = key.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def label_of(row: dict, keys: list[str]) -> str:
    return ", ".join(f"{short_key(k)}={row[k]}" for k in keys)


def sweep_title(swept: list[str], rows: list[dict]) -> str:
    """sweep.png's title: the swept keys (short names), the number of runs and the devices they ran on."""
    keys = ", ".join(short_key(k) for k in shown_keys(swept))
    devices = sorted({r.get("device_name") or r.get("device") for r in rows} - {None})
    runs = f"{len(rows)} run{'' if len(rows) == 1 else 's'}"
    return (f"Sweep over {keys}: " if keys else "") + runs + (f" on {', '.join(devices)}" if devices else "")


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
    fig.suptitle(sweep_title(swept, rows))
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=80)
    plt.close(fig)
    return written + [out / "sweep.png"]

"""job=analyze: compare the runs of a sweep.

    python -m engine.run job=analyze job.root=multirun/bench/<time>

Every summary.parquet below job.root is one run; the runs that cannot be compared are reported and
skipped (jobs/sweep_runs.py says which, and which config keys count as swept). Written to job.out
(default job.root):
    sweep.parquet          one row per run, sorted by the swept keys: `run` (its directory relative to
                           job.root), one column per swept key (dotted name), then the summary's columns
    throughput.png, utilization.png, waste.png   against block size (one line per value of the other keys)
    steps_utilization.png  paged KV utilization over the steps of each run (from its steps.parquet)
    sweep.png              the four plots on one page
and an aligned table (Markdown, jobs/sweep_table.py) on stdout; the plots: jobs/sweep_plots.py.
"""
import logging
from pathlib import Path

import pyarrow as pa
from omegaconf import OmegaConf

from jobs import JobError
from jobs.parquet import write_atomic
from jobs.sweep_plots import plot, read_steps
from jobs.sweep_runs import read_sweep
from jobs.sweep_table import format_table

log = logging.getLogger("minipaged")


def analyze(root: Path, out: Path, cfg=None, plots: bool = True) -> tuple[pa.Table, list[tuple[Path, str]]]:
    """Read the runs below root, write sweep.parquet (and the plots) to out; returns the sweep table and
    the skipped runs with their reasons."""
    sweep, swept, skipped = read_sweep(root)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise JobError(f"job.out: cannot make the directory {out} ({err.strerror})") from None
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

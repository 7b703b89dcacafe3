"""Peak resident memory and wall time of the generate job against the number of input rows.

    OMP_NUM_THREADS=1 python benchmarks/memory_rows.py [--rows 1000000] [--dir /tmp/memory_rows]

Writes a Parquet input of --rows short prompts (columns id, prompt and one extra column carried to the
output; reused when it exists), then runs `python -m engine.run` on its first rows/10 rows and on all of
them, each in a subprocess (the tiny model on the CPU, max_tokens=1), and prints each run's peak RSS (the
child's ru_maxrss) and wall time. Memory that does not grow tenfold with the rows is the point: the job
streams its input, holds a bounded window of requests, and merges its parts into generations.parquet batch
by batch (jobs/results.py); what does grow is 4 bytes per row for the resume index, the id column while the
ids are checked, and one steps.parquet row per engine step.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["model.device=cpu", "model.max_model_len=256", "sampling.max_tokens=1", "scheduler.max_num_seqs=256",
            "scheduler.max_num_batched_tokens=4096"]


def write_input(path: Path, rows: int) -> None:
    if path.exists() and pq.read_metadata(path).num_rows == rows:
        return
    with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("group", pa.int32())])) as out:
        for lo in range(0, rows, 100_000):
            ids = range(lo, min(lo + 100_000, rows))
            out.write_table(pa.table({"id": pa.array(ids, pa.int64()), "prompt": [f"row {i}" for i in ids],
                                      "group": pa.array([i % 7 for i in ids], pa.int32())}))


def run_job(path: Path, run_dir: Path) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of one job in a subprocess."""
    args = [sys.executable, "-m", "engine.run", f"job.input={path}", f"hydra.run.dir={run_dir}", *SETTINGS]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the job failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024, wall  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/memory_rows"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print("| rows | peak RSS MiB | wall s | rows/s |\n|---:|---:|---:|---:|")
    for rows in (args.rows // 10, args.rows):
        path = args.dir / f"prompts-{rows}.parquet"
        write_input(path, rows)
        run_dir = args.dir / f"run-{rows}-{int(time.time())}"
        rss, wall = run_job(path, run_dir)
        assert pq.read_metadata(run_dir / "generations.parquet").num_rows == rows
        print(f"| {rows:,} | {rss:.0f} | {wall:.0f} | {rows / wall:,.0f} |", flush=True)


if __name__ == "__main__":
    main()

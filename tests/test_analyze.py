"""job=analyze on a synthetic folder of runs: good ones, an old schema, and broken or foreign ones."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from jobs.analyze import analyze
from jobs.parquet import META_CONFIG, META_VERSION, SCHEMA_VERSION, write_atomic

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def config(block_size: int, budget: float = 0.001):
    return OmegaConf.create({"job": {"name": "bench", "num_prompts": 8},
                             "cache": {"block_size": block_size, "num_blocks": None, "kv_budget_gb": budget}})


def summary_row(block_size: int, **extra) -> dict:
    num_blocks = 1024 // block_size
    return {"job": "bench", "device": "cpu", "block_size": block_size, "num_blocks": num_blocks,
            "kv_budget_bytes": num_blocks * block_size * 512, "peak_blocks_used": num_blocks // 2,
            "peak_paged_kv_utilization_pct": 99.0 - block_size / 8, "mean_paged_kv_utilization_pct": 95.0 - block_size / 4,
            "mean_internal_waste_pct": 5.0 + block_size / 4, "contiguous_kv_utilization_pct": 20.0,
            "contiguous_max_concurrent_seqs": 2, "max_running_seqs": 8, "mean_running_seqs": 6.5,
            "preemptions": block_size // 16, "peak_block_table_bytes": 2 * num_blocks,
            "output_tok_per_s": 100.0 * block_size, "wall_time_s": 1.0, **extra}


def write_run(directory: Path, block_size: int, **extra) -> None:
    directory.mkdir(parents=True)
    write_atomic(pa.Table.from_pylist([summary_row(block_size, **extra)]), directory / "summary.parquet", config(block_size))
    steps = pa.table({"step": [0, 1, 2], "paged_kv_utilization_pct": [50.0, 75.0, 90.0 - block_size / 8]})
    write_atomic(steps, directory / "steps.parquet", config(block_size))


def make_sweep(root: Path) -> None:
    write_run(root / "cache.block_size=32", 32)
    write_run(root / "cache.block_size=8", 8, workload="random")  # a column the others lack
    # schema version 1: the contiguous mean had another name, and an int where today's files have a float
    row = summary_row(16)
    row["mean_contiguous_kv_utilization_pct"] = row.pop("contiguous_kv_utilization_pct")
    row["mean_running_seqs"] = 6
    table = pa.Table.from_pylist([row]).replace_schema_metadata(
        {META_VERSION: b"1", META_CONFIG: json.dumps(OmegaConf.to_container(config(16))).encode()})
    (root / "cache.block_size=16").mkdir()
    pq.write_table(table, root / "cache.block_size=16" / "summary.parquet")  # no steps.parquet: no line
    # a run that crashed: Hydra's record and a steps file, no summary
    crashed = root / "cache.block_size=64"
    (crashed / ".hydra").mkdir(parents=True)
    OmegaConf.save(config(64), crashed / ".hydra" / "config.yaml")
    write_atomic(pa.table({"step": [0]}), crashed / "steps.parquet", config(64))
    # a summary cut short, a summary from somewhere else, and one of a future schema
    (root / "truncated").mkdir()
    (root / "truncated" / "summary.parquet").write_bytes(b"PAR1 not really")
    (root / "foreign").mkdir()
    pq.write_table(pa.table({"block_size": [4], "speed": [1.0]}), root / "foreign" / "summary.parquet")
    (root / "future").mkdir()
    pq.write_table(pa.Table.from_pylist([summary_row(4)]).replace_schema_metadata({META_VERSION: b"99"}),
                   root / "future" / "summary.parquet")
    # a run with a column type that cannot merge with the others
    write_run(root / "nested" / "clash", 128, max_running_seqs="eight")
    # the analyze job's own Hydra directory is not a run
    (root / "analysis" / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"job": {"name": "analyze"}}), root / "analysis" / ".hydra" / "config.yaml")


def test_analyze_reads_good_runs_and_reports_broken_ones(tmp_path, capsys):
    make_sweep(tmp_path)
    out = tmp_path / "report"
    sweep, skipped = analyze(tmp_path, out)
    reasons = {run.relative_to(tmp_path).as_posix(): why for run, why in skipped}
    assert set(reasons) == {"cache.block_size=64", "truncated", "foreign", "future", "nested/clash"}
    assert "no summary.parquet" in reasons["cache.block_size=64"]
    assert "not a readable Parquet file" in reasons["truncated"]
    assert "foreign" in reasons["foreign"]
    assert "99" in reasons["future"]
    assert "clash" in reasons["nested/clash"]

    written = pq.read_table(out / "sweep.parquet")
    rows = written.to_pylist()
    assert [r["block_size"] for r in rows] == [8, 16, 32]  # sorted by the swept key, not by name
    assert [r["cache.block_size"] for r in rows] == [8, 16, 32]
    assert [r["run"] for r in rows] == ["cache.block_size=8", "cache.block_size=16", "cache.block_size=32"]
    assert json.loads(written.schema.metadata[b"minipaged.swept_keys"]) == ["cache.block_size"]
    assert written.schema.metadata[META_VERSION] == SCHEMA_VERSION.encode()
    assert [r["contiguous_kv_utilization_pct"] for r in rows] == [20.0, 20.0, 20.0]  # renamed from version 1
    assert [r["workload"] for r in rows] == ["random", None, None]
    assert written.schema.field("mean_running_seqs").type == pa.float64()
    for name in ("throughput", "utilization", "waste", "steps_utilization", "sweep"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC

    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 3 and len({len(line) for line in table}) == 1  # header, rule, 3 rows, aligned
    assert "util% mean" in table[0] and table[2].split("|")[1].strip() == "8"


def test_swept_keys_beyond_block_size_get_columns_and_lines(tmp_path, capsys):
    for block_size in (8, 16):
        for budget in (0.001, 0.002):
            directory = tmp_path / f"b{block_size}-{budget}"
            directory.mkdir()
            write_atomic(pa.Table.from_pylist([summary_row(block_size)]), directory / "summary.parquet",
                         config(block_size, budget))
    sweep, skipped = analyze(tmp_path, tmp_path, plots=False)
    assert not skipped
    assert json.loads(sweep.schema.metadata[b"minipaged.swept_keys"]) == ["cache.block_size", "cache.kv_budget_gb"]
    assert [(r["cache.block_size"], r["cache.kv_budget_gb"]) for r in sweep.to_pylist()] == \
        [(8, 0.001), (8, 0.002), (16, 0.001), (16, 0.002)]
    assert "cache.kv_budget_gb" in capsys.readouterr().out.splitlines()[0]
    assert not (tmp_path / "sweep.png").exists()


def test_swept_keys_follow_the_overrides_order_whatever_text_they_hold(tmp_path):
    """The columns follow the order of the runs' overrides (kv_budget_gb first here), read as the command line's
    text: an override that reads like an interpolation (${...}, left by a run that failed on it) is not
    resolved, which raised an error naming nothing."""
    for block_size, budget in ((8, 0.002), (16, 0.001)):
        directory = tmp_path / f"b{block_size}"
        (directory / ".hydra").mkdir(parents=True)
        write_atomic(pa.Table.from_pylist([summary_row(block_size)]), directory / "summary.parquet",
                     config(block_size, budget))
        (directory / ".hydra" / "overrides.yaml").write_text(
            f"- cache.kv_budget_gb={budget}\n- cache.block_size={block_size}\n- job.note=${{job.nope}}\n")
    sweep, skipped = analyze(tmp_path, tmp_path, plots=False)
    assert not skipped
    assert json.loads(sweep.schema.metadata[b"minipaged.swept_keys"]) == ["cache.kv_budget_gb", "cache.block_size"]


def test_a_seed_past_int64_is_swept_as_text(tmp_path):
    """Every bit of a 64-bit seed counts (a seed of 2^63 or more is valid); Arrow's int64 cannot hold it, so
    the column keeps the runs' seeds as text, in their order."""
    for seed in (2**63, 1):
        directory = tmp_path / f"seed-{seed}"
        directory.mkdir()
        cfg = OmegaConf.merge(config(16), {"sampling": {"seed": seed}})
        write_atomic(pa.Table.from_pylist([summary_row(16)]), directory / "summary.parquet", cfg)
    sweep, skipped = analyze(tmp_path, tmp_path, plots=False)
    assert not skipped
    assert sweep["sampling.seed"].to_pylist() == ["1", str(2**63)]


@pytest.mark.parametrize("block_sizes, budgets, title", [
    ([8, 16, 32], [0.001], "Sweep over block_size: 3 runs on cpu"),
    ([16], [0.001, 0.002], "Sweep over kv_budget_gb: 2 runs on cpu"),
    ([8, 16], [0.001, 0.002], "Sweep over block_size, kv_budget_gb: 4 runs on cpu"),
])
def test_the_sweep_plot_is_titled_after_the_swept_keys(tmp_path, monkeypatch, block_sizes, budgets, title):
    titles = []
    monkeypatch.setattr(Figure, "suptitle", lambda figure, text, **options: titles.append(text))
    for block_size in block_sizes:
        for budget in budgets:
            directory = tmp_path / f"b{block_size}-{budget}"
            directory.mkdir()
            write_atomic(pa.Table.from_pylist([summary_row(block_size)]), directory / "summary.parquet",
                         config(block_size, budget))
    analyze(tmp_path, tmp_path / "report")
    assert titles == [title]


def test_analyze_job_errors_are_one_line(tmp_path):
    def job(*overrides):
        return subprocess.run([sys.executable, "-m", "engine.run", "job=analyze", f"hydra.run.dir={tmp_path / 'run'}",
                               *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)

    result = job(f"job.root={tmp_path / 'nowhere'}")
    assert result.returncode == 1 and "job.root: no such directory" in result.stderr
    (tmp_path / "empty").mkdir()
    result = job(f"job.root={tmp_path / 'empty'}")
    assert result.returncode == 1 and "no usable summary.parquet" in result.stderr
    result = job()
    assert result.returncode == 1 and "job.root: set it" in result.stderr
    write_run(tmp_path / "sweep" / "b16", 16)
    (tmp_path / "a_file").write_text("")
    result = job(f"job.root={tmp_path / 'sweep'}", f"job.out={tmp_path / 'a_file'}")
    assert result.returncode == 1 and "error: job.out: cannot make the directory" in result.stderr, result.stderr

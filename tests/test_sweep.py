"""A block-size sweep end to end, as the README runs it: a Hydra multirun of the bench job on the tiny model
at equal KV memory (cache.kv_budget_gb), then job=analyze on the sweep directory."""
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from engine.kv_cache import KVCacheSpec, bytes_per_block, num_blocks_for
from engine.models.loader import model_spec

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZES = (8, 16, 32)


def engine_run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # several small runs on few cores: no thread contention
    return subprocess.run([sys.executable, "-m", "engine.run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_kv_budget_gives_every_block_size_the_same_memory(make_config):
    budget = 0.001
    for block_size in (1, 8, 16, 32, 64, 128):
        cfg = make_config(f"cache.block_size={block_size}", f"cache.kv_budget_gb={budget}", "model.max_model_len=512")
        arch = model_spec(cfg.model, None)[1]
        spec = KVCacheSpec(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim)
        per_block = bytes_per_block(spec, block_size, torch.float32)
        blocks = num_blocks_for(cfg.cache, per_block, torch.device("cpu"), cfg.model.max_model_len, 1)
        assert budget * 1e9 - per_block < blocks * per_block <= budget * 1e9


def test_multirun_sweep_then_analyze(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = engine_run("-m", "job=bench", f"cache.block_size={','.join(map(str, BLOCK_SIZES))}",
                        "cache.kv_budget_gb=0.0005", "model.max_model_len=512", "job.num_prompts=6", "job.input_len=[8,40]",
                        "job.output_len=[4,12]", "scheduler.max_num_seqs=4", f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(sweep_dir.rglob("summary.parquet"))
    runs = {p.parent for p in summaries}
    assert len(runs) == len(BLOCK_SIZES) and all(run.parent == sweep_dir for run in runs)  # one directory each
    rows = [pq.read_table(p).to_pylist()[0] for p in summaries]
    assert sorted(r["block_size"] for r in rows) == list(BLOCK_SIZES)
    assert len({r["output_tokens"] for r in rows}) == 1  # the same workload in every run
    per_token = rows[0]["kv_budget_bytes"] / rows[0]["kv_slots"]
    for row, path in zip(rows, summaries):
        assert 0.0005e9 - row["block_size"] * per_token < row["kv_budget_bytes"] <= 0.0005e9  # equal memory
        steps = pq.read_table(path.with_name("steps.parquet")).to_pylist()
        assert row["num_steps"] == len(steps)
        assert row["peak_blocks_used"] == max(s["blocks_used"] for s in steps)
        util = [100 * s["stored_tokens"] / s["allocated_slots"] for s in steps if s["allocated_slots"]]
        assert row["mean_paged_kv_utilization_pct"] == pytest.approx(sum(util) / len(util))
        assert row["preemptions"] == sum(s["preemptions"] for s in steps)

    result = engine_run("job=analyze", f"job.root={sweep_dir}", f"hydra.run.dir={tmp_path / 'analyze'}")
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = pq.read_table(sweep_dir / "sweep.parquet").to_pylist()
    assert [r["block_size"] for r in sweep] == list(BLOCK_SIZES)
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(BLOCK_SIZES)
    assert not [line for line in result.stdout.splitlines() if line.startswith("skipped")]
    for name in ("throughput", "utilization", "waste", "steps_utilization", "sweep"):
        assert (sweep_dir / f"{name}.png").stat().st_size > 1000

"""The bench job: nano-vllm's workload reproduced exactly, and the transformers baseline on CPU."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq

from engine.sequence import SamplingParams
from jobs.bench import workload

ROOT = Path(__file__).resolve().parents[1]


def test_nano_workload_is_nano_vllms():
    requests = workload(SimpleNamespace(workload="nano"), SamplingParams(), vocab_size=151936)
    assert len(requests) == 256
    assert sum(len(p) for p, _ in requests) == 142_827  # the figures nano-vllm's bench.py produces
    assert sum(s.max_tokens for _, s in requests) == 133_966
    assert all(s.temperature == 0.6 and s.ignore_eos for _, s in requests)
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p, _ in requests)


def test_bench_with_the_transformers_baseline_on_the_tiny_model(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "engine.run", "job=bench", "job.num_prompts=6", "job.input_len=[8,40]",
         "job.output_len=[8,16]", "job.baseline=hf", "job.hf_batch_size=4", "sampling.temperature=0",
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    summary = pq.read_table(tmp_path / "summary.parquet").to_pylist()[0]
    assert summary["num_requests"] == 6 and summary["device"] == "cpu"
    assert summary["speedup_vs_hf"] == summary["output_tok_per_s"] / summary["hf_output_tok_per_s"]
    # float32, greedy, same weights: transformers' padded batches give the same tokens as the engine
    assert summary["hf_match_first32_pct"] == 100.0

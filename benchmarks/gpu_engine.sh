#!/usr/bin/env bash
# The GPU engine's checks and benchmarks in one device call (issue 4). Logs go to $OUT (or ./gpu_logs).
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_engine.sh [quick]
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"; runs=/tmp/minipaged_runs; rm -rf "$runs"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
show() { python3 -c "import pyarrow.parquet as pq, sys; r = pq.read_table(sys.argv[1]).to_pylist()[0]; print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})" "$1"; }
bench() { name=$1; shift; python3 -m engine.run job=bench model=qwen3-0.6b scheduler.max_num_seqs=256 \
  scheduler.max_num_batched_tokens=16384 hydra.run.dir=$runs/$name "$@" 2>&1 | grep -v '^\s*$' | tail -4 | tee -a "$out/bench.log"
  show $runs/$name/summary.parquet | tee -a "$out/bench.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -x -q tests/test_fused.py tests/test_oracle.py tests/test_scheduler.py tests/test_sampler.py 2>&1 | tail -15 | tee "$out/tests.log"
bench nano job.workload=nano
[ "${1:-}" = quick ] && exit 0
python3 benchmarks/profile_decode.py 256 1024 2>&1 | grep -v Warning | head -30 | tee "$out/profile.log"
bench hf256 job.num_prompts=256 job.input_len=[100,1024] job.output_len=[256,256] job.baseline=hf
bench greedy_match job.num_prompts=64 job.input_len=[100,1024] job.output_len=[32,32] job.baseline=hf sampling.temperature=0

#!/usr/bin/env bash
# executor=ray's scaling on one machine: 512 prompts of nano's distribution (nano-vllm's lengths, 100-1024
# prompt and output tokens, temperature 0.6, ignore_eos) on 1 engine, then on 2 (one GPU each), end to end.
# Usage on the GPU machine, from the repo root: bash benchmarks/ray_scaling.sh [NUM_ENGINES ...]   (default: 1 2)
# Ray must be importable (no network there: the lead installs it into /tmp/site, put on PYTHONPATH here).
# Logs go to $OUT (or ./gpu_logs). MODEL: the model (default qwen3-0.6b); BENCH_ARGS: extra overrides.
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"; runs=/tmp/minipaged_ray_runs; rm -rf "$runs"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
engines=${*:-1 2}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import ray; print('ray', ray.__version__)" | tee "$out/ray_scaling.log"
for n in $engines; do
  echo "== $n engine(s)" | tee -a "$out/ray_scaling.log"
  start=$(date +%s.%N)
  python3 -m engine.run job=bench model=${MODEL:-qwen3-0.6b} job.workload=random job.num_prompts=512 \
    'job.input_len=[100,1024]' 'job.output_len=[100,1024]' sampling.temperature=0.6 \
    executor=ray executor.num_engines=$n hydra.run.dir=$runs/ray$n ${BENCH_ARGS:-} 2>&1 \
    | grep -E "minipaged|rror" | grep -v "^\s*$" | tail -6 | tee -a "$out/ray_scaling.log"
  echo "process wall $(python3 -c "import time; print(round(time.time() - $start, 2))") s (python start-up and imports included)" \
    | tee -a "$out/ray_scaling.log"
done
python3 - $runs $engines <<'PY' | tee -a "$out/ray_scaling.log"
import sys, pyarrow.parquet as pq
runs, engines = sys.argv[1], sys.argv[2:]
keys = ("num_engines", "wall_time_s", "ray_init_s", "startup_s", "load_s", "tail_s", "output_tokens", "output_tok_per_s",
        "num_steps", "preemptions")
rows = {n: pq.read_table(f"{runs}/ray{n}/summary.parquet").to_pylist()[0] for n in engines}
for n, r in rows.items():
    print({k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keys})
    print("  per engine: ready at", [round(t, 2) for t in r["engine_ready_s"]], "s, done at",
          [None if t is None else round(t, 2) for t in r["engine_done_s"]], "s")
    steps = pq.read_table(f"{runs}/ray{n}/steps.parquet").to_pylist()
    for e in sorted({s["engine"] for s in steps}):
        mine = [s for s in steps if s["engine"] == e]
        print(f"  engine {e}: {len(mine)} steps, {sum(s['step_time_s'] for s in mine):.2f} s in steps, "
              f"{sum(s['finished'] for s in mine)} requests")
if len(rows) > 1:
    first, last = rows[engines[0]], rows[engines[-1]]
    print(f"speed-up {engines[-1]} vs {engines[0]} engines, end to end: {first['wall_time_s'] / last['wall_time_s']:.2f}x; "
          f"after start-up: {(first['wall_time_s'] - first['startup_s']) / (last['wall_time_s'] - last['startup_s']):.2f}x")
PY

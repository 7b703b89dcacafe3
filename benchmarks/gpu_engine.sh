#!/usr/bin/env bash
# The GPU engine's checks and benchmarks in one device call.
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_engine.sh [SECTION ...]
# Sections: tests nano long topp shared hang models samples logprobs profile baseline sweep piecewise json fp8
# rollout startup moe kl fp8_70b fp8_long
# (default: tests nano long topp shared profile). hang: issue 28's top-p job (4,096 random prompts, top_p
# alone), which hung the GPU before the truncating sampler's rounds were bounded.
# Every bench runs with the engine's defaults (no scheduler flags). Logs go to $OUT (or ./gpu_logs).
# TESTS_K: a pytest -k filter for the tests section (default: the whole suite); PROFILE: profile_decode.py's
# SEQS:CONTEXT list; BENCH_ARGS: extra overrides for every bench run; MODEL: the model (default qwen3-0.6b).
# json: issue 30's job, 1,024 prompts of nano's lengths each constrained to one of 4 JSON schemas, then the
# same unconstrained, then benchmarks/structured_profile.py; TOKENIZER: the tokenizer they use (default
# .bench/bpe151k: `python benchmarks/grammar_backends.py --vocab 151643 --site-packages --save .bench/bpe151k`).
# fp8: issue 31's trio in one call, Qwen3-8B `nano` in bf16, with model.quantization=fp8, and with an FP8 KV
# cache too, after benchmarks/fp8_gemm.py's per-projection times (no Triton sweep). fp8_long: the Qwen3-8B shape's
# `long` in bf16, then with FP8 weights and KV (~200 s). fp8_70b: the Llama-3.3-70B
# shape's `nano` with FP8 weights and KV (~210 s with its start-up). rollout: issue 33's workload (512 prompts x 16 samples).
# startup: a 64-prompt job's start-up breakdown, twice (the second with the Triton and bytecode caches warm). moe: the
# experts op's launches, measured and saved to ops/moe_tuned/ (benchmarks/moe_op.py --save), then the Qwen3-30B-A3B shape's nano. kl: issue 31's KL divergence
# of FP8 weights, FP8 KV and both from bf16 (benchmarks/fp8_kl.py; MODEL defaults to qwen3-8b there).
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"; runs=/tmp/minipaged_runs; rm -rf "$runs"
sections=${*:-tests nano long topp shared profile}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
want() { [[ " $sections " == *" $1 "* ]]; }
show() { python3 -c "import pyarrow.parquet as pq, sys; r = pq.read_table(sys.argv[1]).to_pylist()[0]; print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})" "$1"; }
bench() { name=$1; shift; echo "== $name $*" | tee -a "$out/bench.log"; python3 -m engine.run job=bench model=${MODEL:-qwen3-0.6b} \
  hydra.run.dir=$runs/$name ${BENCH_ARGS:-} "$@" 2>&1 | grep -v '^\s*$' | tail -4 | tee -a "$out/bench.log"
  show $runs/$name/summary.parquet | tee -a "$out/bench.log"; }
steps() { python3 - "$1" <<'PY' | tee -a "$out/bench.log"
import sys, pyarrow.parquet as pq
from pathlib import Path
rows = pq.read_table(sys.argv[1]).to_pylist()
summary = pq.read_table(Path(sys.argv[1]).with_name("summary.parquet")).to_pylist()[0]
for phase in ("prefill", "mixed", "decode"):
    sel = [r for r in rows if r["phase"] == phase]
    print(f"{phase}: {len(sel)} steps, {sum(r['step_time_s'] for r in sel):.3f} s, {sum(r['tokens'] for r in sel)} tokens")
print(f"prompt tokens {summary['prompt_tokens']}, computed in prefill {sum(r['num_prefill_tokens'] for r in rows)}, "
      f"prefix-cache hits {sum(r['prefix_cache_hit_tokens'] for r in rows)}")
print("slowest steps:", [(r["step"], r["phase"], r["seqs"], round(r["step_time_s"] * 1e3, 1)) for r in sorted(rows, key=lambda r: -r["step_time_s"])[:8]])
import numpy as np  # step time as fixed + per decode row + per prefill token + per stored token (steps under 0.5 s)
for phase in ("mixed", "decode"):
    sel = [r for r in rows if r["phase"] == phase and r["step_time_s"] < 0.5]
    if len(sel) > 4:
        X = np.array([[1, r["num_decode_seqs"], r["num_prefill_tokens"], r["logical_tokens"] / 1e6] for r in sel], float)
        c = np.linalg.lstsq(X, np.array([r["step_time_s"] * 1e3 for r in sel]), rcond=None)[0]
        print(f"{phase} fit: ms = {c[0]:.2f} + {c[1]:.4f}/decode row + {c[2]:.5f}/prefill token + {c[3]:.2f}/M stored tokens")
# decode time by batch size, against reading each step's K/V once at the H200's copy speed
kv_s = lambda r: r["logical_tokens"] * summary["kv_budget_bytes"] / summary["kv_slots"] / 4.26e12
edges = [1, 9, 17, 33, 65, 129, 193, 257, 321, 385, 449, 513]
print("seqs      steps  time_s  kv_floor_s  ms/step  excess_ms/step")
for lo, hi in zip(edges, edges[1:]):
    sel = [r for r in rows if r["phase"] == "decode" and lo <= r["seqs"] < hi]
    if sel:
        t, f = sum(r["step_time_s"] for r in sel), sum(kv_s(r) for r in sel)
        print(f"{lo:3d}-{hi - 1:<3d} {len(sel):7d} {t:7.3f} {f:11.3f} {1e3 * t / len(sel):8.2f} {1e3 * (t - f) / len(sel):14.2f}")
PY
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
want tests && python3 -m pytest -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -25 | tee "$out/tests.log"
want nano && { bench nano job.workload=nano; steps $runs/nano/steps.parquet; cp $runs/nano/steps.parquet "$out/nano_steps.parquet"; }
want long && { bench long job.workload=long; steps $runs/long/steps.parquet; cp $runs/long/steps.parquet "$out/long_steps.parquet"; }
want topp && { bench long_topp job.workload=long sampling.top_p=0.95 sampling.top_k=20; steps $runs/long_topp/steps.parquet; }
want shared && { bench shared job.workload=shared_prefix; steps $runs/shared/steps.parquet; cp $runs/shared/steps.parquet "$out/shared_steps.parquet"; }
want hang && bench hang job.num_prompts=4096 'job.input_len=[100,2000]' 'job.output_len=[16,512]' job.seed=7 \
  sampling.temperature=0.8 sampling.top_p=0.95
if want piecewise; then  # the same three workloads with steps that carry prompt chunks run eagerly (no piecewise graphs)
  for w in nano shared_prefix long; do bench ${w}_eager job.workload=$w model.piecewise_graphs=false; steps $runs/${w}_eager/steps.parquet; done
fi
if want json; then
  for k in 4 0; do
    bench json$k job.workload=random job.num_prompts=1024 'job.input_len=[100,1024]' 'job.output_len=[100,1024]' \
      sampling.temperature=0.6 job.json_schemas=$k model.tokenizer=${TOKENIZER:-.bench/bpe151k}; steps $runs/json$k/steps.parquet
  done
  python3 benchmarks/structured_profile.py ${TOKENIZER:-.bench/bpe151k} 256 4 2>&1 | grep -v INFO | tee "$out/structured_profile.log"
fi
want models && for m in llama-3.2-1b qwen2.5-0.5b; do MODEL=$m bench nano_$m job.workload=nano; done
if want fp8; then
  MODEL=qwen3-8b LAYERS=8 TRITON=0 python3 benchmarks/fp8_gemm.py 1 16 64 128 136 256 2>&1 | grep -v Warn | tee "$out/fp8_gemm.log"
  MODEL=qwen3-8b bench nano_8b_bf16 job.workload=nano
  MODEL=qwen3-8b bench nano_8b_fp8 job.workload=nano model.quantization=fp8
  MODEL=qwen3-8b bench nano_8b_fp8kv job.workload=nano model.quantization=fp8 cache.kv_cache_dtype=fp8
fi
if want fp8_long; then
  MODEL=qwen3-8b bench long_8b_bf16 job.workload=long; steps $runs/long_8b_bf16/steps.parquet
  MODEL=qwen3-8b bench long_8b_fp8 job.workload=long model.quantization=fp8 cache.kv_cache_dtype=fp8
  steps $runs/long_8b_fp8/steps.parquet
fi
want fp8_70b && { MODEL=llama-3.3-70b bench nano_70b job.workload=nano model.quantization=fp8 cache.kv_cache_dtype=fp8
  steps $runs/nano_70b/steps.parquet; }
want kl && python3 benchmarks/fp8_kl.py ${MODEL:-qwen3-8b} 64 512 2>&1 | grep -v Warn | tee "$out/fp8_kl.log"
want rollout && { bench rollout job.workload=rollout; steps $runs/rollout/steps.parquet; }
if want startup; then (  # issue 33: a 64-prompt job's start-up breakdown, the first time on this machine, then again
  # with the Python bytecode the first run wrote, as a machine with installed packages has (the lent H200 sets
  # PYTHONDONTWRITEBYTECODE, so every process there compiles ~1,850 modules' sources: 3-5 s); the first run with an
  # empty Triton cache, whatever ran before it in this call
  export PYTHONPYCACHEPREFIX=/tmp/minipaged_pycache TRITON_CACHE_DIR=$(mktemp -d); unset PYTHONDONTWRITEBYTECODE
  for run in first again; do
    t0=$(date +%s.%N)
    python3 -m engine.run job=bench model=${MODEL:-qwen3-0.6b} job.num_prompts=64 hydra.run.dir=$runs/startup_$run \
      >"$out/startup_$run.log" 2>&1; grep -E "start-up|output tok/s" "$out/startup_$run.log" | tee -a "$out/startup.log"
    echo "$run: process wall $(python3 -c "import time; print(round(time.time() - $t0, 2))") s" | tee -a "$out/startup.log"
  done
  # the warm run's whole wall by function (cProfile: cumulative seconds, the 45 largest)
  python3 -m cProfile -o "$out/startup.prof" -m engine.run job=bench model=${MODEL:-qwen3-0.6b} job.num_prompts=64 \
    hydra.run.dir=$runs/startup_profiled >/dev/null 2>&1
  python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(45)" "$out/startup.prof" \
    | tail -n 55 | cut -c1-160 >"$out/startup_profile.txt"
  # what the 12-13 s before the engine are: the imports' cumulative times, largest first
  python3 -X importtime -c "import jobs.cli, jobs.generate, jobs.bench, engine.engine" 2>&1 >/dev/null |
    sort -t'|' -k2 -n -r | head -25 | tee -a "$out/startup.log"
) fi  # a subshell: the caches it sets are its own
want moe && { python3 benchmarks/moe_op.py --save 2>&1 | grep -v Warn | tee "$out/moe_op.log"
  MODEL=qwen3-30b-a3b bench nano_moe job.workload=nano; steps $runs/nano_moe/steps.parquet; }
want samples && { bench nano64_n4 job.num_prompts=64 'job.input_len=[100,1024]' 'job.output_len=[100,1024]' sampling.temperature=0.6 sampling.n=4; steps $runs/nano64_n4/steps.parquet; }
want logprobs && bench nano_logprobs job.workload=nano sampling.logprobs=5
want profile && python3 benchmarks/profile_decode.py ${PROFILE:-256:1024 128:100-2000 48:900-2000 16:1000-2000 4:1500-2000} 2>&1 | grep -v Warning | head -120 | tee "$out/profile.log"
if want baseline; then
  bench hf256 job.num_prompts=256 job.input_len=[100,1024] job.output_len=[256,256] job.baseline=hf
  bench greedy_match job.num_prompts=64 job.input_len=[100,1024] job.output_len=[32,32] job.baseline=hf sampling.temperature=0
fi
if want sweep; then
  python3 -m engine.run -m job=bench model=qwen3-0.6b cache.block_size=8,16,32,64,128 \
    cache.kv_budget_gb=8 job.num_prompts=256 'job.input_len=[100,1024]' 'job.output_len=[100,512]' \
    hydra.sweep.dir=$runs/sweep 2>&1 | grep -E "INFO|rror" | tee -a "$out/sweep.log"
  python3 -m engine.run job=analyze job.root=$runs/sweep 2>&1 | tail -12 | tee -a "$out/sweep.log"
  cp $runs/sweep/sweep.png $runs/sweep/sweep.parquet "$out/"
fi

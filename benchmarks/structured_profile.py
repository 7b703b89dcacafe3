"""Where a constrained step's extra time goes: the bench's JSON-schema workload (jobs/bench.py,
job.json_schemas) through the engine at 512 sequences, with the host's phases of each step timed in place
(time.perf_counter, summed over the run): the schedule, the launch and inside it the accepts and the fills'
start (ModelRunner._start_masks), the wait for the fills and the mask's launch (ModelRunner._masked, when
the next step's launch or a read of the tokens draws), the waits for the previous step's tokens; then the
resolve. By the number of constrained rows, medians of a step's accepts, its waits for tokens and its fills
(on their threads, beside the rest: the first one's start to the last one's end). Rows: drawn, filled. On the device (CUDA events around
ops.apply_token_bitmask): the kernel. Then, outside the engine, the fill and the accepts (one by one,
against llguidance's parallel consume_token_par) at 32, 128 and 512 rows; and the upload alone: a pinned
[rows, words] int32 bitmask copied to the device, timed with events.
Usage: python3 benchmarks/structured_profile.py TOKENIZER_DIR [NUM_PROMPTS] [JSON_SCHEMAS] [OVERRIDE ...]
       (a tokenizer saved by `benchmarks/grammar_backends.py --save`; defaults 256 prompts, 4 schemas;
       OVERRIDEs: more config keys; FILL_THREADS=N in the environment: llguidance's fill threads, instead of
       its default of 80% of the CPUs). It first prints the host's CPUs: logical, and cores (Linux's topology).
"""
import collections
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import llguidance

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402
from benchmarks.profile_decode import bench_engine  # noqa: E402
from engine import model_runner, structured  # noqa: E402
from engine.generation_config import resolve_sampling  # noqa: E402
from engine.structured import allocate_bitmask, bitmask_words, fill_bitmasks  # noqa: E402
from jobs.bench import workload  # noqa: E402


def timed(record: collections.Counter, name: str, function):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            record[name] += time.perf_counter() - start
    return run


def host_cpus() -> str:
    """The logical CPUs and the distinct (package, core) pairs behind them, from /sys."""
    cores = set()
    for cpu in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        cores.add(((cpu / "physical_package_id").read_text(), (cpu / "core_id").read_text()))
    return f"{os.cpu_count()} logical CPUs on {len(cores) or 'unknown'} cores"


def main(tokenizer: str, num_prompts: int, schemas: int, overrides: list[str]) -> None:
    print(host_cpus(), flush=True)
    if "FILL_THREADS" in os.environ:
        threads = int(os.environ["FILL_THREADS"])
        structured._executor = functools.cache(lambda: llguidance.LLExecutor(threads))
        print(f"llguidance's fill threads: {threads}")
    engine = bench_engine(f"model.tokenizer={tokenizer}", "job.workload=random", f"job.num_prompts={num_prompts}",
                          "job.input_len=[100,1024]", "job.output_len=[100,1024]", f"job.json_schemas={schemas}",
                          "sampling.temperature=0.6", "scheduler.max_num_seqs=512", *overrides)
    requests = workload(engine.cfg.job, resolve_sampling(engine.cfg.sampling, engine.generation_config),
                        engine.model.arch.vocab_size)
    start = time.perf_counter()
    engine.grammars  # noqa: B018 (built here, as the bench job's setup builds it)
    print(f"grammar compiler: {time.perf_counter() - start:.2f} s for {len(engine.tokenizer)} tokens", flush=True)
    host, rows, kernels = collections.Counter(), collections.Counter(), []
    runner = engine.runner
    engine.scheduler.schedule = timed(host, "schedule", engine.scheduler.schedule)
    engine._resolve = timed(host, "resolve", engine._resolve)
    engine._tokens = timed(host, "waits for tokens", engine._tokens)
    runner.launch = timed(host, "launch", runner.launch)
    runner._start_masks = timed(host, "launch: accepts, fills started", runner._start_masks)
    runner._masked = timed(host, "draw: waits for the fills, mask launched", runner._masked)
    steps = per_step_phases(runner, model_runner, engine, rows)
    plain_sample = runner._sample

    def sample(inputs, *args):
        rows["drawn"] += inputs.logits.shape[0]
        return plain_sample(inputs, *args)

    runner._sample = sample
    plain_apply = ops.apply_token_bitmask

    def apply(*args, **kwargs):
        if not torch.cuda.is_available():
            return plain_apply(*args, **kwargs)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = plain_apply(*args, **kwargs)
        end.record()
        kernels.append((begin, end))
        return out

    ops.apply_token_bitmask = apply
    with torch.inference_mode():
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        engine.stats.restart_clock()
        start = time.perf_counter()
        tokens = sum(len(s.output_token_ids) for s in engine.run())
        wall = time.perf_counter() - start
    num_steps = len(engine.stats.steps)
    print(f"{num_prompts} requests, {schemas} schemas, {' '.join(overrides) or 'defaults'}: {tokens} output tokens in "
          f"{wall:.2f} s = {tokens / wall:.0f} tok/s; {num_steps} steps; first token {engine.stats.first_token_s:.3f} s")
    print("host per step, ms: " + ", ".join(f"{name} {1e3 * t / num_steps:.3f}" for name, t in sorted(host.items())))
    print("constrained rows  steps  accepts  waits for tokens  fills (first start to last end)  ms a step, medians")
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        sel = [s for s in steps if lo <= s["rows"] < hi and "fill_end" in s]
        if sel:
            med = lambda key: 1e3 * statistics.median(key(s) for s in sel)  # noqa: E731
            print(f"{lo:4d}-{hi - 1:<4d} {len(sel):14d} {med(lambda s: s['end'] - s['start'] - s['waits']):8.2f} "
                  f"{med(lambda s: s['waits']):17.2f} {med(lambda s: s['fill_end'] - s['fill_start']):32.2f}")
    print("rows: " + ", ".join(f"{name} {n}" for name, n in rows.items()) +
          f"; device apply kernel {statistics.mean([b.elapsed_time(e) for b, e in kernels] or [0]):.3f} ms")
    accept_costs(engine.grammars, requests, (32, 128, 512))
    width = bitmask_words(engine.grammars.vocab_size)
    for count in (64, 256) if torch.cuda.is_available() else ():
        host = torch.empty((count, width), dtype=torch.int32, pin_memory=True)
        device = torch.empty_like(host, device="cuda")
        times = []
        for _ in range(20):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            device.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        print(f"upload of a pinned [{count}, {width}] int32 bitmask: median {statistics.median(times):.3f} ms")


BUCKETS = [1, 33, 65, 129, 257, 385, 513]


def per_step_phases(runner, model_runner, engine, rows: collections.Counter) -> list[dict]:
    """Hooks that record, for each step with masks: its constrained rows, when the accepts began and the
    fills were started (start, end), the waits for the previous step's tokens inside (waits), and when
    the first fill began and the last one ended (fill_start, fill_end, set on the fill threads)."""
    steps, plain_start, plain_fill, plain_tokens = [], runner._start_masks, model_runner.start_fill_bitmasks, engine._tokens

    def start_masks(drawing, *args):
        steps.append({"rows": sum(s.constraint is not None for s in drawing), "start": time.perf_counter(), "waits": 0.0})
        try:
            return plain_start(drawing, *args)
        finally:
            steps[-1]["end"] = time.perf_counter()

    def tokens(step):
        start = time.perf_counter()
        try:
            return plain_tokens(step)
        finally:
            if steps and "end" not in steps[-1]:
                steps[-1]["waits"] += time.perf_counter() - start

    def fill(pairs, *args):
        record = steps[-1]
        rows["filled"] += len(pairs)
        record.setdefault("fill_start", time.perf_counter())
        future = plain_fill(pairs, *args)
        future.add_done_callback(lambda _: record.update(fill_end=time.perf_counter()))
        return future

    runner._start_masks, engine._tokens, model_runner.start_fill_bitmasks = start_masks, tokens, fill
    return steps


def accept_costs(compiler, requests, counts, steps: int = 24) -> None:
    """Per step at R rows (the requests' constraints in turn, each row walking random allowed tokens): the
    masks' fill, and one accepted token per row one by one (GrammarMatcher.accept) against llguidance's
    consume_token_par (its threads), alternating steps; medians."""
    rng = np.random.default_rng(0)
    for count in counts:
        matchers = [compiler.new_matcher(requests[i % len(requests)][1].structured_outputs, None) for i in range(count)]
        bitmask = allocate_bitmask(count, compiler.vocab_size)
        fill, serial, parallel = [], [], []
        for step in range(steps):
            start = time.perf_counter()
            fill_bitmasks(((m, i) for i, m in enumerate(matchers)), bitmask)
            fill.append(time.perf_counter() - start)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]
            start = time.perf_counter()
            if step % 2:
                structured._executor().consume_token_par([(m._matcher, t) for m, t in zip(matchers, tokens)])
            else:
                for m, t in zip(matchers, tokens):
                    m.accept(t)
            (parallel if step % 2 else serial).append(time.perf_counter() - start)
        ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
        print(f"{count} rows: fill {ms(fill):.3f} ms; accept one by one {ms(serial):.3f} ms, consume_token_par {ms(parallel):.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256, int(sys.argv[3]) if len(sys.argv) > 3 else 4,
         sys.argv[4:])

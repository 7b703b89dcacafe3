"""GPU benchmark of sampling. Run on a CUDA machine: python3 benchmarks/sampling.py

engine.sampler.sample with the Triton kernels of ops/sampling.py against a sort-based sampler (the
usual torch recipe, kept below as the baseline), at Qwen3's vocabulary (151,936) with bf16 logits,
batch 1 / 64 / 256, temperature 0.7, for two logit distributions: flat, as a random-weights
Qwen3-0.6B gives them (std 0.02 x sqrt(hidden 1024) = 0.64), and peaked, N(0, 3^2). Cases:
temperature only (gumbel_sample), top_p 0.9, top_k 20 + top_p 0.95 (Qwen3's settings), top_k 50,
and temperature only forced through the top-k/top-p kernels (what an untruncated row costs in a
batch where other rows truncate). Prints microseconds per call (triton.testing.do_bench medians,
eager calls: launch overhead included) and checks every row of the kernels' path against
ops/sampling_reference.py, which defines the kept set by tie groups (the sort-based sampler cuts ties
by sort position, so it is timed, not compared). Rows whose kept set depends on float32 rounding (a
token's mass within 1e-5 of top_p) are counted apart. Exit status 1 when a row disagrees. On a
machine without CUDA it says so and exits with 0.

Then the sampler's other features on the same logits, microseconds per call: min_p 0.05
(sample, checked against the reference); logprobs k=5 (ops.logprobs after a draw: its Triton kernel,
checked against the reference, and the reference's torch ops for comparison); min_tokens (two banned
ids per row) and penalties (repetition 1.1, presence 0.3, frequency 0.3 over 1,024-token histories)
added to a temperature-only draw.

python3 benchmarks/sampling.py --nano: the nano workload through the engine (Qwen3-0.6B shape, random
weights) in rounds alternating logprobs None and 5, output tok/s of each and their ratio (logprobs=5 is
meant to cost at most 5%).
"""
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ops  # noqa: E402
from engine.sampler import SamplingTensors, TokenHistory, sample  # noqa: E402
from engine.sequence import SamplingParams, Sequence  # noqa: E402
from ops import sampling_reference  # noqa: E402
from ops.sampling_reference import gumbel_scores  # noqa: E402

VOCAB, BATCHES, TEMPERATURE = 151936, (1, 64, 256), 0.7
DISTRIBUTIONS = {"flat": 0.64, "peaked": 3.0}
CASES = {  # name: (top_k, top_p)
    "temperature": (-1, 1.0),
    "top_p=0.9": (-1, 0.9),
    "top_k=20,top_p=0.95": (20, 0.95),
    "top_k=50": (50, 1.0),
}


# --- the baseline: a sort-based sampler (ties cut by sort position) ---------------------------
def truncate(logits, top_k, top_p):
    sorted_logits, token_ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (rank[None, :] >= top_k[:, None]) | (mass_before > top_p[:, None])
    return sorted_logits.masked_fill(drop, float("-inf")), token_ids


def sort_sample(logits, t):
    if not t.any_truncation:
        return ops.gumbel_sample(logits, t.temperature, t.seed, t.step)
    logits = logits.float()
    temperature = t.temperature.clamp(min=1e-6)
    kept, token_ids = truncate(logits / temperature[:, None], t.top_k, t.top_p)
    scores = gumbel_scores(kept, torch.ones_like(temperature), t.seed, t.step, token_ids)
    drawn = token_ids.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(t.temperature == 0, logits.argmax(dim=-1), drawn)


# ---------------------------------------------------------------------------------------------
def near_boundary(logits, t):
    """Rows whose kept set depends on float32 rounding: a prefix of the sorted masses (float64)
    within 1e-5 of top_p."""
    l = logits.double()
    e = torch.exp((l - l.max(-1, keepdim=True).values) / t.temperature.double()[:, None])
    prefix = e.sort(-1, descending=True).values.cumsum(-1) / e.sum(-1, keepdim=True)
    return ((t.top_p < 1) & ((prefix - t.top_p.double()[:, None]).abs() < 1e-5).any(-1)).cpu()


def tensors(batch, top_k, top_p):
    params = [SamplingParams(temperature=TEMPERATURE, top_k=top_k, top_p=top_p, seed=i) for i in range(batch)]
    return SamplingTensors.build(params, [7] * batch, VOCAB, "cuda")


def check(logits, t):
    """(rows equal to the reference, rows compared): near-boundary rows are left out."""
    drawn = sample(logits, t).cpu()
    expected = ops.top_k_top_p_sample(logits, t.temperature, t.top_k, t.top_p, t.seed, t.step,
                                      backend="torch", min_p=t.min_p).cpu()
    compared = ~near_boundary(logits, t)
    return int((drawn == expected)[compared].sum()), int(compared.sum())


def main():
    if not torch.cuda.is_available():
        print("benchmarks/sampling.py needs CUDA: nothing timed")
        return 0
    from triton.testing import do_bench

    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"vocab {VOCAB}, bf16 logits, temperature {TEMPERATURE}; us per call (do_bench median)")
    print(f"{'logits':7} {'case':28} {'batch':>5} {'sort us':>9} {'new us':>9} {'speedup':>8}  rows equal")
    failures = 0
    for dist, std in DISTRIBUTIONS.items():
        all_logits = (torch.randn(max(BATCHES), VOCAB, device="cuda", generator=gen) * std).bfloat16()
        for case, (top_k, top_p) in CASES.items():
            for batch in BATCHES:
                logits = all_logits[:batch]
                t = tensors(batch, top_k, top_p)
                equal, compared = check(logits, t)
                failures += equal != compared
                old_us = 1e3 * do_bench(lambda: sort_sample(logits, t), return_mode="median")
                new_us = 1e3 * do_bench(lambda: sample(logits, t), return_mode="median")
                print(f"{dist:7} {case:28} {batch:5d} {old_us:9.1f} {new_us:9.1f} {old_us / new_us:7.1f}x"
                      f"  {equal}/{compared}{'' if compared == batch else f' ({batch - compared} near top_p)'}",
                      flush=True)
            if case == "temperature":  # the same rows through the top-k/top-p kernels
                for batch in BATCHES:
                    logits, t = all_logits[:batch], tensors(batch, -1, 1.0)
                    args = (logits, t.temperature, t.top_k, t.top_p, t.seed, t.step)
                    us = 1e3 * do_bench(lambda: ops.top_k_top_p_sample(*args), return_mode="median")
                    same = bool(torch.equal(ops.top_k_top_p_sample(*args), sample(logits, t)))
                    failures += not same
                    print(f"{dist:7} {'temperature via top-k/top-p':28} {batch:5d} {'':9} {us:9.1f} {'':8}  "
                          f"{'same as gumbel_sample' if same else 'DIFFERS from gumbel_sample'}", flush=True)
        failures += features(dist, all_logits, do_bench)
    print(f"{'all rows agree' if not failures else f'{failures} cases DISAGREE'}; {time.time() - start:.0f} s")
    return failures


def penalised_tensors(batch, history_len=1024):
    """Temperature-only rows with the three penalties, their TokenHistory filled with random tokens."""
    params = SamplingParams(temperature=TEMPERATURE, repetition_penalty=1.1, presence_penalty=0.3,
                            frequency_penalty=0.3)
    history = TokenHistory(2 * history_len, "cuda")
    seqs = [Sequence(i, str(i), torch.randint(0, VOCAB, (history_len // 2,)).tolist(), params, 2 * history_len,
                     torch.randint(0, VOCAB, (history_len // 2,)).tolist()) for i in range(batch)]
    penalised = history.rows(seqs, None)
    return SamplingTensors.build([params] * batch, [history_len // 2] * batch, VOCAB, "cuda", (), penalised)


def features(dist, all_logits, do_bench):
    """min_p, logprobs, min_tokens and penalties at each batch size; returns the rows that disagree."""
    failures = 0
    for batch in BATCHES:
        logits = all_logits[:batch]
        bench = lambda fn: 1e3 * do_bench(fn, return_mode="median")  # noqa: E731
        params = [SamplingParams(temperature=TEMPERATURE, min_p=0.05, seed=i) for i in range(batch)]
        t = SamplingTensors.build(params, [7] * batch, VOCAB, "cuda")
        equal, compared = check(logits, t)
        failures += equal != compared
        print(f"{dist:7} {'min_p=0.05':28} {batch:5d} {'':9} {bench(lambda: sample(logits, t)):9.1f} {'':8}  "
              f"{equal}/{compared}", flush=True)
        plain = tensors(batch, -1, 1.0)
        tokens = sample(logits, plain)
        got, expected = ops.logprobs(logits, tokens, 5), sampling_reference.logprobs(logits, tokens, 5)
        same = [torch.equal(a, b) if a.dtype == torch.int32 else torch.allclose(a, b, atol=1e-4)
                for a, b in zip(ops.unpack_logprobs(got), ops.unpack_logprobs(expected))]
        failures += not all(same)
        print(f"{dist:7} {'logprobs=5 (after a draw)':28} {batch:5d} "
              f"{bench(lambda: sampling_reference.logprobs(logits, tokens, 5)):9.1f} "
              f"{bench(lambda: ops.logprobs(logits, tokens, 5)):9.1f} {'':8}  "
              f"{'same as the reference' if all(same) else 'DIFFERS from the reference'} (left: torch ops)", flush=True)
        banning = SamplingTensors.build([SamplingParams(temperature=TEMPERATURE, min_tokens=8, seed=i)
                                         for i in range(batch)], [7] * batch, VOCAB, "cuda", (151643, 151645))
        print(f"{dist:7} {'temperature + min_tokens':28} {batch:5d} {bench(lambda: sample(logits, plain)):9.1f} "
              f"{bench(lambda: sample(logits, banning)):9.1f} {'':8}  (left: without)", flush=True)
        penalised = penalised_tensors(batch)
        print(f"{dist:7} {'temperature + penalties':28} {batch:5d} {bench(lambda: sample(logits, plain)):9.1f} "
              f"{bench(lambda: sample(logits, penalised)):9.1f} {'':8}  (left: without)", flush=True)
    return failures


def nano(rounds=2):
    """Output tok/s of the nano workload with logprobs None and 5, rounds of each, alternating."""
    from benchmarks.profile_decode import bench_engine
    from jobs.bench import workload
    from engine.generation_config import resolve_sampling

    engine = bench_engine("job.workload=nano")
    requests = workload(engine.cfg.job, resolve_sampling(engine.cfg.sampling, engine.generation_config),
                        engine.model.arch.vocab_size)
    results = {None: [], 5: []}
    with torch.inference_mode():
        for round_ in range(rounds):
            for k in results:
                for i, (prompt, params) in enumerate(requests):
                    engine.add_request(f"{round_}-{k}-{i}", prompt, dataclasses.replace(params, logprobs=k))
                start = time.perf_counter()
                out = sum(len(s.output_token_ids) for s in engine.run())
                results[k].append(out / (time.perf_counter() - start))
                print(f"round {round_}, logprobs {k}: {results[k][-1]:.0f} output tok/s", flush=True)
                engine.block_manager.reset_prefix_cache()
    ratio = max(results[5]) / max(results[None])
    print(f"best of {rounds}: logprobs=5 at {100 * ratio:.1f}% of the output tok/s without ({100 * (1 - ratio):.1f}% lost)")


if __name__ == "__main__":
    if "--nano" in sys.argv:
        if not torch.cuda.is_available():
            print("benchmarks/sampling.py --nano needs CUDA: nothing timed")
            sys.exit(0)
        nano()
        sys.exit(0)
    sys.exit(1 if main() else 0)

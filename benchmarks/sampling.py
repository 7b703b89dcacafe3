"""GPU benchmark of sampling (issue 10, item 6). Run on a CUDA machine: python3 benchmarks/sampling.py

engine.sampler.sample with the Triton kernels of ops/sampling.py against the sort-based sampler
they replace (its code is kept below as it was), at Qwen3's vocabulary (151,936) with bf16 logits,
batch 1 / 64 / 256, temperature 0.7, for two logit distributions: flat, as a random-weights
Qwen3-0.6B gives them (std 0.02 x sqrt(hidden 1024) = 0.64), and peaked, N(0, 3^2). Cases:
temperature only (gumbel_sample), top_p 0.9, top_k 20 + top_p 0.95 (Qwen3's settings), top_k 50,
and temperature only forced through the top-k/top-p kernels (what an untruncated row costs in a
batch where other rows truncate). Prints microseconds per call (triton.testing.do_bench medians,
eager calls: launch overhead included) and checks every row of the new path against
ops/sampling_reference.py, which defines the kept set by tie groups (the old sampler cut ties by
sort position, so it is timed, not compared). Rows whose kept set depends on float32 rounding (a
token's mass within 1e-5 of top_p) are counted apart. Exit status 1 when a row disagrees. On a
machine without CUDA it says so and exits with 0.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ops  # noqa: E402
from engine.sampler import SamplingTensors, sample  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from ops.sampling_reference import gumbel_scores  # noqa: E402

VOCAB, BATCHES, TEMPERATURE = 151936, (1, 64, 256), 0.7
DISTRIBUTIONS = {"flat": 0.64, "peaked": 3.0}
CASES = {  # name: (top_k, top_p)
    "temperature": (-1, 1.0),
    "top_p=0.9": (-1, 0.9),
    "top_k=20,top_p=0.95": (20, 0.95),
    "top_k=50": (50, 1.0),
}


# --- the sort-based sampler of engine/sampler.py before this change --------------------------
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
                                      backend="torch").cpu()
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
    print(f"{'all rows agree' if not failures else f'{failures} cases DISAGREE'}; {time.time() - start:.0f} s")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)

"""Tests of sampling: engine/sampler.py and its ops (ops/sampling.py, ops/sampling_reference.py).

Oracles: float64 Gumbel scores; a float64 kept set computed here the slow, obvious way (the count
and mass of the logits strictly above each token's, O(V^2)); and the empirical distribution of many
draws. On CPU the Triton kernels run under the interpreter on float32 logits (bf16's ties come from
float32 values rounded to bf16; the interpreter rounds bf16 itself wrongly); on CUDA bf16 runs too.
Inputs are fresh random draws (the seed is in each failure message), as views of wider buffers
whose extra columns hold +inf (a stray read would win); Triton's buffers are allocated poisoned.
Rows whose kept set depends on float32 rounding (a token's mass within 1e-5 of top_p) are left out
of the exact comparisons; the tests check that they are few.
"""
import math
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_fused import DEVICE, ON_GPU, _PoisonedTorch, gen  # noqa: E402,F401  (gen: a fixture)

import ops  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sampler import SamplingTensors, TokenHistory, sample  # noqa: E402
from engine.sequence import PLACEHOLDER, SamplingParams, Sequence  # noqa: E402
from ops import sampling_reference as reference  # noqa: E402
from ops.sampling import NOISE_ERR, _approx_noise, _row_key, _uniform, _uniform_from_bits  # noqa: E402

BACKENDS = ["triton", "torch"]
INF = float("inf")
# tiny buffers: candidates overflow their splits, and the one-lane chains rarely settle a
# rejected draw, so the count and noise passes of _finish_kernel run often
TIGHT = dict(stats=dict(num_splits=2, block=16, cap=4, num_warps=1),
             chain=dict(num_splits=1, block=16, num_warps=1),
             finish=dict(block=64, num_warps=1, max_rounds=32))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from ops import sampling

    monkeypatch.setattr(sampling, "torch", _PoisonedTorch())


def tensors(params, steps, vocab):
    return SamplingTensors.build(params, steps, vocab, "cpu")


def logits_view(gen, B, V, scale=3.0, pad=0, bf16_values=False):
    """N(0, scale^2) logits [B, V] (float32, or bf16 on CUDA when bf16_values; on CPU bf16_values
    rounds float32 to bf16 values), as a view of a buffer with `pad` extra columns of +inf."""
    buf = torch.full((B, V + pad), INF)
    values = torch.randn(B, V, generator=gen) * scale
    buf[:, :V] = values.bfloat16().float() if bf16_values else values
    dtype = torch.bfloat16 if bf16_values and ON_GPU else torch.float32
    return buf.to(dtype).to(DEVICE)[:, :V]


def row_settings(gen, B, V):
    """Per row (temperature, top_k, top_p), cycling through greedy, plain temperature, top-k only,
    top-p only, both, k = 1, a tiny p, and p with k = V - 1."""
    temperature = (torch.rand(B, generator=gen) * 1.7 + 0.3)
    k = torch.randint(1, 60, (B,), generator=gen)
    p = torch.rand(B, generator=gen) * 0.94 + 0.05
    kind = torch.arange(B) % 8
    temperature = torch.where(kind == 0, 0.0, temperature)
    top_k = torch.where((kind == 2) | (kind == 4), k, torch.where(kind == 5, 1, V))
    top_k = torch.where(kind == 7, V - 1, top_k)
    top_p = torch.where((kind == 3) | (kind == 4) | (kind == 7), p, torch.where(kind == 6, 1e-4, 1.0))
    seed = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64)
    step = torch.randint(0, 2**20, (B,), generator=gen, dtype=torch.int64)
    return [t.to(DEVICE) for t in (temperature, top_k, top_p.float(), seed, step)]


# Rows too near a top-p or min-p boundary to compare may be at most B // NEAR_SHARE: at the real
# vocabulary (GPU) 10 of 64 rows were near in some seeds, and flat bf16 logits at V = 600 gave 3 of
# 16 in one seed of 300; every other row is still compared.
NEAR_SHARE = 4


def oracle_kept(logits, temperature, top_k, top_p, min_p=None):
    """float64, O(V^2): K [B, V] from the count and mass of the logits strictly above each token's,
    and each token's probability over the top one's."""
    kept = []
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    for l, t, k, p, q in zip(logits.double().cpu(), temperature.tolist(), top_k.tolist(), top_p.tolist(),
                             min_p.tolist()):
        e = torch.exp((l - l.max()) / (t or 1.0))
        above = l[None, :] > l[:, None]  # [i, j]: l_j > l_i
        count, mass = above.sum(-1), (above * e).sum(-1)
        kept.append((count == 0) | ((count < k) & ((p >= 1) | (mass <= p * e.sum())) & (e >= q)))
    return torch.stack(kept)


def min_p_settings(gen, B):
    """Per row: min_p 0 (off) for one row in three, else in [0.005, 0.8] (log-uniform); row 1 (plain
    temperature over the whole vocabulary) at 0.8, so that min_p cuts some row whatever the draw."""
    min_p = torch.exp(torch.empty(B).uniform_(-5.3, -0.22, generator=gen))
    min_p[1] = 0.8
    return torch.where(torch.arange(B) % 3 == 0, 0.0, min_p).to(DEVICE)


def real_vocab_scale(V, scale):
    """At Qwen3's 151,936 tokens, flat logits give each token ~1e-5 of the mass, so every top-p row is
    within rounding of its boundary and near_boundary would leave none to compare: use peaked logits."""
    return max(scale, 3.0) if V > 100_000 else scale


def near_min_p(logits, temperature, min_p):
    """Rows [B] where some token's probability over the top one's is within 1e-5 (relative) of min_p."""
    l = logits.double()
    e = torch.exp((l - l.max(-1, keepdim=True).values) / torch.where(temperature > 0, temperature, 1).double()[:, None])
    return ((min_p > 0) & ((e - min_p.double()[:, None]).abs() < 1e-5 * min_p.double()[:, None]).any(-1)).cpu()


def near_boundary(logits, temperature, top_p):
    """Rows [B] where some prefix of the logits sorted in float64 has a mass within 1e-5 of top_p."""
    l = logits.double()
    e = torch.exp((l - l.max(-1, keepdim=True).values) / torch.where(temperature > 0, temperature, 1).double()[:, None])
    prefix = e.sort(-1, descending=True).values.cumsum(-1) / e.sum(-1, keepdim=True)
    return ((top_p < 1) & (temperature > 0) & ((prefix - top_p.double()[:, None]).abs() < 1e-5).any(-1)).cpu()


# --- the sampler ---------------------------------------------------------------------------
def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    assert sample(logits, tensors(params, [0] * 5, 50)).tolist() == logits.argmax(-1).tolist()


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=s) for s in range(6)]
    together = sample(logits, tensors(params, list(range(6)), 100)).tolist()
    alone = [sample(logits[i:i + 1], tensors(params[i:i + 1], [i], 100)).item() for i in range(6)]
    reordered = sample(logits.flip(0), tensors(params[::-1], list(range(6))[::-1], 100)).tolist()[::-1]
    assert together == alone == reordered


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    n, temperature = 20000, 0.7
    draws = sample(logits.expand(n, 4), tensors([SamplingParams(temperature=temperature, seed=3)] * n, list(range(n)), 4))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, (logits / temperature).softmax(-1), atol=0.015)


# masses above each tie group at T = 0.8: 0, .497, .896, .968, .988, .9995 (no boundary within .003)
TIED = torch.tensor([2.0, 2.0, 1.5, 1.5, 1.5, 1.0, 0.0, -1.0, -1.0, -3.0])


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (10, 0.5), (6, 0.9), (2, 0.3)])
def test_draws_follow_the_tempered_distribution_over_the_kept_set(top_k, top_p):
    """Chi-square against softmax(logits / T) renormalised over K; a K cut by sort position (tokens
    of one tie group split, as (1, 1.0), (3, 1.0) and (10, 0.5) would be) leaves kept tokens unseen."""
    n, V, temperature = 20000, TIED.numel(), 0.8
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=11)] * n
    counts = torch.bincount(sample(TIED.expand(n, V), tensors(params, list(range(n)), V)), minlength=V)
    kept = oracle_kept(TIED[None], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]
    assert counts[~kept].sum() == 0, f"drawn outside K: {counts.tolist()}, K = {kept.tolist()}"
    expected = n * (TIED / temperature).softmax(-1)[kept] / (TIED / temperature).softmax(-1)[kept].sum()
    chi2, dof = ((counts[kept] - expected) ** 2 / expected).sum().item(), kept.sum().item() - 1
    assert chi2 < dof + 8 * math.sqrt(2 * dof) + 8, f"chi2 {chi2:.1f} with {dof} dof: {counts.tolist()}"


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([3.0, 2.5, 2.0, -5.0, -6.0])
    n = 4000
    top_k = sample(logits.expand(n, 5), tensors([SamplingParams(temperature=1.0, top_k=2, seed=1)] * n, list(range(n)), 5))
    assert set(top_k.tolist()) == {0, 1}
    # probabilities ~ [.50, .30, .18, ...]: top_p 0.6 keeps tokens 0 and 1 (mass before token 1 is .50 < .6)
    top_p = sample(logits.expand(n, 5), tensors([SamplingParams(temperature=1.0, top_p=0.6, seed=1)] * n, list(range(n)), 5))
    assert set(top_p.tolist()) == {0, 1}


def test_seeded_request_is_independent_of_the_batch(make_config):
    config = make_config("model.device=cpu")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=42, ignore_eos=True)
    alone = LLMEngine(config)
    target = alone.add_request("x", [5, 6, 7, 8], sampling)
    list(alone.run())
    crowded = LLMEngine(config)
    for i in range(5):
        crowded.add_request(f"o{i}", list(range(i + 1, i + 9)), SamplingParams(temperature=1.0, max_tokens=20, seed=i))
    same = crowded.add_request("x", [5, 6, 7, 8], sampling)
    list(crowded.run())
    assert same.output_token_ids == target.output_token_ids


# --- the kept set --------------------------------------------------------------------------
@pytest.mark.parametrize("bf16_values,scale", [(False, 3.0), (True, 0.5), (True, 3.0)])
def test_reference_kept_set_matches_float64(gen, bf16_values, scale):
    B, V = 16, 600
    logits = logits_view(gen, B, V, scale=scale, bf16_values=bf16_values)
    temperature, top_k, top_p, _, _ = row_settings(gen, B, V)
    near = near_boundary(logits, temperature, top_p)
    rows = (temperature > 0).cpu() & ~near
    assert near.sum() <= B // NEAR_SHARE, f"seed={gen.initial_seed()}"
    kept = reference.kept_mask(logits, temperature, top_k, top_p).cpu()
    assert torch.equal(kept[rows], oracle_kept(logits, temperature, top_k, top_p)[rows]), f"seed={gen.initial_seed()}"


def test_top_k_top_p_reference_is_the_best_kept_score(gen):
    B, V = 16, 600
    logits = logits_view(gen, B, V, bf16_values=True)
    temperature, top_k, top_p, seed, step = row_settings(gen, B, V)
    rows = ~near_boundary(logits, temperature, top_p)
    u = reference.uniform_noise(seed, step, torch.arange(V, device=DEVICE)[None, :])
    scores = logits.double() / temperature.double()[:, None] - torch.log(-torch.log(u.double()))
    scores = torch.where((temperature > 0)[:, None], scores, logits.double())
    best = scores.cpu().masked_fill(~oracle_kept(logits, temperature, top_k, top_p), -INF).argmax(-1)
    drawn = ops.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, backend="torch").cpu()
    assert torch.equal(drawn[rows], best[rows]), f"seed={gen.initial_seed()}"


@pytest.mark.parametrize("bf16_values,scale", [(False, 3.0), (True, 0.5)])
def test_reference_kept_set_with_min_p_matches_float64(gen, bf16_values, scale):
    B, V = 24, 600
    logits = logits_view(gen, B, V, scale=scale, bf16_values=bf16_values)
    temperature, top_k, top_p, _, _ = row_settings(gen, B, V)
    min_p = min_p_settings(gen, B)
    near = near_boundary(logits, temperature, top_p) | near_min_p(logits, temperature, min_p)
    rows = (temperature > 0).cpu() & ~near
    assert near.sum() <= B // NEAR_SHARE, f"seed={gen.initial_seed()}"
    kept = reference.kept_mask(logits, temperature, top_k, top_p, min_p).cpu()
    expected = oracle_kept(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(kept[rows], expected[rows]), f"seed={gen.initial_seed()}"
    cut = (min_p > 0).cpu() & rows
    assert (expected[cut].sum(-1) < oracle_kept(logits, temperature, top_k, top_p)[cut].sum(-1)).any(), \
        "min_p was meant to cut some rows"


# --- the Triton kernels against the reference ----------------------------------------------
KERNEL_CASES = [("default", False, 3.0), ("default", True, 0.5), ("tight", True, 1.0)]


@pytest.mark.parametrize("cfg,bf16_values,scale", KERNEL_CASES)
def test_top_k_top_p_kernel_matches_reference(gen, cfg, bf16_values, scale):
    from ops import sampling

    B, V = (64, 151936) if ON_GPU and cfg == "default" else (16, 700)
    logits = logits_view(gen, B, V, scale=real_vocab_scale(V, scale), pad=5, bf16_values=bf16_values)
    args = (logits, *row_settings(gen, B, V))
    near = near_boundary(logits, args[1], args[3])
    assert near.sum() <= B // NEAR_SHARE, f"seed={gen.initial_seed()}"
    drawn = sampling.top_k_top_p_sample(*args, cfg=TIGHT if cfg == "tight" else None).cpu()
    expected = ops.top_k_top_p_sample(*args, backend="torch").cpu()
    assert drawn.dtype == torch.int64
    assert torch.equal(drawn[~near], expected[~near]), f"seed={gen.initial_seed()}"


@pytest.mark.parametrize("cfg,scale", [("default", 1.0), ("tight", 0.5)])
def test_min_p_kernel_matches_reference(gen, cfg, scale):
    """min_p alone and with top-k / top-p (row_settings' kinds), its cut anywhere from the top few
    tokens to deep in the vocabulary (flat logits). Rows of one kind in three take a min_p just above
    the weight of the token they draw without it, so that their draw must change."""
    from ops import sampling

    B, V = (64, 151936) if ON_GPU and cfg == "default" else (24, 700)
    logits = logits_view(gen, B, V, scale=real_vocab_scale(V, scale), pad=5, bf16_values=True)
    temperature, top_k, top_p, seed, step = row_settings(gen, B, V)
    args = (logits, temperature, top_k, top_p, seed, step)
    without = ops.top_k_top_p_sample(*args, backend="torch")
    l = logits.float()
    e = torch.exp2((l - l.max(-1, keepdim=True).values) * (reference.LOG2E / temperature.clamp(min=1e-3))[:, None])
    crafted = e.gather(1, without[:, None])[:, 0] * 1.001
    rows = torch.arange(B, device=DEVICE)
    min_p = torch.where((rows % 3 == 1) & (crafted < 1), crafted, min_p_settings(gen, B))
    near = near_boundary(logits, temperature, top_p) | near_min_p(logits, temperature, min_p)
    assert near.sum() <= B // NEAR_SHARE, f"seed={gen.initial_seed()}"
    drawn = sampling.top_k_top_p_sample(*args, min_p=min_p, cfg=TIGHT if cfg == "tight" else None).cpu()
    expected = ops.top_k_top_p_sample(*args, backend="torch", min_p=min_p).cpu()
    assert torch.equal(drawn[~near], expected[~near]), f"seed={gen.initial_seed()}"
    changed = (expected != without.cpu()) & ~near
    assert changed.any(), f"min_p was meant to change some draws; seed={gen.initial_seed()}"


def test_min_p_routes_to_the_truncating_sampler_and_keeps_greedy_rows():
    logits = torch.randn(4, 300)
    params = [SamplingParams(temperature=t, min_p=0.2, seed=i) for i, t in enumerate((0.0, 1.0, 0.0, 1.5))]
    t = tensors(params, [3] * 4, 300)
    assert t.any_truncation and not t.all_greedy
    drawn = sample(logits, t)
    assert drawn[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    probs = logits[[1, 3]].softmax(-1) ** torch.tensor([[1.0], [1 / 1.5]])  # p_i / p_max = e_i under T
    assert (probs.gather(1, drawn[[1, 3], None]) / probs.max(-1, keepdim=True).values >= 0.2).all()


@pytest.mark.parametrize("sweep", ["top_k", "top_p"])
def test_top_k_top_p_kernel_over_every_cut_of_one_row(gen, sweep):
    """One row (logits and noise) under top_k = 1..B, or top_p spread over (0, 1): kept sets of every
    size, among them those that end at the candidates' floor G or just below it."""
    from ops import sampling

    B, V = 48, 400
    logits = logits_view(gen, 1, V, scale=1.0, bf16_values=True).expand(B, V)
    temperature = torch.full((B,), 0.8, device=DEVICE)
    top_k = torch.arange(1, B + 1, device=DEVICE) if sweep == "top_k" else torch.full((B,), V, device=DEVICE)
    top_p = torch.linspace(0.02, 0.98, B, device=DEVICE) if sweep == "top_p" else torch.ones(B, device=DEVICE)
    seed = torch.randint(0, 2**32, (1,), generator=gen).to(DEVICE).expand(B)
    args = (logits, temperature, top_k, top_p, seed, torch.zeros_like(seed))
    near = near_boundary(logits, temperature, top_p)
    assert near.sum() <= B // NEAR_SHARE, f"seed={gen.initial_seed()}"
    drawn, expected = sampling.top_k_top_p_sample(*args).cpu(), ops.top_k_top_p_sample(*args, backend="torch").cpu()
    assert torch.equal(drawn[~near], expected[~near]), f"seed={gen.initial_seed()}"


def test_top_k_top_p_kernel_draws_a_row_alike_alone_and_in_any_batch(gen):
    from ops import sampling

    B, V = 8, 500
    logits = logits_view(gen, B, V, scale=1.0, bf16_values=True)
    settings = row_settings(gen, B, V)
    together = sampling.top_k_top_p_sample(logits, *settings).tolist()
    alone = [sampling.top_k_top_p_sample(logits[i:i + 1], *(t[i:i + 1] for t in settings)).item() for i in range(B)]
    flipped = sampling.top_k_top_p_sample(logits.flip(0), *(t.flip(0) for t in settings)).flip(0).tolist()
    assert together == alone == flipped, f"seed={gen.initial_seed()}"


@pytest.mark.parametrize("block", [1, 8])
def test_noise_pass_chains_hold_their_invariants(gen, block):
    """Per (row, split) of the chained noise pass: c1 is the best score of the split, c2 (when
    known) the best above l_c1, and tb bounds every score above the last known logit (to within
    float32 rounding: the interpreter's log is numpy's). One lane of 32 tokens (the lanes' own chains), or 8
    lanes of 4 merged; ties of bf16 values occur."""
    from ops import sampling

    B, V, splits = 12, 128, 4
    _, temperature, seed, step = sampling_inputs(gen, B, V)
    logits = logits_view(gen, B, V, scale=0.2, bf16_values=True)  # flat: score order far from logit order
    chain_f = torch.empty((B, splits, 5), device=DEVICE)
    chain_i = torch.empty((B, splits, 2), dtype=torch.int32, device=DEVICE)
    chunk = -(-V // splits // block) * block
    sampling._gumbel_kernel[(B, splits)](
        logits, temperature, seed, step, torch.ones(B, dtype=torch.int32, device=DEVICE), seed, chain_f, chain_i,
        V, chunk, *logits.stride(), NUM_SPLITS=splits, BLOCK_V=block, CHAIN=True, CUDA_MATH=ON_GPU)
    scores = reference.gumbel_scores(logits, temperature, seed, step, torch.arange(V, device=DEVICE)[None, :])
    msg = f"seed={gen.initial_seed()}"
    for b in range(B):
        for s in range(splits):
            l, sc = logits[b, s * chunk:(s + 1) * chunk].cpu(), scores[b, s * chunk:(s + 1) * chunk].cpu()
            s1, l1, s2, l2, tb = chain_f[b, s].tolist()
            i1, i2 = (chain_i[b, s] - s * chunk).tolist()
            assert (i1, l1) == (sc.argmax().item(), l[i1].item()), msg
            last = l1
            if s2 > -INF:
                above = torch.where(l > l1, sc, -INF)
                assert l2 > l1 and (i2, l2) == (above.argmax().item(), l[i2].item()), msg
                last = l2
            above_last = torch.where(l > last, sc, -INF).max().item()
            assert tb >= above_last - 1e-5, msg


# --- gumbel_sample -------------------------------------------------------------------------
def sampling_inputs(gen, B, V, pad=0):
    temperature = (torch.rand(B, generator=gen) * 1.7 + 0.3).to(DEVICE)
    seed = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64).to(DEVICE)
    step = torch.randint(0, 2**20, (B,), generator=gen, dtype=torch.int64).to(DEVICE)
    return logits_view(gen, B, V, pad=pad), temperature, seed, step


@triton.jit
def _noise_kernel(seed_ptr, step_ptr, ids_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    """out[b, v] = the sampling kernels' noise (_uniform with _row_key) for token ids[b, v]; [B, V] contiguous."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    v = tl.load(ids_ptr + b * V + offs, mask=mask, other=0)
    tl.store(out_ptr + b * V + offs, _uniform(_row_key(seed_ptr, step_ptr, b), v.to(tl.int32)), mask=mask)


def kernel_noise(seed, step, token_ids):
    """The noise [B, V] that the sampling kernels draw for token_ids [B, V] (NaN where unwritten)."""
    B, V = token_ids.shape
    out = torch.full((B, V), float("nan"), device=token_ids.device)
    block = min(1024, triton.next_power_of_2(V))
    _noise_kernel[(B, triton.cdiv(V, block))](seed, step, token_ids.to(torch.int32).contiguous(), out, V,
                                              BLOCK_V=block)
    return out


def test_uniform_noise_is_bit_exact(gen):
    B, V = 9, 1500
    seed = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64).to(DEVICE)
    step = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64).to(DEVICE)
    ids = torch.randint(0, 2**31 - 1, (B, V), generator=gen, dtype=torch.int64)
    ids[0, :3] = torch.tensor([0, 1, 2**31 - 1])
    ids = ids.to(DEVICE)
    expected = reference.uniform_noise(seed, step, ids)
    assert torch.equal(kernel_noise(seed, step, ids), expected), f"seed={gen.initial_seed()}"


def test_every_uniform_lies_strictly_inside_the_unit_interval():
    """Every bin's midpoint is exact, so no draw is 0 or 1 (a draw of 1 scores +inf: that token wins
    whatever its logit) and the bins stay equally spaced."""
    u = reference.uniform_from_bits(torch.arange(2**reference.NOISE_BITS)).double()
    assert u.dtype == torch.float64 and 0 < u[0] and u[-1] < 1
    assert torch.equal(torch.diff(u), torch.full_like(u[1:], 2.0**-reference.NOISE_BITS))
    assert torch.isfinite((-u.log()).log()).all()


@triton.jit
def _bits_noise_kernel(out_u_ptr, out_g_ptr, N, BLOCK: tl.constexpr, CUDA_MATH: tl.constexpr):
    """For bits = 0 .. N-1: the kernels' uniform and their fast Gumbel noise."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform_from_bits(offs.to(tl.uint32))
    tl.store(out_u_ptr + offs, u, mask=offs < N)
    tl.store(out_g_ptr + offs, _approx_noise(u, CUDA_MATH), mask=offs < N)


def test_fast_noise_is_within_its_bound_for_every_uniform():
    """gumbel_sample settles a draw with the fast noise when its error bound, NOISE_ERR, separates the
    winner: checked here against float64 over all 2^23 draws (on the GPU, with its fast logs)."""
    n = 2**reference.NOISE_BITS
    u, g = torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE)
    block = 2**16
    _bits_noise_kernel[(n // block,)](u, g, n, BLOCK=block, CUDA_MATH=ON_GPU)
    expected_u = reference.uniform_from_bits(torch.arange(n, device=DEVICE))
    assert torch.equal(u, expected_u)
    err = (g.double() - (-(-expected_u.double().log()).log())).abs().max().item()
    assert err <= NOISE_ERR, err


@pytest.mark.parametrize("gap", [3e-5, 3e-4, 0.9 * NOISE_ERR, 3 * NOISE_ERR])
def test_gumbel_sample_resolves_near_ties_exactly(gen, gap):
    """Rows whose runner-up's score lies `gap` below the winner's: inside the fast noise's error bound
    the kernel rescans exactly; either way the draw is the reference's. (The gaps stay above float32
    rounding: on the CPU the interpreter's log and torch's may differ in the last place.)"""
    B, V = 8, 4000
    logits, temperature, seed, step = sampling_inputs(gen, B, V)
    scores = reference._scores(logits, temperature, seed, step)[1]
    top2 = scores.topk(2, dim=-1)
    rows = torch.arange(B, device=DEVICE)
    # lift the runner-up to the winner's score less the gap (scaled back to a logit)
    lift = (top2.values[:, 0] - top2.values[:, 1] - gap) * temperature
    logits[rows, top2.indices[:, 1]] += lift
    expected = reference.gumbel_sample(logits, temperature, seed, step)
    lifted = reference._scores(logits, temperature, seed, step)[1].topk(2, dim=-1).values
    assert ((lifted[:, 0] - lifted[:, 1] - gap).abs() < 1e-5).all()
    drawn = ops.gumbel_sample(logits, temperature, seed, step, backend="triton")
    assert drawn.tolist() == expected.tolist(), f"seed={gen.initial_seed()}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gumbel_sample_of_zero_logits_is_the_noise_argmax(gen, backend):
    B, V = 6, 5003
    _, _, seed, step = sampling_inputs(gen, B, V)
    logits = torch.zeros(B, V, device=DEVICE)
    u = reference.uniform_noise(seed, step, torch.arange(V, device=DEVICE)[None, :])
    # -log(-log u) is increasing in u, and distinct 23-bit u near the top give distinct scores
    drawn = ops.gumbel_sample(logits, torch.ones(B, device=DEVICE), seed, step, backend=backend)
    assert drawn.dtype == torch.int64
    assert drawn.tolist() == u.argmax(-1).tolist(), f"seed={gen.initial_seed()}"


def oracle_gumbel_scores(logits, temperature, seed, step):
    u = reference.uniform_noise(seed, step, torch.arange(logits.shape[1], device=logits.device)[None, :])
    return logits.double() / temperature.double()[:, None] - torch.log(-torch.log(u.double()))


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("B,V", [(1, 3001), (5, 7000), (11, 600)])
def test_gumbel_sample_matches_float64(gen, num_splits, B, V):
    from ops import sampling

    logits, temperature, seed, step = sampling_inputs(gen, B, V, pad=17)
    # make ties impossible: lift each row's float64 winner 0.05 above the runner-up at least
    winner = oracle_gumbel_scores(logits, temperature, seed, step).argmax(-1)
    rows = torch.arange(B, device=DEVICE)
    logits[rows, winner] += 0.05 * temperature
    scores = oracle_gumbel_scores(logits, temperature, seed, step)
    top2 = scores.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1] >= 0.049).all() and torch.equal(scores.argmax(-1), winner)
    msg = f"seed={gen.initial_seed()}"
    assert sampling.gumbel_sample(logits, temperature, seed, step, num_splits).tolist() == winner.tolist(), msg
    assert ops.gumbel_sample(logits, temperature, seed, step, backend="torch").tolist() == winner.tolist(), msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_gumbel_sample_at_temperature_zero_is_the_argmax(gen, backend):
    B, V = 6, 3001
    logits, temperature, seed, step = sampling_inputs(gen, B, V)
    noisy = ops.gumbel_sample(logits, temperature, seed, step, backend=backend)
    greedy = torch.arange(B, device=DEVICE) % 2 == 0
    drawn = ops.gumbel_sample(logits, temperature.masked_fill(greedy, 0.0), seed, step, backend=backend)
    assert drawn.tolist() == torch.where(greedy, logits.argmax(-1), noisy).tolist(), f"seed={gen.initial_seed()}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gumbel_sample_reads_bfloat16_logits_as_their_float32_values(gen, backend):
    B, V = 5, 2500
    logits, temperature, seed, step = sampling_inputs(gen, B, V)
    low = logits.to(torch.bfloat16)
    drawn = ops.gumbel_sample(low, temperature, seed, step, backend=backend)
    assert drawn.tolist() == ops.gumbel_sample(low.float(), temperature, seed, step, backend=backend).tolist()


def test_samplers_give_zero_for_all_minus_inf_rows():
    """As torch.argmax: every score ties at -inf, the first index wins (in every vocabulary range)."""
    from ops import sampling

    B, V = 3, 2500
    logits = torch.full((B, V), -INF, device=DEVICE)
    temperature, top_k = torch.ones(B, device=DEVICE), torch.full((B,), 5, device=DEVICE)
    top_p, zeros = torch.full((B,), 0.5, device=DEVICE), torch.zeros(B, dtype=torch.int64, device=DEVICE)
    for num_splits in (1, 3):
        assert sampling.gumbel_sample(logits, temperature, zeros, zeros, num_splits).tolist() == [0] * B
    for backend in BACKENDS:
        drawn = ops.top_k_top_p_sample(logits, temperature, top_k, top_p, zeros, zeros, backend=backend)
        assert drawn.tolist() == [0] * B


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_no_host_synchronisation(gen):
    B, V = 8, 32000
    logits = logits_view(gen, B, V, bf16_values=True)
    temperature, top_k, top_p, seed, step = row_settings(gen, B, V)
    params = [SamplingParams(temperature=0.7, min_tokens=5, stop_token_ids=(5,), repetition_penalty=1.2,
                             frequency_penalty=0.5, min_p=0.1, seed=i) for i in range(B)]
    seqs = [Sequence(i, str(i), list(range(i, i + 20)), params[i], 100, [7, 8, PLACEHOLDER]) for i in range(B)]
    previous = SimpleNamespace(rows={i: i for i in range(B)}, device_tokens=torch.arange(B, device=DEVICE))
    history = TokenHistory(128, DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.gumbel_sample(logits, temperature, seed, step)
        ops.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step)
        t = SamplingTensors.build(params, [3] * B, V, DEVICE, (2,), history.rows(seqs, previous))
        tokens = sample(logits, t)
        history.record(t.penalties, tokens)
        ops.logprobs(logits, tokens, 5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _compiled_sampling_variants() -> int:
    """Kernel variants Triton holds for the sampling and logprob kernels, on every device."""
    from ops import logprob_kernels, sampling
    kernels = [k for m in (sampling, logprob_kernels) for k in vars(m).values() if isinstance(k, triton.JITFunction)]
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@pytest.mark.skipif(not ON_GPU, reason="the interpreter compiles nothing; only the GPU has variants to count")
def test_no_sampling_kernel_compiles_inside_a_run(make_config, qwen3_checkpoint):
    """The engine's warm-up compiles every sampling path a request can take: truncation, penalties
    (float32 logits), both together, logprobs; a run's first step must not stall on a compilation."""
    path, _ = qwen3_checkpoint
    engine = LLMEngine(make_config(f"model.path={path}", "model.max_model_len=128", "model.device=cuda",
                                   "cache.num_blocks=64", "scheduler.max_num_seqs=4"))
    before = _compiled_sampling_variants()
    assert before > 0
    kinds = [dict(top_p=0.95, top_k=20), dict(min_p=0.1), dict(repetition_penalty=1.2),
             dict(top_k=5, presence_penalty=0.5, logprobs=3)]
    for i, kind in enumerate(kinds):  # one kind per run: a batch of mixed kinds takes the widest path only
        engine.add_request(str(i), [1, 2, 3, 4], SamplingParams(temperature=0.7, max_tokens=4, **kind))
        assert len(list(engine.run())) == 1
    assert _compiled_sampling_variants() == before

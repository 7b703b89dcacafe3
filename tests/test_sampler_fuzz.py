"""A fuzz of the sampling kernels (ops/sampling.py) against their references (ops/sampling_reference.py).

Rows are drawn from families meant to break the kernels' shortcuts: flat logits (the kept set is most of
the vocabulary, so the count and noise passes run), peaked ones, two levels of logits, tie groups whose
cumulative mass is exactly top_p (ties at the boundary), many equal maxima, and -inf and very large
magnitudes; each row takes its own temperature (1e-3 to 10), top_p, top_k and min_p, combined at random.

The oracle is the reference, sorting in float32: every row must finish (the kernels' rounds are bounded,
with an exact fallback), its token must be one the reference's kept set allows, with top_p and min_p
loosened by 1e-4 relative for the float32 sums' other order, and, for the same noise (seed, step), the
very token the reference draws, except on rows whose kept set changes within that loosening (counted:
most rows must be compared exactly). On the CPU the kernels run in Triton's interpreter on small
vocabularies; on the GPU at Qwen3's vocabulary over 10^5 rows, in bf16 and float32.
"""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_fused import DEVICE, ON_GPU, gen  # noqa: E402,F401  (gen: a fixture)
from test_sampler import TIGHT  # noqa: E402

from ops import sampling  # noqa: E402
from ops import sampling_reference as reference  # noqa: E402

FAMILIES = ("flat", "peaked", "two_level", "tied_boundary", "equal_max", "extreme")
TOP_P = (1e-6, 0.5, 0.95, 1 - 1e-7, 1.0)
MIN_P = (0.0, 0.0, 0.01, 0.3)
SLACK = 1e-4


def family_logits(gen, family: str, B: int, V: int) -> torch.Tensor:
    """float32 logits [B, V] of one family (module docstring), on gen's device."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=gen.device)

    if family == "flat":
        return randn(B, V) * 0.05
    if family == "peaked":
        return randn(B, V) * 8
    if family in ("two_level", "tied_boundary"):
        gap = rand(B, 1) * 4 + 0.5
        if family == "tied_boundary":  # four tie groups: 0, -gap, -2 gap, -3 gap
            return -gap * torch.randint(0, 4, (B, V), generator=gen, device=gen.device).float()
        return torch.where(rand(B, V) < rand(B, 1) * 0.05, 0.0, -gap)
    if family == "equal_max":
        return torch.where(rand(B, V) < rand(B, 1) * 0.5, 2.0, randn(B, V) - 5)
    logits = randn(B, V) * 3  # extreme: -inf holes, huge magnitudes, a lone finite logit
    logits[rand(B, V) < 0.3] = -math.inf
    huge = torch.randint(0, V, (B, 2), generator=gen, device=gen.device)
    logits.scatter_(1, huge, torch.tensor([[3e38, -3e38]], device=gen.device).expand(B, 2).contiguous())
    lone = torch.arange(B) % 4 == 3
    logits[lone] = -math.inf
    logits[lone, 0] = 1.0
    return logits


def row_settings(gen, logits: torch.Tensor, family: str):
    """(temperature, top_k, top_p, min_p, seed, step) per row, combined at random; tied_boundary rows take
    a top_p equal to the mass of their top tie groups (computed in float64, so within rounding of it)."""
    B, V = logits.shape
    temperature = torch.exp(torch.empty(B).uniform_(math.log(1e-3), math.log(10.0), generator=gen))
    top_k = torch.tensor([1, 2, 20, V])[torch.randint(0, 4, (B,), generator=gen)]
    top_p = torch.tensor(TOP_P)[torch.randint(0, len(TOP_P), (B,), generator=gen)]
    min_p = torch.tensor(MIN_P)[torch.randint(0, len(MIN_P), (B,), generator=gen)]
    if family == "tied_boundary":
        weights = torch.exp((logits.double() - logits.double().max(-1, keepdim=True).values)
                            / temperature.double().to(logits.device)[:, None])
        levels = torch.randint(1, 3, (B, 1), generator=gen).to(logits.device)  # the top one or two tie groups
        cut = logits.max(-1, keepdim=True).values - levels * (logits.max(-1, keepdim=True).values
                                                              - logits.min(-1, keepdim=True).values) / 3 + 1e-3
        top_p = torch.where(logits > cut, weights, 0.0).sum(-1) / weights.sum(-1)
        top_p = top_p.clamp(1e-6, 1.0).float().cpu()
    seed = torch.randint(0, 2**32, (B,), generator=gen, dtype=torch.int64)
    step = torch.randint(0, 2**20, (B,), generator=gen, dtype=torch.int64)
    return temperature, top_k, top_p.float(), min_p.float(), seed, step


def check_rows(logits, settings, drawn, what: str) -> int:
    """Assert the module docstring's three checks on one batch; returns the rows compared exactly."""
    temperature, top_k, top_p, min_p, seed, step = settings
    logits = logits.float()
    assert drawn.dtype == torch.int64 and ((drawn >= 0) & (drawn < logits.shape[1])).all(), what
    expected = reference.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p)
    loose = reference.kept_mask(logits, temperature, top_k, (top_p * (1 + SLACK)).clamp(max=1.0), min_p * (1 - SLACK))
    tight = reference.kept_mask(logits, temperature, top_k, top_p * (1 - SLACK), (min_p * (1 + SLACK)).clamp(max=1.0))
    rows = torch.arange(logits.shape[0], device=logits.device)
    finite = (logits > -math.inf).any(-1)
    allowed = loose[rows, drawn] | ~finite  # a row of -inf logits draws token 0, as argmax does
    assert allowed.all(), f"{what}: rows {rows[~allowed].tolist()} drew tokens the kept set does not hold"
    settled = (loose == tight).all(-1)
    same = drawn == expected
    assert (same | ~settled).all(), f"{what}: rows {rows[~same & settled].tolist()} drew {drawn[~same & settled].tolist()}, " \
                                    f"the reference {expected[~same & settled].tolist()}"
    return int(settled.sum())


def fuzz(gen, B: int, V: int, dtype: torch.dtype, cfg=None, logits_gen=None) -> tuple[int, int, int]:
    """One batch of every family through both samplers: top_k_top_p_sample, and gumbel_sample on the same
    logits and noise (which must draw the reference's token on every row: its near ties are settled
    exactly). logits_gen: the generator of the logits (default gen: the CPU's). Returns (rows, rows
    compared exactly, rows drawn through the exact fallback)."""
    rows = exact = 0
    fallbacks = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for family in FAMILIES:
        logits = family_logits(logits_gen or gen, family, B, V).to(dtype).to(DEVICE)
        temperature, top_k, top_p, min_p, seed, step = (t.to(DEVICE) for t in row_settings(gen, logits.float(), family))
        drawn = sampling.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p=min_p, cfg=cfg,
                                            fallbacks=fallbacks)
        what = f"{family} {dtype} seed={gen.initial_seed()}"
        exact += check_rows(logits, (temperature, top_k, top_p, min_p, seed, step), drawn, what)
        plain = sampling.gumbel_sample(logits, temperature, seed, step)
        assert torch.equal(plain, reference.gumbel_sample(logits.float(), temperature, seed, step)), what
        rows += B
    return rows, exact, int(fallbacks.item())


@pytest.mark.parametrize("cfg", ["default", "tight"])
def test_fuzz_the_samplers_in_the_interpreter(gen, cfg):
    """bf16 values (as float32: the interpreter rounds bf16 itself wrongly) and float32 values."""
    if ON_GPU:
        pytest.skip("the GPU fuzz below runs at the real vocabulary")
    rows = exact = 0
    for dtype in (torch.bfloat16, torch.float32):
        r, e, _ = fuzz(gen, 8, 300, dtype, TIGHT if cfg == "tight" else None)
        rows, exact = rows + r, exact + e
    assert exact >= rows // 2, f"only {exact} of {rows} rows compared exactly"


@pytest.mark.skipif(not ON_GPU, reason="the real vocabulary needs the GPU")
def test_fuzz_the_samplers_at_the_real_vocabulary(gen):
    """10^5 rows at V = 151,936, bf16 and float32 logits."""
    rows = exact = fallbacks = 0
    on_device = torch.Generator(device=DEVICE).manual_seed(gen.initial_seed())
    while rows < 100_000:
        for dtype in (torch.bfloat16, torch.float32):
            r, e, f = fuzz(gen, 512, 151_936, dtype, logits_gen=on_device)
            rows, exact, fallbacks = rows + r, exact + e, fallbacks + f
    print(f"{rows} rows, {exact} compared exactly, {fallbacks} through the fallback")
    assert exact >= rows // 2, f"only {exact} of {rows} rows compared exactly"


def rounds_needed(logits, temperature, top_k, top_p, min_p, seed, step) -> torch.Tensor:
    """Per row, the candidates the rounds test before one is kept (the reference's kept set and scores): the
    best score overall, then the best above its logit, and so on."""
    kept = reference.kept_mask(logits, temperature, top_k, top_p, min_p)
    scores = reference.gumbel_scores(logits.float(), temperature, seed, step,
                                     torch.arange(logits.shape[1], device=logits.device)[None, :])
    needed = []
    for row_kept, row_scores, row_logits in zip(kept, scores, logits.float()):
        w, rounds = int(row_scores.argmax()), 1
        while not row_kept[w]:
            w, rounds = int(torch.where(row_logits > row_logits[w], row_scores, -math.inf).argmax()), rounds + 1
        needed.append(rounds)
    return torch.tensor(needed)


@pytest.mark.parametrize("max_rounds", [1, 2])
def test_the_round_limit_takes_the_exact_fallback(gen, max_rounds):
    """With the rounds cut short, rows go through the bisection of K's floor and the noise pass above it:
    the reference's tokens, and exactly the rows that needed more rounds counted. Flat logits and top_p 0.5
    keep half of each row, more than the tight layout's candidates hold, so each round tests one candidate."""
    B, V = 48, 300  # some rows need 3 rounds or more: ~15% of them
    cfg = {**TIGHT, "finish": {**TIGHT["finish"], "max_rounds": max_rounds}}
    logits = family_logits(gen, "flat", B, V).to(DEVICE)
    _, top_k, _, _, seed, step = (t.to(DEVICE) for t in row_settings(gen, logits, "flat"))
    temperature = (torch.rand(B, generator=gen) * 1.5 + 0.5).to(DEVICE)  # flat enough for no candidate to hold K
    top_k, top_p, min_p = torch.full_like(top_k, V), torch.full((B,), 0.5, device=DEVICE), torch.zeros(B, device=DEVICE)
    fallbacks = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    settings = (temperature, top_k, top_p, min_p, seed, step)
    drawn = sampling.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p=min_p, cfg=cfg,
                                        fallbacks=fallbacks)
    exact = check_rows(logits, settings, drawn, f"seed={gen.initial_seed()}")
    # rows too near their boundary to compare: 0-5 in 300 seeds of these settings (a bound of 4 failed 2%)
    assert exact >= B - B // 4, f"seed={gen.initial_seed()}: only {exact} of {B} rows compared exactly"
    beyond = int((rounds_needed(logits, *settings) > max_rounds).sum())
    assert beyond - (B - exact) <= fallbacks.item() <= beyond + (B - exact)  # a row near its boundary: either way
    assert beyond > 0, f"seed={gen.initial_seed()}: no row needed more than {max_rounds} rounds"


def test_rows_with_nan_logits_finish(gen):
    """NaN logits are never kept by the kernels (comparisons with NaN are false): every row still ends,
    with a token of a finite logit."""
    B, V = 6, 300
    logits = torch.randn(B, V, generator=gen)
    logits[torch.rand(B, V, generator=gen) < 0.5] = math.nan
    logits = logits.to(DEVICE)
    temperature, top_k, top_p, min_p, seed, step = (t.to(DEVICE) for t in row_settings(gen, logits, "flat"))
    drawn = sampling.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p=min_p)
    assert (~logits.gather(1, drawn[:, None]).isnan()).all()


@pytest.mark.skipif(not ON_GPU, reason="the engine draws through the Triton kernels on CUDA only")
def test_the_engine_counts_its_fallbacks_and_draws_the_same_tokens(monkeypatch, caplog):
    """The tiny model's flat logits with top_p 0.5 and the rounds cut to one: rows whose first candidate is not
    kept take the fallback; the run's tokens are those of a run with the default limit, and the engine (and
    its log) counts the rows."""
    from engine.llm import LLM
    from engine.sequence import SamplingParams

    params = SamplingParams(temperature=1.5, top_p=0.5, max_tokens=24, seed=3, ignore_eos=True)
    prompts = [[i + 1, 2, 3] for i in range(8)]
    llm = LLM(model="tiny", device="cuda")
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert llm.engine.sampler_fallbacks == 0
    monkeypatch.setitem(sampling.TOP_K_TOP_P_CFG["gpu"], "finish", {**sampling.TOP_K_TOP_P_CFG["gpu"]["finish"],
                                                                     "max_rounds": 1})
    with caplog.at_level("WARNING", logger="minipaged"):
        drawn = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert drawn == expected
    assert llm.engine.sampler_fallbacks > 0
    assert f"{llm.engine.sampler_fallbacks} draws so far took the truncating sampler's exact fallback" in caplog.text

"""Tests of the fused elementwise ops (ops/fused.py, ops/fused_reference.py), both backends.

Each op is checked against an independent float64 oracle (tolerances on ||out - ref|| / ||ref||:
float32 1e-5, float16 3e-3, bfloat16 2e-2) and against Hugging Face's unfused torch code (the
torch backend must reproduce it bit for bit). On CPU the Triton kernels run under the interpreter
(TRITON_INTERPRET=1, set by conftest.py and, as a fallback, below) in float32 and float16 (the
interpreter rounds to bfloat16 wrongly); on CUDA bfloat16 runs too.
Inputs are fresh random draws on every run (the seed is in each failure message). Inputs are
views of wider buffers whose extra columns hold NaN, so an out-of-bounds read shows; the Triton
outputs are allocated filled with NaN, so an unwritten element shows.
"""
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ops  # noqa: E402
from engine.models.rope import Rope, RotaryEmbedding  # noqa: E402
from test_ops import bits  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BACKENDS = ["triton", "torch"]
EPS = 1e-6
NAN = float("nan")


@pytest.fixture
def gen():
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


class _PoisonedTorch:
    """torch, except that empty / empty_like return NaN-filled (integers: -1) tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t):
        return t.fill_(NAN if t.is_floating_point() else -1)

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    from ops import fused

    monkeypatch.setattr(fused, "torch", _PoisonedTorch())


def randn(gen, *shape, dtype=torch.float32, scale=1.0, pad=0):
    """Random [.., last] as a view of a buffer with `pad` extra columns holding NaN."""
    *lead, last = shape
    buf = torch.full((*lead, last + pad), NAN, dtype=torch.float32)
    buf[..., :last] = torch.randn(*shape, generator=gen) * scale
    return buf.to(dtype).to(DEVICE)[..., :last]


def check(out, ref, dtype, gen, what):
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output (seed={gen.initial_seed()})"
    out, ref = out.double().cpu(), ref.double().cpu()
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"{what}: rel err {err:.3e} >= {TOL[dtype]} (seed={gen.initial_seed()})"


def check_unfused(out, unfused, backend, dtype, gen, what):
    """The torch backend reproduces the unfused code bit for bit; Triton to within the tolerance."""
    if backend == "torch":
        assert torch.equal(out, unfused)
    else:
        check(out, unfused, dtype, gen, f"{what} vs unfused")


# --- float64 oracles and Hugging Face's unfused code (RMSNorm's steps, apply_rotary_pos_emb) ---
def oracle_rms_norm(x, w, eps):
    x, w = x.double(), w.double()
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def oracle_rope(x, cos, sin, positions):
    half = x.shape[-1] // 2
    c, s = cos.double()[positions.long(), None, :], sin.double()[positions.long(), None, :]
    return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s


def unfused_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# --- norms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 96), (7, 1024), (33, 96)])
def test_rms_norm(gen, backend, dtype, T, H):
    x = randn(gen, T, H, dtype=dtype, scale=3.0, pad=5)
    w = randn(gen, H, dtype=dtype)
    out = ops.rms_norm(x, w, EPS, backend=backend)
    check(out, oracle_rms_norm(x, w, EPS), dtype, gen, "rms_norm vs float64")
    unfused = unfused_rms_norm(x, w, EPS)
    check_unfused(out, unfused, backend, dtype, gen, "rms_norm")


# --- rope_and_write_kv_cache ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 4, 2, 64), (7, 8, 1, 128), (5, 4, 2, 24), (3, 40, 8, 128), (4, 14, 2, 64)])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm_rope", "rope"])
def test_rope_and_write_kv_cache(gen, backend, dtype, T, Hq, Hkv, D, qk_norm):
    """The rotated q is returned; the rotated k and v land in the cache at each token's slot (a NaN-filled
    cache: every other slot stays NaN; with more than one token, token 1's slot is -1 and writes nothing)."""
    max_pos, block_size = 4096, 4
    rotary = RotaryEmbedding(D, Rope(1e6), max_pos).to(DEVICE)
    # q, k and v as the attention layer gets them: views of the fused qkv projection
    qkv = randn(gen, T, (Hq + 2 * Hkv) * D, dtype=dtype, scale=2.0, pad=3)
    q = qkv[:, : Hq * D].reshape(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].reshape(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    q_w, k_w = randn(gen, D, dtype=dtype), randn(gen, D, dtype=dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    num_blocks = T + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(torch.int32)
    writes = torch.arange(T) != 1
    slots[~writes] = -1
    key_cache, value_cache = (torch.full((num_blocks, Hkv, block_size, D), NAN, dtype=dtype, device=DEVICE)
                              for _ in range(2))
    norm = (q_w, k_w, EPS) if qk_norm else None
    q_out = ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, key_cache, value_cache,
                                        slots.to(DEVICE), backend=backend, qk_norm=norm)
    assert q_out.shape == q.shape
    written, at = slots[writes].long().to(DEVICE), writes.to(DEVICE)
    k_out, v_out = (c.permute(0, 2, 1, 3).reshape(-1, Hkv, D)[written] for c in (key_cache, value_cache))
    for out, x, w, pos, what in ((q_out, q, q_w, positions, "q"), (k_out, k[at], k_w, positions[at], "k")):
        ref = oracle_rope(oracle_rms_norm(x, w, EPS) if qk_norm else x.double(), rotary.cos, rotary.sin, pos)
        check(out, ref, dtype, gen, f"{what} vs float64")
    assert torch.equal(v_out, v[at]), f"v (seed={gen.initial_seed()})"
    unwritten = num_blocks * block_size - int(writes.sum())
    for cache in (key_cache, value_cache):
        unchanged = int(cache.isnan().all(-1).sum())
        assert unchanged == unwritten * Hkv, f"writes outside the slots (seed={gen.initial_seed()})"
    # transformers' apply_rotary_pos_emb, with its tables in the model dtype
    cos, sin = rotary.cos[positions].to(dtype), rotary.sin[positions].to(dtype)
    if qk_norm:
        q, k = unfused_rms_norm(q, q_w, EPS), unfused_rms_norm(k, k_w, EPS)
    q_unfused, k_unfused = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    check_unfused(q_out, q_unfused, backend, dtype, gen, "q")
    check_unfused(k_out, k_unfused[at], backend, dtype, gen, "k")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rope_writes_an_fp8_cache(gen, backend, cache_dtype):
    """An FP8 cache (cache.kv_cache_dtype) stores k and v unscaled, clamped to its finite range: v exactly
    as to_cache rounds it, k within half an FP8 step (relative) of the float64 oracle, clamped; the torch
    backend's k is to_cache of transformers' rotated k. Values up to ~1,000 (past e4m3's 448)."""
    from ops.paged_attention_reference import to_cache

    if backend == "triton" and not ON_GPU:
        pytest.skip("Triton 3.9's interpreter rounds float32 to fp8 wrongly where the rounding carries into the "
                    "exponent (7.9 -> 4, 126.6 -> 64; torch and the GPU give 8, 128): the GPU runs this case")
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    T, Hq, Hkv, D, max_pos, block_size = 6, 4, 2, 64, 4096, 4
    rotary = RotaryEmbedding(D, Rope(1e6), max_pos).to(DEVICE)
    q, k, v = (randn(gen, T, h, D, dtype=dtype, scale=300.0) for h in (Hq, Hkv, Hkv))
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    slots = torch.randperm((T + 2) * block_size, generator=gen)[:T].to(torch.int32).to(DEVICE)
    key_cache, value_cache = (torch.zeros((T + 2, Hkv, block_size, D), dtype=cache_dtype, device=DEVICE)
                              for _ in range(2))
    ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, key_cache, value_cache, slots,
                                backend=backend)
    k_out, v_out = (c.permute(0, 2, 1, 3).reshape(-1, Hkv, D)[slots.long()] for c in (key_cache, value_cache))
    most = torch.finfo(cache_dtype).max
    assert torch.equal(v_out.float(), to_cache(v, cache_dtype).float()), f"v (seed={gen.initial_seed()})"
    ref = oracle_rope(k.double(), rotary.cos, rotary.sin, positions).clamp(-most, most).cpu()
    mantissa_bits = torch.finfo(cache_dtype).bits - 1 - {torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}[cache_dtype]
    half_step = 2.0 ** -(mantissa_bits + 1)  # relative
    # the rotation's own rounding in the model's dtype: a few ulps of its two terms, each at most |k| of its pair
    pair = k.double().abs() + torch.cat([k[..., D // 2:], k[..., :D // 2]], dim=-1).double().abs()
    rotation = 4 * torch.finfo(dtype).eps * pair.cpu()
    err = (k_out.double().cpu() - ref).abs()
    assert torch.isfinite(k_out.float()).all() and k_out.float().abs().max() <= most
    assert (err <= half_step * ref.abs() + (1 + half_step) * rotation + 2.0 ** -9).all(), \
        f"k off by up to {(err - half_step * ref.abs()).max():.3g} (seed={gen.initial_seed()})"
    if backend == "torch":
        cos, sin = rotary.cos[positions].to(dtype), rotary.sin[positions].to(dtype)
        assert torch.equal(k_out.float(), to_cache(apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)[1],
                                                   cache_dtype).float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_into_out(gen, backend):
    """out=: the rotated q goes into the given rows of a larger buffer (as the per-layer CUDA graphs keep
    one q buffer for every layer), the same values as a new tensor; the buffer's other rows stay NaN."""
    T, Hq, Hkv, D, block_size = 5, 4, 2, 64, 4
    rotary = RotaryEmbedding(D, Rope(1e6), 64).to(DEVICE)
    q, k, v = randn(gen, T, Hq, D), randn(gen, T, Hkv, D), randn(gen, T, Hkv, D)
    positions = torch.randint(0, 64, (T,), generator=gen).to(DEVICE)
    slots = torch.arange(T, dtype=torch.int32, device=DEVICE)
    caches = [torch.zeros(T, Hkv, block_size, D, device=DEVICE) for _ in range(2)]
    plain = ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, *caches, slots, backend=backend)
    buf = torch.full((T + 3, Hq, D), NAN, device=DEVICE)
    out = ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, *caches, slots, backend=backend,
                                      out=buf[1:T + 1])
    assert out.data_ptr() == buf[1].data_ptr() and torch.equal(out, plain)
    assert buf[0].isnan().all() and buf[T + 1:].isnan().all()
    with pytest.raises(ValueError, match="contiguous"):
        ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, *caches, slots, backend=backend,
                                    out=torch.empty(2 * T, Hq, D, device=DEVICE)[::2])


def folded_projection(gen, dtype, T, H, out_features, bias):
    """The projection of raw hidden rows by a weight that holds the RMSNorm's weight, as the engine computes
    it, -> (projection [T, out_features] in dtype, hidden, bias or None, the float64 oracle of the unfolded
    layers: the RMSNorm of hidden, then the projection with its bias)."""
    hidden = randn(gen, T, H, dtype=dtype, scale=3.0, pad=5)
    norm_weight = (torch.rand(H, generator=gen) + 0.5).to(DEVICE)
    weight = randn(gen, out_features, H, scale=H**-0.5)
    b = randn(gen, out_features, dtype=dtype) if bias else None
    projection = torch.nn.functional.linear(hidden, (weight * norm_weight).to(dtype))
    oracle = oracle_rms_norm(hidden, norm_weight, EPS) @ weight.double().T
    return projection, hidden, b, oracle if b is None else oracle + b.double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hq,Hkv,D", [(1, 96, 4, 2, 64), (7, 1024, 8, 1, 128), (5, 160, 4, 2, 24)])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm_rope", "rope"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_rope_after_a_folded_input_norm(gen, backend, dtype, T, H, Hq, Hkv, D, qk_norm, bias):
    """input_norm and bias: q, k and v are projections of raw hidden rows by weights holding the RMSNorm's
    weight; the op applies the norm's row scale and the bias before the QK-norm and RoPE, so that the
    rotated q, k and the cached v are the unfolded layers' (a float64 oracle of RMSNorm, projection, bias,
    QK-norm, RoPE)."""
    max_pos, block_size = 512, 4
    rotary = RotaryEmbedding(D, Rope(1e6), max_pos).to(DEVICE)
    qkv, hidden, b, oracle = folded_projection(gen, dtype, T, H, (Hq + 2 * Hkv) * D, bias)
    sizes = [Hq * D, Hkv * D, Hkv * D]
    (q, k, v), (q_ref, k_ref, v_ref) = (x.split(sizes, dim=-1) for x in (qkv, oracle))
    q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    q_w, k_w = randn(gen, D, dtype=dtype), randn(gen, D, dtype=dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    slots = torch.randperm(T * block_size, generator=gen)[:T].to(torch.int32).to(DEVICE)
    key_cache, value_cache = (torch.full((T, Hkv, block_size, D), NAN, dtype=dtype, device=DEVICE) for _ in range(2))
    q_out = ops.rope_and_write_kv_cache(
        q, k, v, rotary.cos, rotary.sin, positions, key_cache, value_cache, slots, backend=backend,
        qk_norm=(q_w, k_w, EPS) if qk_norm else None, input_norm=(hidden, EPS),
        bias=None if b is None else b.split(sizes))
    k_out, v_out = (c.permute(0, 2, 1, 3).reshape(-1, Hkv, D)[slots.long()] for c in (key_cache, value_cache))
    for out, ref, w, what in ((q_out, q_ref.reshape(T, Hq, D), q_w, "q"), (k_out, k_ref.reshape(T, Hkv, D), k_w, "k")):
        ref = oracle_rms_norm(ref, w, EPS) if qk_norm else ref
        check(out, oracle_rope(ref, rotary.cos, rotary.sin, positions), dtype, gen, f"{what} vs float64")
    check(v_out, v_ref.reshape(T, Hkv, D), dtype, gen, "v vs float64")


# --- silu_and_mul --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 70), (7, 1024), (3, 3000)])
def test_silu_and_mul(gen, backend, dtype, T, inter):
    x = randn(gen, T, 2 * inter, dtype=dtype, scale=3.0, pad=9)
    out = ops.silu_and_mul(x, backend=backend)
    gate, up = x.double()[:, :inter], x.double()[:, inter:]
    check(out, gate / (1 + torch.exp(-gate)) * up, dtype, gen, "silu_and_mul vs float64")
    unfused = torch.nn.functional.silu(x[:, :inter]) * x[:, inter:]
    check_unfused(out, unfused, backend, dtype, gen, "silu_and_mul")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,inter", [(1, 96, 70), (7, 1024, 1024), (3, 160, 3000)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_silu_and_mul_after_a_folded_input_norm(gen, backend, dtype, T, H, inter, bias):
    """input_norm and bias as in rope_and_write_kv_cache: silu(gate) * up of the unfolded layers (float64)."""
    x, hidden, b, oracle = folded_projection(gen, dtype, T, H, 2 * inter, bias)
    out = ops.silu_and_mul(x, backend=backend, input_norm=(hidden, EPS), bias=b)
    gate, up = oracle[:, :inter], oracle[:, inter:]
    check(out, gate / (1 + torch.exp(-gate)) * up, dtype, gen, "silu_and_mul vs float64")


# --- an FP8 product's scales, applied by the op that reads it --------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hq,Hkv,D,inter", [(1, 96, 4, 2, 64, 70), (6, 160, 8, 1, 128, 1024)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_deferred_fp8_scales_are_the_scaled_product_bit_for_bit(gen, backend, dtype, T, H, Hq, Hkv, D, inter, bias):
    """scales = (row_scale, columns): the ops take an FP8 GEMM's float32 product still to be scaled and give, bit for
    bit, what they give for that product scaled and rounded first (scale_product, whose float64 contract
    tests/test_fp8_weights.py checks, then the op, checked against float64 above): the rotated q, the cached k and
    v, silu(gate) * up, in the dtype of the input norm's hidden rows."""
    from ops.fp8_gemm_reference import scale_product

    hidden = randn(gen, T, H, dtype=dtype, scale=2.0)
    raw_qkv = randn(gen, T, (Hq + 2 * Hkv) * D, scale=300.0)  # float32, as cuBLASLt's unit-scale product
    row_scale = (torch.rand(T, 1, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    cols = (torch.rand((Hq + 2 * Hkv) * D, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    sizes = [Hq * D, Hkv * D, Hkv * D]
    b = randn(gen, sum(sizes), dtype=dtype).split(sizes) if bias else None
    rotary = RotaryEmbedding(D, Rope(1e6), 64).to(DEVICE)
    positions = torch.randint(0, 64, (T,), generator=gen).to(DEVICE)
    slots = torch.randperm(T * 4, generator=gen)[:T].to(torch.int32).to(DEVICE)
    norm = (randn(gen, D, dtype=dtype), randn(gen, D, dtype=dtype), EPS)

    def rope(qkv, scales):
        q, k, v = (x.reshape(T, -1, D) for x in qkv.split(sizes, dim=-1))
        caches = [torch.full((T, Hkv, 4, D), NAN, dtype=dtype, device=DEVICE) for _ in range(2)]
        q_out = ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, *caches, slots, backend=backend,
                                            qk_norm=norm, input_norm=(hidden, EPS), bias=b, scales=scales)
        return q_out, *caches

    deferred = rope(raw_qkv, (row_scale, cols.split(sizes)))
    scaled_first = rope(scale_product(raw_qkv, row_scale, cols, dtype=dtype), None)
    unscaled = rope(raw_qkv.to(dtype), None)
    assert deferred[0].dtype == dtype and not torch.equal(bits(deferred[0].cpu()), bits(unscaled[0].cpu()))
    for got, want, what in zip(deferred, scaled_first, ("q", "k cache", "v cache")):
        assert torch.equal(bits(got.cpu()), bits(want.cpu())), f"{what} (seed={gen.initial_seed()})"

    raw_gate_up = randn(gen, T, 2 * inter, scale=300.0)
    gate_up_cols = (torch.rand(2 * inter, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    gate_up_bias = randn(gen, 2 * inter, dtype=dtype) if bias else None
    deferred = ops.silu_and_mul(raw_gate_up, backend=backend, input_norm=(hidden, EPS), bias=gate_up_bias,
                                scales=(row_scale, gate_up_cols))
    scaled_first = ops.silu_and_mul(scale_product(raw_gate_up, row_scale, gate_up_cols, dtype=dtype), backend=backend,
                                    input_norm=(hidden, EPS), bias=gate_up_bias)
    assert deferred.dtype == dtype
    assert torch.equal(bits(deferred.cpu()), bits(scaled_first.cpu())), f"silu_and_mul (seed={gen.initial_seed()})"


def test_deferred_scales_need_the_input_norm():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="scales need input_norm"):
        ops.silu_and_mul(x, scales=(torch.ones(2, 1), torch.ones(8)))


# --- the model with the Triton backend -----------------------------------------------------
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_model_forward_with_triton_kernels_matches_torch(gen, monkeypatch, qk_norm):
    """A tiny decoder's forward (prefill) with every op on Triton vs on torch (float32): Qwen3's QK-norm,
    or Llama's llama3-scaled RoPE alone."""
    from engine.attention import AttentionMetadata, PrefillMetadata
    from engine.kv_cache import PagedKVCache
    from engine.models.decoder import DecoderArch, DecoderForCausalLM

    rope = Rope(1e6) if qk_norm else Rope(5e5, "llama3", 8.0, 1.0, 4.0, 32)
    arch = DecoderArch(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope=rope,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=qk_norm)
    torch.manual_seed(gen.initial_seed())
    model = DecoderForCausalLM(arch, max_positions=64).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    lens = [5, 3]
    T, block_size = sum(lens), 4
    input_ids = torch.randint(0, arch.vocab_size, (T,), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    block_tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10], dtype=torch.int32, device=DEVICE)
    no_decodes = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(slots, no_decodes.reshape(0, 2), no_decodes, PrefillMetadata(
        block_tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)))
    outs = {}
    for backend in BACKENDS:
        monkeypatch.setattr(ops, "_use_triton", lambda _, __, b=backend: b == "triton")
        cache = PagedKVCache(model.kv_cache_spec, 4, block_size, torch.float32, torch.device(DEVICE))
        with torch.no_grad():
            outs[backend] = model(input_ids, positions, cache, meta)
    check(outs["triton"], outs["torch"], torch.float32, gen, "hidden states")


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_no_host_synchronisation(gen):
    T, H, Hq, Hkv, D = 8, 256, 8, 2, 128
    rotary = RotaryEmbedding(D, Rope(1e6), 128).to(DEVICE)
    x, r, w = randn(gen, T, H), randn(gen, T, H), randn(gen, H)
    q, k, qkw = randn(gen, T, Hq, D), randn(gen, T, Hkv, D), randn(gen, D)
    positions, slots = torch.arange(T, device=DEVICE), torch.arange(T, dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(T, Hkv, 1, D, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.rms_norm(x, w, EPS)
        for norm in ((qkw, qkw, EPS), None):
            ops.rope_and_write_kv_cache(q, k, k, rotary.cos, rotary.sin, positions, cache, cache, slots, qk_norm=norm)
            ops.rope_and_write_kv_cache(q, k, k, rotary.cos, rotary.sin, positions, cache, cache, slots, qk_norm=norm,
                                        input_norm=(x, EPS), bias=(q.flatten()[:Hq * D], k.flatten(), k.flatten()))
        ops.silu_and_mul(x)
        ops.silu_and_mul(x, input_norm=(r, EPS), bias=w)
    finally:
        torch.cuda.set_sync_debug_mode("default")

"""Tests of the paged-KV ops against an independent float64 oracle: the attention ops on both backends, and
write_kv_cache, the reference of the cache write inside ops.rope_and_write_kv_cache (the Triton kernels do
it in the RoPE kernel: tests/test_fused.py), from the address map.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest.py and,
as a fallback, below, before anything imports triton): float32 plus one bfloat16 case, small shapes.
On CUDA the same cases run for float32, float16 and bfloat16.

Tolerances on ||out - ref|| / ||ref||: float32 1e-4, float16 3e-3, bfloat16 1e-2.
Inputs are fresh random draws on every run (the seed is printed and put in each failure message).
Outputs are filled with NaN before each call; unused cache blocks, unused slots of each sequence's
last block and a block just before the cache (what block id -1 would address) hold NaN too, so a
read outside seq_len, of block-table padding or of a -1 entry turns the result into NaN.
"""
import math
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ops  # noqa: E402
from ops import paged_attention_reference as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
BACKENDS = ["triton", "torch"]
NAN = float("nan")


@pytest.fixture
def gen():
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    return g


def cdiv(a, b):
    return -(-a // b)


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def check(out, ref, dtype, gen, what=""):
    assert torch.isfinite(out).all(), f"{what}: non-finite output (seed={gen.initial_seed()})"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: rel err {err:.3e} >= {TOL[dtype]} (seed={gen.initial_seed()})"


def make_paged(lens, num_kv_heads, head_dim, block_size, dtype, gen, spare_blocks=3, pad_cols=1):
    """A shuffled paged cache holding len(lens) sequences. Returns (key_cache, value_cache,
    block_tables[B, M] int32 with -1 padding). Everything a kernel must not read is NaN."""
    need = [cdiv(L, block_size) for L in lens]
    nb = sum(need) + spare_blocks
    shape = (nb + 1, num_kv_heads, block_size, head_dim)
    kbuf = torch.randn(shape, generator=gen)
    vbuf = torch.randn(shape, generator=gen)
    perm = torch.randperm(nb, generator=gen)
    bt = torch.full((len(lens), max(need) + pad_cols), -1, dtype=torch.int32)
    poison = torch.ones(nb, block_size, dtype=torch.bool)
    i = 0
    for b, (L, n) in enumerate(zip(lens, need)):
        blocks = perm[i:i + n]
        i += n
        bt[b, :n] = blocks
        for j, blk in enumerate(blocks.tolist()):
            poison[blk, : min(block_size, L - j * block_size)] = False
    # buf[0] sits just before the cache: block id -1 addresses it
    for buf in (kbuf, vbuf):
        buf[0] = NAN
        buf[1:].permute(0, 2, 1, 3)[poison] = NAN
    key_cache, value_cache = kbuf.to(dtype)[1:], vbuf.to(dtype)[1:]  # poisoned in float32: FP8 has no masked_fill
    return key_cache.to(DEVICE), value_cache.to(DEVICE), bt.to(DEVICE)


def oracle(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """Causal attention in float64, token by token from the address map:
    slot of position p of sequence b = block_tables[b][p // block_size], offset p % block_size."""
    q = q.double().cpu()
    kc, vc = key_cache.double().cpu(), value_cache.double().cpu()
    bt = block_tables.cpu().long()
    bs = kc.shape[2]
    Hq, Hkv = q.shape[1], kc.shape[1]
    kv_head_of = torch.arange(Hq) // (Hq // Hkv)
    out = torch.zeros_like(q)
    cu = [int(x) for x in cu_seqlens_q]
    for b, L in enumerate(int(x) for x in seq_lens):
        s, e = cu[b], cu[b + 1]
        pos = torch.arange(L)
        phys, off = bt[b][pos // bs], pos % bs
        k = kc[phys, :, off, :][:, kv_head_of]  # [L, Hq, D]
        v = vc[phys, :, off, :][:, kv_head_of]
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * scale
        qpos = L - (e - s) + torch.arange(e - s)
        scores = scores.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.fixture
def nan_outputs(monkeypatch):
    """Both backends allocate their outputs with torch.empty_like: make it hand out NaN, so that an
    output element the op fails to write fails the test."""
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(NAN) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty_like", poisoned)


# ---------------------------------------------------------------------------------------------
# write_kv_cache
# ---------------------------------------------------------------------------------------------
def bits(t):
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,T", [(1, 4, 64, 5), (8, 2, 128, 13), (16, 8, 64, 40), (32, 1, 128, 70)])
def test_write_kv_cache(dtype, block_size, num_kv_heads, head_dim, T, gen):
    nb = cdiv(T, block_size) + 3
    shape = (nb, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    key_cache.view(-1)[torch.rand(key_cache.numel(), generator=gen) < 0.3] = NAN  # poison: must stay as is
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache.view(-1)[torch.rand(value_cache.numel(), generator=gen) < 0.3] = NAN
    key = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(nb * block_size, generator=gen)[:T].to(torch.int32)
    slots[torch.rand(T, generator=gen) < 0.25] = -1
    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))

    # expected, from the address map
    k_exp, v_exp = k_before.cpu().clone(), v_before.cpu().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_exp[slot // block_size, :, slot % block_size] = key[t]
            v_exp[slot // block_size, :, slot % block_size] = value[t]
    assert torch.equal(bits(key_cache.cpu()), bits(k_exp)), f"seed={gen.initial_seed()}"
    assert torch.equal(bits(value_cache.cpu()), bits(v_exp)), f"seed={gen.initial_seed()}"


def test_write_kv_cache_worked_example():
    # docs/design.md: block_size 4, block_table [5, 2, 9, 1], token_pos 6 -> block 1, offset 2, physical 2, slot 10
    block_table = [5, 2, 9, 1]
    pos = 6
    slot = block_table[pos // 4] * 4 + pos % 4
    assert slot == 10
    key_cache = torch.zeros(10, 1, 4, 64, device=DEVICE)
    value_cache = torch.zeros(10, 1, 4, 64, device=DEVICE)
    key = torch.arange(64, dtype=torch.float32, device=DEVICE).view(1, 1, 64) + 1
    reference.write_kv_cache(key, -key, key_cache, value_cache, torch.tensor([slot], dtype=torch.int32, device=DEVICE))
    assert torch.equal(key_cache[2, 0, 2], key[0, 0]) and torch.equal(value_cache[2, 0, 2], -key[0, 0])
    assert key_cache.count_nonzero() == 64 and value_cache.count_nonzero() == 64


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
# (block_size, Hq, Hkv, head_dim, sequence lengths): each block size meets lengths 1,
# block_size - 1, block_size, block_size + 1 across the cases, and a few hundred.
DECODE_CASES = [
    (1, 4, 4, 64, [1, 2, 37, 260]),
    (8, 8, 2, 128, [7, 8, 9, 1, 300]),
    (16, 16, 8, 64, [15, 16, 17, 300]),
    (16, 16, 8, 128, [1, 48, 333]),
    (32, 6, 1, 128, [31, 32, 33, 257]),
    (128, 8, 2, 64, [1, 127, 128, 129]),
]


def decode_inputs(case, dtype, gen, cache_dtype=None):
    bs, Hq, Hkv, D, lens = case
    key_cache, value_cache, bt = make_paged(lens, Hkv, D, bs, cache_dtype or dtype, gen)
    q = torch.randn(len(lens), Hq, D, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, key_cache, value_cache, bt, seq_lens, 1.0 / math.sqrt(D)


def decode_oracle(q, key_cache, value_cache, bt, seq_lens, scale):
    cu = torch.arange(q.shape[0] + 1)
    return oracle(q, key_cache, value_cache, bt, cu, seq_lens.cpu(), scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}x{c[2]}-d{c[3]}")
def test_paged_attention_decode(backend, dtype, case, gen, nan_outputs):
    args = decode_inputs(case, dtype, gen)
    ref = decode_oracle(*args)
    out = ops.paged_attention_decode(*args, backend=backend)
    assert out.shape == args[0].shape and out.dtype == dtype
    check(out, ref, dtype, gen, f"decode {backend}")


@pytest.mark.parametrize("case,num_splits", [
    ((16, 8, 2, 64, [1, 17, 400]), 1), ((16, 8, 2, 64, [1, 17, 400]), 3), ((16, 8, 2, 64, [1, 17, 400]), 8),
    ((8, 14, 2, 64, [5, 300]), 3),          # a head tile of the merge larger than Hq (masked heads)
    ((32, 6, 1, 128, [31, 257, 700]), 64),  # 64 slots: the merge takes 2 heads a program, 3 programs a row
])
def test_paged_attention_decode_split_kv(case, num_splits, gen, nan_outputs):
    """Forced partition counts (1: the direct path, 3: not a power of two, 8 and 64: empty partitions)."""
    from ops import paged_attention

    dtype = torch.float32
    args = decode_inputs(case, dtype, gen)
    ref = decode_oracle(*args)
    out = paged_attention.paged_attention_decode(*args, num_splits=num_splits)
    check(out, ref, dtype, gen, f"decode splits={num_splits}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode_row_order(num_splits, gen, nan_outputs):
    """A row order only changes which programs start first: any permutation gives the same output as
    none, row for row, and both match the oracle."""
    from ops import paged_attention

    dtype = torch.float32
    args = decode_inputs((16, 8, 2, 64, [1, 17, 400, 33, 250]), dtype, gen)
    ref = decode_oracle(*args)
    order = torch.randperm(args[0].shape[0], generator=gen).to(torch.int32).to(DEVICE)
    plain = paged_attention.paged_attention_decode(*args, num_splits=num_splits)
    ordered = paged_attention.paged_attention_decode(*args, num_splits=num_splits, row_order=order)
    check(ordered, ref, dtype, gen, f"decode row_order splits={num_splits}")
    assert torch.equal(ordered, plain)
    check(ops.paged_attention_decode(*args, backend="torch", row_order=order), ref, dtype, gen, "ref row_order")


def test_decode_split_heuristic_and_hint(gen):
    from ops import paged_attention

    dev = torch.device(DEVICE)
    assert paged_attention.decode_num_splits(256, 8, 2048, dev) == 1
    assert paged_attention.decode_num_splits(1, 8, 32768, dev) > 1
    assert paged_attention.decode_num_splits(1, 8, 100, dev) == 1
    # 32 rows x 8 kv heads = 256 programs on 132 SMs: ceil(264 / 256) = 2 splits fill the GPU (2 waves), and
    # for balance over mixed lengths split until 4 waves: ceil(528 / 256) = 3 -> 4; cascade's suffix pass
    # (balance=False) stops at 2
    assert paged_attention.decode_num_splits(32, 8, 4096, dev) == 4
    assert paged_attention.decode_num_splits(32, 8, 4096, dev, balance=False) == 2
    assert paged_attention.decode_num_splits(128, 8, 4096, dev) == 1  # 1024 programs: more than 4 waves
    assert paged_attention.decode_num_splits(16, 8, 4096, dev) == paged_attention.BALANCE_MAX_SPLITS
    dtype = torch.float32
    args = decode_inputs((8, 4, 2, 64, [700]), dtype, gen)
    ref = decode_oracle(*args)
    out = ops.paged_attention_decode(*args, backend="triton", max_seq_len=700)
    check(out, ref, dtype, gen, "decode max_seq_len")
    # the reference backend ignores the hint
    check(ops.paged_attention_decode(*args, backend="torch", max_seq_len=700), ref, dtype, gen, "ref hint")


# (block_size, Hq, Hkv, head_dim, [(seq_len, len_q), ...]): len_q < seq_len is a cached prefix
PREFILL_CASES = [
    (1, 4, 4, 64, [(5, 5), (40, 3), (1, 1), (200, 120)]),
    (8, 8, 2, 128, [(7, 7), (8, 8), (9, 4), (30, 30), (250, 250)]),
    (16, 16, 8, 64, [(15, 15), (17, 17), (16, 1), (200, 64)]),
    (16, 16, 8, 128, [(300, 300), (48, 16)]),
    (32, 6, 1, 128, [(31, 31), (33, 33), (32, 2), (300, 40)]),
    (128, 8, 2, 64, [(129, 129), (260, 100), (127, 127)]),
]


def prefill_inputs(case, dtype, gen, cache_dtype=None):
    bs, Hq, Hkv, D, seqs = case
    lens = [L for L, _ in seqs]
    key_cache, value_cache, bt = make_paged(lens, Hkv, D, bs, cache_dtype or dtype, gen)
    qlens = torch.tensor([n for _, n in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = qlens.cumsum(0)
    q = torch.randn(int(cu[-1]), Hq, D, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, key_cache, value_cache, bt, cu.to(DEVICE), seq_lens, 1.0 / math.sqrt(D)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}x{c[2]}-d{c[3]}")
def test_paged_attention_prefill(backend, dtype, case, gen, nan_outputs):
    args = prefill_inputs(case, dtype, gen)
    ref = oracle(*args)
    out = ops.paged_attention_prefill(*args, backend=backend)
    assert out.shape == args[0].shape and out.dtype == dtype
    check(out, ref, dtype, gen, f"prefill {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_attention_over_an_fp8_cache(backend, cache_dtype, kind, gen, nan_outputs):
    """K and V stored in FP8 (cache.kv_cache_dtype), queries in the model's dtype: the float64 oracle over
    the same cache (its FP8 values dequantized exactly) at the queries' tolerance."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    if kind == "decode":
        args = decode_inputs(DECODE_CASES[3], dtype, gen, cache_dtype)
        ref, out = decode_oracle(*args), ops.paged_attention_decode(*args, backend=backend)
    else:
        args = prefill_inputs(PREFILL_CASES[1], dtype, gen, cache_dtype)
        ref, out = oracle(*args), ops.paged_attention_prefill(*args, backend=backend)
    assert args[1].dtype == cache_dtype and out.dtype == dtype
    check(out, ref, dtype, gen, f"{kind} {backend} over {cache_dtype}")


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}x{c[2]}-d{c[3]}")
def test_decode_over_an_e4m3_cache_with_the_split_query(case, num_splits, gen, nan_outputs, monkeypatch):
    """The decode kernel's split query (ops/paged_attention.py, split_query_fp8): the e4m3 keys multiplied as
    stored by the query as two e4m3 parts, on and off Hopper and in the interpreter (forced where
    split_query would not take it; on Hopper the Gluon kernel takes these launches). The float64 oracle over
    the same cache, at bfloat16's tolerance: the two parts keep about a bfloat16 query's precision, whatever
    the query's dtype."""
    from ops import paged_attention

    if ON_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or later")
    monkeypatch.setattr(paged_attention, "split_query", lambda q, key_cache: True)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    args = decode_inputs(case, dtype, gen, torch.float8_e4m3fn)
    out = paged_attention.paged_attention_decode(*args, num_splits=num_splits)
    check(out, decode_oracle(*args), torch.bfloat16, gen, f"split query, {num_splits} splits")


@pytest.mark.skipif(not ON_GPU, reason="a Gluon kernel for Hopper's FP8 tensor cores (no interpreter)")
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}x{c[2]}-d{c[3]}")
def test_decode_over_an_e4m3_cache_in_gluon(case, num_splits, gen, nan_outputs, monkeypatch):
    """ops/paged_attention_gluon.py, which takes the split query's decode launches on Hopper: the float64 oracle
    over the same cache at bfloat16's tolerance, the rows started in a shuffled order, into partial slots and
    merged or straight into the output."""
    from ops import paged_attention, paged_attention_gluon

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is for Hopper (compute capability 9.0)")
    launches = []
    launch = paged_attention_gluon.launch_decode
    monkeypatch.setattr(paged_attention_gluon, "launch_decode", lambda *a: launches.append(a[6]) or launch(*a))
    args = decode_inputs(case, torch.bfloat16, gen, torch.float8_e4m3fn)
    order = torch.randperm(args[0].shape[0], generator=gen).to(torch.int32).to(DEVICE)
    out = paged_attention.paged_attention_decode(*args, num_splits=num_splits, row_order=order)
    check(out, decode_oracle(*args), torch.bfloat16, gen, f"gluon decode, {num_splits} splits")
    assert len(launches) == 1 and (num_splits is None or launches == [num_splits])


def rows_of_a_larger_buffer(q, lead):
    """A NaN buffer with `lead` rows before and one after q's rows; returns (buffer, the view for q)."""
    buf = torch.full((lead + q.shape[0] + 1, *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
    return buf, buf[lead:lead + q.shape[0]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,num_splits", [("decode", None), ("decode", 3), ("prefill", None)])
def test_attention_into_out(backend, op, num_splits, gen, nan_outputs):
    """out=: the op writes its result into the given view (rows of a larger tensor, as a mixed step's
    decode and prefill rows share one output) and returns it; the buffer's other rows stay untouched."""
    from ops import paged_attention

    dtype = torch.float32
    if op == "decode":
        args = decode_inputs((16, 8, 2, 64, [1, 17, 400, 33]), dtype, gen)
        ref = decode_oracle(*args)
        kwargs = {"num_splits": num_splits} if backend == "triton" else {}
        run = paged_attention.paged_attention_decode if backend == "triton" else ops.paged_attention_decode
    else:
        args = prefill_inputs((16, 8, 2, 64, [(40, 40), (77, 5), (300, 130)]), dtype, gen)
        ref = oracle(*args)
        kwargs = {}
        run = ops.paged_attention_prefill
    if backend == "torch":
        kwargs["backend"] = "torch"
    buf, view = rows_of_a_larger_buffer(args[0], 3)
    out = run(*args, out=view, **kwargs)
    assert out.data_ptr() == view.data_ptr()
    check(out, ref, dtype, gen, f"{op} into out, {backend}")
    assert buf[:3].isnan().all() and buf[-1].isnan().all()


def test_attention_out_must_match_q(gen):
    args = decode_inputs((16, 8, 2, 64, [1, 17]), torch.float32, gen)
    with pytest.raises(ValueError, match="out must match q"):
        ops.paged_attention_decode(*args, out=torch.empty(3, 8, 64, device=DEVICE))


def test_prefill_max_seqlen_q_hint(gen, nan_outputs):
    dtype = torch.float32
    args = prefill_inputs((16, 8, 2, 64, [(40, 1), (17, 2), (5, 1)]), dtype, gen)
    ref = oracle(*args)
    for backend in BACKENDS:
        check(ops.paged_attention_prefill(*args, backend=backend, max_seqlen_q=2), ref, dtype, gen, backend)


@pytest.mark.skipif(ON_GPU, reason="the GPU runs every dtype in the tests above")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_bfloat16_interpreter(kind, gen, nan_outputs):
    dtype = torch.bfloat16
    if kind == "decode":
        args = decode_inputs((16, 8, 2, 64, [1, 17, 100]), dtype, gen)
        ref, out = decode_oracle(*args), ops.paged_attention_decode(*args, backend="triton")
    else:
        args = prefill_inputs((16, 8, 2, 64, [(17, 17), (60, 20)]), dtype, gen)
        ref, out = oracle(*args), ops.paged_attention_prefill(*args, backend="triton")
    check(out, ref, dtype, gen, f"{kind} bf16")


# ---------------------------------------------------------------------------------------------
# CUDA graph capture
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture(gen):
    dtype = torch.bfloat16
    case = (16, 16, 8, 128, [1, 100, 1000, 17])
    q, key_cache, value_cache, bt, seq_lens, scale = decode_inputs(case, dtype, gen)
    pargs = prefill_inputs((16, 16, 8, 128, [(50, 50), (300, 100)]), dtype, gen)
    out_d = ops.paged_attention_decode(q, key_cache, value_cache, bt, seq_lens, scale)  # warm up / compile
    out_p = ops.paged_attention_prefill(*pargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_d = ops.paged_attention_decode(q, key_cache, value_cache, bt, seq_lens, scale)
        out_p = ops.paged_attention_prefill(*pargs)
    for new_lens in ([1, 100, 1000, 17], [1, 37, 513, 9]):  # new values (within what was written), same shapes
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out_d.fill_(NAN)
        out_p.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check(out_d, decode_oracle(q, key_cache, value_cache, bt, seq_lens, scale), dtype, gen, "graph decode")
        check(out_p, oracle(*pargs), dtype, gen, "graph prefill")

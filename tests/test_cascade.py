"""Cascade (shared-prefix) decode attention, both backends, against the float64 oracle of test_ops.

Each case builds groups of rows whose block tables share the blocks of their group's prefix (a
prefix that ends mid-block shares that block too, as sampled sequences of one prompt do before
copy-on-write), with shuffled physical block ids. The result must equal plain paged decode, which
test_ops checks against the same oracle, within the ops' tolerances. Slots no row may read, a block
just before the cache (block id -1) and the outputs are NaN.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch

import ops
from test_ops import (  # noqa: F401  (gen, nan_outputs: fixtures)
    DEVICE, DTYPES, NAN, ON_GPU, cdiv, check, decode_oracle, gen, nan_outputs, rows_of_a_larger_buffer,
)

BACKENDS = ["triton", "torch"]


@pytest.fixture
def nan_buffers(nan_outputs, monkeypatch):
    """nan_outputs, and NaN in every float tensor from torch.empty too (the Triton op's partial
    buffers), so that a merge of a slot nobody wrote fails the test."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(NAN) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def make_groups(groups, lone_lens, num_kv_heads, head_dim, block_size, dtype, gen, spare_blocks=2):
    """groups: [(prefix_len, [seq_len of each member]), ...], then rows in no group (lone_lens).
    Returns (key_cache, value_cache, block_tables [B, M] int32 with -1 padding, seq_lens, cu_group_rows,
    group_prefix_lens); members of a group share the first cdiv(prefix_len, block_size) blocks."""
    tables, lens, cu, prefixes = [], [], [0], []
    next_block = 0

    def new_blocks(n):
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    for prefix, members in groups:
        shared = new_blocks(cdiv(prefix, block_size))
        for L in members:
            tables.append(shared + new_blocks(max(cdiv(L, block_size) - len(shared), 0)))
            lens.append(L)
        cu.append(len(lens))
        prefixes.append(prefix)
    for L in lone_lens:
        tables.append(new_blocks(cdiv(L, block_size)))
        lens.append(L)
    nb = next_block + spare_blocks
    perm = torch.randperm(nb, generator=gen)
    bt = torch.full((len(lens), max(map(len, tables)) + 1), -1, dtype=torch.int32)
    poison = torch.ones(nb, block_size, dtype=torch.bool)
    for b, (table, L) in enumerate(zip(tables, lens)):
        bt[b, :len(table)] = perm[table]
        pos = torch.arange(L)
        poison[bt[b, pos // block_size].long(), pos % block_size] = False
    shape = (nb + 1, num_kv_heads, block_size, head_dim)
    caches = []
    for _ in range(2):
        buf = torch.randn(shape, generator=gen).to(dtype).float()  # poisoned in float32: FP8 has no masked_fill
        buf[0] = NAN  # sits just before the cache: what block id -1 would address
        buf[1:].permute(0, 2, 1, 3)[poison] = NAN
        caches.append(buf.to(dtype)[1:].to(DEVICE))
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return (*caches, bt.to(DEVICE), as_int(lens), as_int(cu), as_int(prefixes))


def cascade_inputs(case, dtype, gen):
    bs, Hq, Hkv, D, groups, lone = case
    key_cache, value_cache, bt, seq_lens, cu, prefixes = make_groups(groups, lone, Hkv, D, bs, dtype, gen)
    q = torch.randn(bt.shape[0], Hq, D, generator=gen).to(dtype).to(DEVICE)
    return (q, key_cache, value_cache, bt, seq_lens, 1.0 / math.sqrt(D)), (cu, prefixes)


# (block_size, Hq, Hkv, head_dim, [(prefix_len, [member seq_lens])], [lone seq_lens])
CASES = [
    # GQA 4; a member whose context is exactly the prefix, one ending inside the prefix's last block,
    # a prefix ending mid-block, a group of one without prefix, a group of 12 (several row tiles)
    (16, 8, 2, 64, [(32, [32, 40, 77]), (0, [20]), (20, [20, 31, 60]), (48, [48 + 7 * i for i in range(12)])], [5]),
    # GQA 1, block size 1, empty groups (the last one at row B), prefixes of 1 and many blocks
    (1, 4, 4, 32, [(5, [5, 9]), (0, []), (1, [1, 2]), (40, [41, 40, 70, 45]), (7, [])], []),
    # GQA 2, block size 128: prefixes that cover whole, part of and less than a decode tile; a last,
    # empty group (as padding to a fixed group count would make)
    (128, 4, 2, 64, [(200, [200, 230, 300]), (20, [20, 40]), (130, [260, 131]), (64, [])], [1, 129]),
    # many small groups (n samples of many prompts): 64 groups of 1 to 16 rows, prefixes of 3 to 50 tokens
    # that end inside a block or on its edge, members at the prefix or up to 9 tokens past it
    (16, 4, 2, 32, [(3 + (g * 13) % 48, [3 + (g * 13) % 48 + (g + r) % 10 for r in range(1 + g % 16)])
                    for g in range(64)], [7]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}x{c[2]}")
def test_cascade_equals_decode(backend, dtype, case, gen, nan_buffers):
    args, groups = cascade_inputs(case, dtype, gen)
    ref = decode_oracle(*args)
    out = ops.cascade_attention_decode(*args, *groups, backend=backend)
    assert out.shape == args[0].shape and out.dtype == dtype
    check(out, ref, dtype, gen, f"cascade {backend}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}x{c[2]}")
def test_cascade_over_an_e4m3_cache_with_the_split_query(case, gen, nan_buffers, monkeypatch):
    """The suffix pass is the decode kernel from each row's ctx_start: over an e4m3 cache with the split
    query (forced where it would not be taken), at bfloat16's tolerance as in test_ops."""
    from ops import paged_attention

    if ON_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or later")
    monkeypatch.setattr(paged_attention, "split_query", lambda q, key_cache: True)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    (q, *rest), groups = cascade_inputs(case, torch.float8_e4m3fn, gen)
    args = (torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE), *rest)
    out = ops.cascade_attention_decode(*args, *groups)
    check(out, decode_oracle(*args), torch.bfloat16, gen, "cascade over e4m3, split query")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_groups", [True, False])
def test_cascade_into_out(backend, with_groups, gen, nan_buffers):
    """out=: the result lands in the given view (rows of a larger tensor), with groups and without (the
    plain path), and the buffer's other rows stay untouched."""
    dtype = torch.float32
    args, groups = cascade_inputs(CASES[0], dtype, gen)
    if not with_groups:
        groups = (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(0, dtype=torch.int32, device=DEVICE))
    buf, view = rows_of_a_larger_buffer(args[0], 2)
    out = ops.cascade_attention_decode(*args, *groups, backend=backend, out=view)
    assert out.data_ptr() == view.data_ptr()
    check(out, decode_oracle(*args), dtype, gen, f"cascade into out, {backend}")
    assert buf[:2].isnan().all() and buf[-1].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_groups_is_plain_decode(backend, gen, nan_buffers):
    dtype = torch.float32
    args, _ = cascade_inputs((16, 8, 2, 64, [], [1, 40, 100]), dtype, gen)
    no_groups = (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(0, dtype=torch.int32, device=DEVICE))
    check(ops.cascade_attention_decode(*args, *no_groups, backend=backend), decode_oracle(*args), dtype, gen, backend)


def plan_of(args, groups, **fields):
    """The prefix pass's plan of these groups on DEVICE, with PrefixPass fields replaced (block_q, programs)."""
    from ops import cascade

    shape = dataclasses.replace(cascade.PrefixPass.of(args[0], args[1]), **fields)
    return shape, torch.from_numpy(shape.plan(*(g.cpu().numpy() for g in groups))).to(DEVICE)


def test_prefix_read_through_each_tiles_first_row(gen, nan_buffers):
    """White box: the Triton op reads a prefix chunk through its tile's first row's block table only, so
    the other rows' prefix blocks may point at block -1 (NaN) and the result must not change. Tiles of 2
    rows here: a group's rows 0, 2, 4, .. keep their tables."""
    from ops import cascade

    dtype = torch.float32
    groups = [(32, [32, 40, 77]), (20, [20, 31, 60]), (48, [50, 48, 90, 64, 70])]
    args, (cu, prefixes) = cascade_inputs((16, 8, 2, 64, groups, [5]), dtype, gen)
    ref = decode_oracle(*args)
    _, plan = plan_of(args, (cu, prefixes), block_q=2)
    bt = args[3].clone()
    bounds = cu.tolist()
    for g, (prefix, _) in enumerate(groups):
        for row in range(bounds[g], bounds[g + 1]):
            if (row - bounds[g]) % 2:
                bt[row, :prefix // 16] = -1
    out = cascade.cascade_attention_decode(*args[:3], bt, *args[4:], cu, prefixes, num_splits=2, plan=plan)
    check(out, ref, dtype, gen, "prefix via each tile's first row")


@pytest.mark.parametrize("block_q,programs,chunk_min,num_splits", [(8, 1, 256, 1), (2, 7, 16, 2), (1, 2, 16, 8),
                                                                    (3, 40, 32, 5)])
def test_cascade_forced_plans(block_q, programs, chunk_min, num_splits, gen, nan_buffers, monkeypatch):
    """Plans other than the default: one program walking every item, more programs than items, tiles of
    1-8 rows (3: not a power of two), chunks of 16-256 tokens (up to PREFIX_SLOTS a group), and forced
    suffix splits (PREFIX_SLOTS + 5 slots of a buffer of the next power of two: the merge masks those past the
    last)."""
    from ops import cascade

    monkeypatch.setattr(cascade, "CHUNK_MIN_TOKENS", chunk_min)
    dtype = torch.float32
    args, groups = cascade_inputs((16, 8, 2, 64, [(96, [96, 150, 100]), (16, [17, 40]), (160, [170] * 5)], [33]),
                                  dtype, gen)
    shape, plan = plan_of(args, groups, block_q=block_q, programs=programs)
    out = cascade.cascade_attention_decode(*args, *groups, num_splits=num_splits, plan=plan)
    check(out, decode_oracle(*args), dtype, gen, f"{shape} splits={num_splits}")


def test_plan_covers_each_grouped_row_once(gen):
    """PrefixPass.plan against a count by hand: over its items, each row of a group with an aligned prefix
    p > 0 sees every token of [0, p) exactly once, in slots 0 .. its group's chunk count - 1, each slot once;
    no item is empty or crosses its group; the items are within max_items; chunks start on block_n."""
    from ops import cascade

    rng = np.random.default_rng(0)
    for trial in range(200):
        num_groups = int(rng.integers(1, 40))
        rows = rng.integers(0, 20, num_groups)
        prefixes = np.where(rng.random(num_groups) < 0.2, 0, rng.integers(1, 5000, num_groups))
        shape = cascade.PrefixPass(block_q=int(rng.choice([1, 3, 8, 64])), block_n=int(rng.choice([16, 64])),
                                   align=int(rng.choice([1, 32])), programs=int(rng.integers(1, 40)))
        cu = np.r_[0, np.cumsum(rows)]
        work = shape.plan(cu, prefixes)
        items = work[1:]
        assert work[0, 0] == len(items)
        assert len(items) <= shape.max_items(int(cu[-1]), num_groups)
        seen = {}
        for first, n, start, end, slot, slots, prefix, _ in items.tolist():
            g = int(np.searchsorted(cu, first, side="right")) - 1
            assert 0 < n <= shape.block_q and first + n <= cu[g + 1], (trial, first, n)
            assert 0 <= start < end <= prefix and start % shape.block_n == 0 and 0 <= slot < slots <= cascade.PREFIX_SLOTS
            assert prefix == prefixes[g] - prefixes[g] % shape.align
            for row in range(first, first + n):
                seen.setdefault(row, []).append((start, end, slot, slots, prefix))
        for g in range(num_groups):
            aligned = prefixes[g] - prefixes[g] % shape.align
            for row in range(cu[g], cu[g + 1]):
                chunks = sorted(seen.pop(row, []))
                if aligned == 0:
                    assert not chunks
                    continue
                assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == aligned
                assert sorted(c[2] for c in chunks) == list(range(chunks[0][3]))
        assert not seen


def dealt_makespan(lengths, programs: int, block_n: int) -> int:
    """The tokens of the busiest program when program p takes items p, p + programs, ... of the list (the
    prefix kernel's walk), each item costing its tokens plus block_n."""
    loads = [0] * programs
    for i, n in enumerate(lengths):
        loads[i % programs] += n + block_n
    return max(loads, default=0)


def test_plan_picks_the_shortest_makespan():
    """One group: the plan's items, dealt as the kernel walks them, end no later than those of any chunk count
    1 .. PREFIX_SLOTS cut by hand (chunks of the prefix over the count, rounded up to block_n, at least
    CHUNK_MIN_TOKENS, then evened out over the chunks that makes; a count past the work list's bound is not a
    candidate); and the shapes measured on the H100 (benchmarks/NOTES.md, session 46) take the counts that ran
    fastest there."""
    from ops import cascade

    rng = np.random.default_rng(1)
    for trial in range(300):
        rows, prefix = int(rng.integers(1, 1100)), int(rng.integers(1, 5000))
        shape = cascade.PrefixPass(block_q=int(rng.choice([16, 32, 64])), block_n=int(rng.choice([32, 64])),
                                   align=1, programs=int(rng.integers(1, 40)))
        work = shape.plan(np.array([0, rows]), np.array([prefix]))
        planned = dealt_makespan((work[1:, 3] - work[1:, 2]).tolist(), shape.programs, shape.block_n)
        tiles, spans = -(-rows // shape.block_q), []
        for count in range(1, cascade.PREFIX_SLOTS + 1):
            length = -(-max(cascade.CHUNK_MIN_TOKENS, -(-prefix // count)) // shape.block_n) * shape.block_n
            chunks = -(-prefix // length)
            length = -(-(-(-prefix // chunks)) // shape.block_n) * shape.block_n  # the chunks evened out
            chunks = -(-prefix // length)
            if count > 1 and tiles * (chunks - 1) > cascade.PREFIX_ROUNDS * shape.programs:
                break
            per_tile = [length] * (chunks - 1) + [prefix - (chunks - 1) * length]
            spans.append(dealt_makespan(sorted(per_tile * tiles, reverse=True), shape.programs, shape.block_n))
        assert planned == min(spans), (trial, rows, prefix, shape)
    h100 = cascade.PrefixPass(block_q=32, block_n=64, align=32, programs=33)
    for rows, prefix, chunks in [([1024], 2048, 1), ([512], 2048, 2), ([16] * 64, 1024, 1)]:
        assert set(h100.chunks(np.array(rows), np.full(len(rows), prefix))[2].tolist()) == {chunks}


@pytest.mark.skipif(ON_GPU, reason="the GPU runs every dtype in the tests above")
def test_cascade_bfloat16_interpreter(gen, nan_buffers):
    dtype = torch.bfloat16
    args, groups = cascade_inputs((16, 8, 2, 64, [(32, [32, 45, 90]), (0, [7])], [20]), dtype, gen)
    check(ops.cascade_attention_decode(*args, *groups, backend="triton"), decode_oracle(*args), dtype, gen, "bf16")


def test_cascade_bad_groups(gen):
    args, (cu, prefixes) = cascade_inputs((16, 4, 2, 32, [(32, [32, 40]), (16, [20, 30])], []), torch.float32, gen)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    with pytest.raises(ValueError, match="group_prefix_lens"):
        ops.cascade_attention_decode(*args, cu, prefixes[:1], backend="triton")
    with pytest.raises(ValueError, match="int32"):
        ops.cascade_attention_decode(*args, cu.long(), prefixes.long(), backend="triton")
    with pytest.raises(ValueError, match="never decrease"):
        ops.cascade_attention_decode(*args, as_int([0, 3, 2]), prefixes, backend="torch")
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = 20"):
        ops.cascade_attention_decode(*args, cu, as_int([32, 21]), backend="torch")
    with pytest.raises(ValueError, match=r"block_tables\[2\] maps the first 16 tokens of group 1 .* block_tables\[1\]"):
        ops.cascade_attention_decode(*args, as_int([0, 1, 3, 4]), as_int([0, 16, 0]), backend="torch")


def test_reference_merge_is_exact_attention(gen):
    """The reference's two building blocks against plain softmax attention, in float64 terms."""
    from ops import paged_attention_reference as reference

    q = torch.randn(3, 4, 16, generator=gen)
    k, v = torch.randn(50, 2, 16, generator=gen), torch.randn(50, 2, 16, generator=gen)
    full = reference.attend_with_lse(q, k, v, 0.25)[0]
    parts = [reference.attend_with_lse(q, k[a:b], v[a:b], 0.25) for a, b in ((0, 0), (0, 20), (20, 50), (50, 50))]
    merged = parts[0]
    for o, lse in parts[1:]:
        merged = (reference.merge_attention(merged[0], merged[1], o, lse),
                  torch.logaddexp(merged[1], lse))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, dim=1)) * 0.25
    expect = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double().repeat_interleave(2, dim=1))
    assert torch.allclose(full.double(), expect, atol=1e-5) and torch.allclose(merged[0].double(), expect, atol=1e-5)


def test_graph_layout(gen, nan_buffers):
    """A step as an engine cascade graph runs it (engine/cuda_graphs.py): its groups (one of them a plain
    run between two sharing groups) padded by copy_groups with empty groups up to the static size, its plan
    in the first rows of a larger buffer whose other rows hold garbage, then the bucket's padding rows
    (seq_len 0, another row's block table) after every group and the plain row."""
    from engine.attention import CascadeMetadata
    from engine.cuda_graphs import copy_groups
    from ops import cascade

    dtype, pad_rows, entries = torch.float32, 3, 8
    args, (cu, prefixes) = cascade_inputs((16, 8, 2, 64, [(32, [32, 40, 77]), (0, [20, 9]), (48, [48, 60])], [5]),
                                          dtype, gen)
    q, key_cache, value_cache, bt, seq_lens, scale = args
    _, plan = plan_of(args, (cu, prefixes))
    static = CascadeMetadata(torch.full((entries + 1,), 99, dtype=torch.int32, device=DEVICE),
                             torch.full((entries,), 99, dtype=torch.int32, device=DEVICE),
                             torch.full((plan.shape[0] + 5, cascade.WORK_FIELDS), 99, dtype=torch.int32, device=DEVICE))
    copy_groups(static, CascadeMetadata(cu, prefixes, plan))
    assert static.cu_group_rows.tolist() == [0, 3, 5, 7] + [7] * (entries - 3)
    assert static.group_prefix_lens.tolist() == [32, 0, 48] + [0] * (entries - 3)
    assert torch.equal(static.plan[:plan.shape[0]], plan)
    padded = (torch.cat([q, torch.randn(pad_rows, *q.shape[1:], generator=gen).to(DEVICE)]), key_cache, value_cache,
              torch.cat([bt, bt[:pad_rows]]), torch.cat([seq_lens, seq_lens.new_zeros(pad_rows)]), scale)
    out = ops.cascade_attention_decode(*padded, static.cu_group_rows, static.group_prefix_lens, backend="triton",
                                       plan=static.plan)
    check(out[:q.shape[0]], decode_oracle(*args), dtype, gen, "graph layout")
    assert torch.isfinite(out[q.shape[0]:]).all()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cascade_cuda_graph(gen):
    """One capture, replayed with other seq_lens, groups, prefix lengths and plans of the same shapes."""
    from ops import cascade

    dtype = torch.bfloat16
    args, (cu, prefixes) = cascade_inputs(
        (16, 16, 8, 128, [(256, [300, 256, 900]), (32, [40, 33]), (0, [17])], [1000]), dtype, gen)
    q, key_cache, value_cache, bt, seq_lens, scale = args
    shape = cascade.PrefixPass.of(q, key_cache)
    plan = torch.zeros(1 + shape.max_items(q.shape[0], 3), cascade.WORK_FIELDS, dtype=torch.int32, device=DEVICE)

    def set_groups(new_cu, new_prefixes):
        cu.copy_(as_int(new_cu))
        prefixes.copy_(as_int(new_prefixes))
        work = torch.from_numpy(shape.plan(np.array(new_cu), np.array(new_prefixes)))
        plan[:work.shape[0]].copy_(work)

    as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    set_groups(cu.tolist(), prefixes.tolist())
    ops.cascade_attention_decode(*args, cu, prefixes, plan=plan)  # warm-up: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.cascade_attention_decode(*args, cu, prefixes, plan=plan)
    # second replay: rows 0-2 as groups of 1 and 2 with shorter prefixes, shorter contexts everywhere
    for new_lens, new_cu, new_prefixes in (([300, 256, 900, 40, 33, 17, 1000], [0, 3, 5, 6], [256, 32, 0]),
                                           ([200, 256, 500, 40, 16, 17, 7], [0, 1, 3, 3], [0, 160, 0])):
        seq_lens.copy_(as_int(new_lens))
        set_groups(new_cu, new_prefixes)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check(out, decode_oracle(*args), dtype, gen, f"graph {new_cu}")

"""Mixture-of-experts models (engine/models/qwen3_moe.py, engine/models/moe.py): a small random
Qwen3-MoE saved by transformers (per-expert tensors, as the hub's) runs greedy token-exact with
transformers; the MoE ops against a float64 loop over tokens and their experts."""
import pytest
import torch

import ops
from conftest import draw_norm_weights
from engine.llm import LLM, SamplingParams
from ops.moe import Tiles, moe_experts
from ops.moe import sorted_pairs as moe_sorted_pairs
from test_oracle import MAX_TOKENS, reference_outputs


def moe_checkpoint(directory, **options):
    """A random Qwen3-MoE (8 experts, top-2, 3 layers) with the byte-level tokenizer, and transformers' model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=160, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.eos_token_id, **options)
    torch.manual_seed(4321)
    model = draw_norm_weights(Qwen3MoeForCausalLM(config)).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(9)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 7, 20, 41)]


@pytest.mark.parametrize("options, block_size, num_blocks", [
    ({}, 16, None),
    ({}, 4, 32),  # 128 slots (one sequence of max_model_len) for four of 1-41 + MAX_TOKENS tokens: preemptions
    ({"mlp_only_layers": [1], "norm_topk_prob": False}, 16, None),
], ids=["sparse", "preempted", "dense_layer_unnormalized"])
def test_greedy_matches_transformers(tmp_path, prompts, options, block_size, num_blocks):
    path, hf_model = moe_checkpoint(tmp_path / "moe", **options)
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=block_size,
              num_blocks=num_blocks, admission_headroom=0)  # admissions that fill the pool, then preempt
    layers = llm.engine.model.model.layers
    sparse = [type(layer.mlp).__name__ == "SparseMoeMLP" for layer in layers]
    assert sparse == [i not in options.get("mlp_only_layers", []) for i in range(3)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if num_blocks:
        assert llm.stats().figures["preemptions"] > 0, "the pool was meant to preempt"
    again = llm.hf_model()  # the stacked experts and the kept norms under transformers' names: the same function
    assert sorted(again.state_dict()) == sorted(hf_model.state_dict())
    ids = torch.tensor([prompts[-1]])
    assert torch.allclose(again(ids).logits, hf_model(ids).logits, atol=1e-4)


def test_shared_prefixes_samples_and_cascade_stay_token_exact(tmp_path):
    """The engine's sharing paths with sparse layers: prompts sharing a 40-token head (the prefix cache's hits
    on the second pass, cascade attention on), n = 2 greedy samples of each (forked blocks, read once a
    group), every sample equal to transformers' greedy output."""
    from engine.stats import steps_table

    path, hf_model = moe_checkpoint(tmp_path / "moe")
    generator = torch.Generator().manual_seed(11)
    head = torch.randint(0, 256, (40,), generator=generator).tolist()
    prompts = [head + torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 9, 1)]
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=4, cascade_attention="on")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))] == expected
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, n=2))
    assert [[sample.token_ids for sample in o.outputs] for o in outputs] == [[e, e] for e in expected]
    assert llm.stats().figures["prefix_cache_hit_tokens"] > 0
    assert max(steps_table(llm.engine.stats.steps).column("cascade_rows").to_pylist()) > 0


def test_a_block_scaled_fp8_moe_checkpoint_matches_transformers_on_its_weights(tmp_path, prompts):
    """Qwen's FP8 format for a MoE checkpoint (Qwen3-30B-A3B-FP8's): every projection, the experts' per-expert
    ones included, in e4m3 with weight_scale_inv per block, the router kept. Greedy float32 tokens equal
    transformers' on the dequantized weights, which differ from the original's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from test_fp8_weights import BLOCK, QWEN_FP8, block_dequantized, block_quantized
    from transformers import Qwen3MoeForCausalLM

    base, original = moe_checkpoint(tmp_path / "moe")
    fp8, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    for directory in (fp8, dequantized):
        shutil.copytree(base, directory)
    state = load_file(base / "model.safetensors")
    quantized, rounded = dict(state), dict(state)
    for name in [k for k in state if k.endswith("_proj.weight")]:
        q, scale = block_quantized(state[name], *BLOCK)
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
        rounded[name] = block_dequantized(q, scale, *BLOCK)
    save_file(quantized, fp8 / "model.safetensors")
    save_file(rounded, dequantized / "model.safetensors")
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": QWEN_FP8}))
    expected, gap = reference_outputs(Qwen3MoeForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval(),
                                      prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    assert expected != reference_outputs(original, prompts)[0], "FP8 rounding changed no token: a weak oracle"
    llm = LLM(model=str(fp8), dtype="float32", max_model_len=128, device="cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))] == expected


def float64_moe(x, logits, gate_up, down, top_k, renormalize):
    """Token by token, expert by expert, in float64."""
    x, logits, gate_up, down = x.double(), logits.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], dim=0)
        weights, ids = probs.topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            gate, up = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.fixture
def poisoned_empty(monkeypatch):
    """NaN in every float tensor torch.empty makes, so that a row of the op's buffers nobody wrote shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("tokens, top_k, renormalize", [(1, 2, True), (37, 2, True), (37, 1, False), (12, 8, True),
                                                        (300, 2, True)])
def test_moe_ops_match_a_float64_loop(backend, tokens, top_k, renormalize, poisoned_empty):
    """Both backends (Triton's in its interpreter on the CPU): one token, uneven routing (expert 2 favoured),
    an expert no token picks, top-k 1, 2 and 8, and more pairs than one block of each expert holds."""
    generator = torch.Generator().manual_seed(tokens * 10 + top_k)
    num_experts, hidden, inter = 8, 32, 24
    x = torch.randn(tokens, hidden, generator=generator)
    router = torch.randn(num_experts, hidden, generator=generator)
    router[2] *= 3  # uneven: expert 2 picked more often
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / 4
    down = torch.randn(num_experts, hidden, inter, generator=generator) / 4
    logits = x @ router.T
    logits[:, 5] -= 100  # an expert no token picks (top_k < 8)
    weights, ids = ops.moe_route(logits, top_k, renormalize)
    assert ids.shape == (tokens, top_k) and (top_k == 8 or not (ids == 5).any())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = ops.moe_experts(*(t.to(device) for t in (x, gate_up, down, weights, ids)), backend=backend).cpu()
    assert torch.allclose(out.double(), float64_moe(x, logits, gate_up, down, top_k, renormalize), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens, num_experts, top_k, renormalize, dtype", [
    (1, 8, 2, True, torch.float32), (37, 8, 1, False, torch.float32), (37, 8, 8, True, torch.float32),
    (300, 128, 8, True, torch.bfloat16), (20, 60, 4, False, torch.float32)])
def test_the_routing_kernel_takes_a_float64_softmax_top_k(tokens, num_experts, top_k, renormalize, dtype,
                                                          poisoned_empty):
    """ops/moe.py moe_route (Triton's interpreter on the CPU) against the softmax in float64 and its top k
    picked by a stable sort: an exact tie in every row (the lower id first), a row one expert saturates, 60
    experts (no power of two), all 8 of 8, bfloat16 logits (the router's dtype), more rows than one program."""
    generator = torch.Generator().manual_seed(tokens + num_experts + top_k)
    logits = (torch.randn(tokens, num_experts, generator=generator) * 2).to(dtype)
    logits[:, 3] = logits[:, 1]
    logits[0, 5] = 40.0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights, ids = ops.moe_route(logits.to(device), top_k, renormalize, backend="triton")
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = torch.sort(-probs, dim=-1, stable=True).indices[:, :top_k]
    expected = probs.gather(1, expected_ids)
    if renormalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), expected_ids)
    assert torch.allclose(weights.cpu().double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("block_m, gate_up_tiles, down_tiles", [
    (32, Tiles(block_n=16, block_k=16), Tiles(block_n=16, block_k=16)),  # tiles narrower than the matrices
    (64, Tiles(block_n=128, block_k=128, num_warps=8, num_stages=3), Tiles(block_n=32, block_k=64)),  # wider
    # the grouped program order: groups of 2 and of 3 row blocks (the last group short), 1D grids
    (16, Tiles(block_n=16, block_k=16, group_m=2), Tiles(block_n=16, block_k=32, group_m=3)),
])
def test_the_experts_tiles_change_nothing_but_speed(block_m, gate_up_tiles, down_tiles, poisoned_empty):
    """The Triton experts with other tiles than the defaults, against the float64 loop: 37 tokens, top-2 of 8."""
    generator = torch.Generator().manual_seed(5)
    num_experts, hidden, inter, tokens, top_k = 8, 48, 40, 37, 2
    x = torch.randn(tokens, hidden, generator=generator)
    logits = torch.randn(tokens, num_experts, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / 4
    down = torch.randn(num_experts, hidden, inter, generator=generator) / 4
    weights, ids = ops.moe_route(logits, top_k, True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = moe_experts(*(t.to(device) for t in (x, gate_up, down, weights, ids)), block_m=block_m,
                      gate_up_tiles=gate_up_tiles, down_tiles=down_tiles).cpu()
    assert torch.allclose(out.double(), float64_moe(x, logits, gate_up, down, top_k, True), rtol=1e-4, atol=1e-5)


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    """write(launches, num_experts, hidden, inter, device): launches as the tuned table of that float32 shape
    (benchmarks/moe_op.py --save's format), where ops.moe reads its tables for the test."""
    import json

    from ops import moe
    monkeypatch.setattr(moe, "TUNED_DIR", tmp_path)

    def write(launches: dict, num_experts: int, hidden: int, inter: int, device) -> None:
        key = moe.tuned_key(num_experts, inter, hidden, torch.float32, device)
        (tmp_path / f"{key}.json").write_text(json.dumps({str(t): launch.to_json() for t, launch in launches.items()}))
        moe._tuned_table.cache_clear()
    yield write
    moe._tuned_table.cache_clear()


def test_the_tuned_table_gives_the_launch_of_the_nearest_swept_token_count(tuned_table, monkeypatch, poisoned_empty):
    """ops.moe.moe_launch against a table written by hand: the nearest swept T (the smaller on a tie),
    DEFAULT_LAUNCH for a shape without a table; the op runs the launch it picks and still matches the
    float64 loop."""
    from ops import moe

    launches = {1: moe.Launch(16, Tiles(16, 16), Tiles(32, 16)), 64: moe.Launch(32, Tiles(32, 32), Tiles(16, 16)),
                4096: moe.Launch(64, Tiles(64, 64, 8, 3), Tiles(32, 64))}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_experts, hidden, inter = 8, 48, 40
    tuned_table(launches, num_experts, hidden, inter, device)
    picked = {t: moe.moe_launch(t, num_experts, inter, hidden, torch.float32, device) for t in (1, 20, 33, 32, 3000)}
    assert picked == {1: launches[1], 20: launches[1], 33: launches[64], 32: launches[1], 3000: launches[4096]}
    assert moe.moe_launch(5, num_experts, inter, 2 * hidden, torch.float32, device) == moe.DEFAULT_LAUNCH
    calls = []
    monkeypatch.setattr(moe, "sorted_pairs", lambda ids, e, block_m: calls.append(block_m) or
                        moe_sorted_pairs(ids, e, block_m))
    generator = torch.Generator().manual_seed(8)
    tokens, top_k = 40, 2
    x = torch.randn(tokens, hidden, generator=generator)
    logits = torch.randn(tokens, num_experts, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / 4
    down = torch.randn(num_experts, hidden, inter, generator=generator) / 4
    weights, ids = ops.moe_route(logits, top_k, True)
    out = moe.moe_experts(*(t.to(device) for t in (x, gate_up, down, weights, ids))).cpu()
    assert calls == [32]  # T = 40: the launch swept at 64
    assert torch.allclose(out.double(), float64_moe(x, logits, gate_up, down, top_k, True), rtol=1e-4, atol=1e-5)


def test_compile_launches_runs_each_launch_up_to_the_budget_once(tuned_table, monkeypatch, poisoned_empty):
    """ops.moe.compile_launches against a table written by hand: one run at the smallest token count of each
    distinct launch up to max_tokens (the counts and the launches picked by hand), each token's experts
    distinct and every expert routed to; the engine's model compiles through its first sparse layer."""
    from ops import moe

    a, b, c = moe.Launch(16, Tiles(16, 16), Tiles(16, 16)), moe.Launch(32, Tiles(32, 16), Tiles(16, 32)), \
        moe.Launch(64, Tiles(16, 32), Tiles(32, 16))
    launches = {1: a, 4: a, 16: b, 48: c, 64: b, 4096: c}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_experts, hidden, inter, top_k = 8, 48, 40, 2
    tuned_table(launches, num_experts, hidden, inter, device)
    runs = []
    monkeypatch.setattr(moe, "sorted_pairs", lambda ids, e, block_m: runs.append((ids.cpu(), block_m)) or
                        moe_sorted_pairs(ids, e, block_m))
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=device)
    down = torch.randn(num_experts, hidden, inter, device=device)
    assert moe.compile_launches(gate_up, down, top_k, max_tokens=50) == 3
    assert [(ids.shape[0], block_m) for ids, block_m in runs] == [(1, 16), (16, 32), (48, 64)]
    for ids, _ in runs:
        assert all(len(set(row)) == top_k for row in ids.tolist())
        assert ids.shape[0] * top_k < num_experts or set(ids.flatten().tolist()) == set(range(num_experts))
    assert ops.moe_compile_launches(gate_up.cpu(), down.cpu(), top_k, 50, backend="torch") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter compiles nothing; only the GPU has variants")
def test_no_experts_kernel_compiles_after_compile_launches(tuned_table, poisoned_empty):
    """After compile_launches, token counts of every divisibility (T, T * k, the row blocks) reuse the compiled
    kernels: a compilation inside a run stalls its step."""
    import triton

    from ops import moe
    launches = {1: moe.Launch(16, Tiles(16, 16), Tiles(16, 16)), 64: moe.Launch(32, Tiles(32, 32), Tiles(32, 32))}
    num_experts, hidden, inter, top_k = 8, 48, 40, 2
    tuned_table(launches, num_experts, hidden, inter, torch.device("cuda"))

    def variants() -> int:
        kernels = [k for k in vars(moe).values() if isinstance(k, triton.JITFunction)]
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda")
    down = torch.randn(num_experts, hidden, inter, device="cuda")
    moe.compile_launches(gate_up, down, top_k, max_tokens=100)
    # routed first: the routing is an op of its own (it compiles at the engine's trial step), not counted here
    routed = [(torch.randn(tokens, hidden, device="cuda"),
               *ops.moe_route(torch.randn(tokens, num_experts, device="cuda"), top_k, True))
              for tokens in (2, 3, 8, 16, 17, 31, 32, 50, 64, 96, 100)]
    before = variants()
    for x, weights, ids in routed:
        moe.moe_experts(x, gate_up, down, weights, ids)
    assert variants() == before


@pytest.mark.parametrize("tokens, top_k, num_experts, block_m",
                         [(1, 8, 128, 16), (256, 8, 128, 16), (300, 4, 8, 16), (700, 2, 8, 64), (1100, 2, 8, 16)])
def test_sorted_pairs_lay_out_every_pair_once_in_its_experts_run(tokens, top_k, num_experts, block_m):
    """ops/moe.py's layout, by hand: each expert's pairs fill a run of whole blocks of its own, runs in expert
    order, every pair exactly once, the rest -1; blocks past the last run have expert -1. Uneven routing (expert
    1 favoured), an expert no token picks; up to ONE_PROGRAM_PAIRS in one program (256 x 8 at its bound), above
    it in three kernels of several programs each (1,100 x 2)."""
    from ops.moe import sorted_pairs

    generator = torch.Generator().manual_seed(tokens)
    scores = torch.rand(tokens, num_experts, generator=generator)
    scores[:, 1] += 0.5
    scores[:, 3] = -1  # never picked (top_k < num_experts)
    ids = scores.topk(top_k, dim=-1).indices
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pair_of_row, expert_of_block = (t.cpu() for t in sorted_pairs(ids.to(device), num_experts, block_m))
    rows = -(-(tokens * top_k + num_experts * (block_m - 1)) // block_m) * block_m
    assert pair_of_row.shape == (rows,) and expert_of_block.shape == (rows // block_m,)
    flat, row = ids.reshape(-1).tolist(), 0
    for expert in range(num_experts):
        mine = sorted(i for i, e in enumerate(flat) if e == expert)
        blocks = -(-len(mine) // block_m)
        run = pair_of_row[row:row + blocks * block_m].tolist()
        assert sorted(p for p in run if p >= 0) == mine and run.count(-1) == blocks * block_m - len(mine)
        assert expert_of_block[row // block_m:row // block_m + blocks].tolist() == [expert] * blocks
        row += blocks * block_m
    assert set(pair_of_row[row:].tolist()) <= {-1} and set(expert_of_block[row // block_m:].tolist()) <= {-1}


def test_impossible_expert_counts_are_named(tmp_path):
    import json

    from engine.errors import ConfigError

    path, _ = moe_checkpoint(tmp_path / "moe")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ConfigError, match=r"config.json: a mixture of experts needs 1 <= num_experts_per_tok <= "
                                          r"num_experts, .* got 9, 8, 48 and 1"):
        LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_greedy_matches_transformers_with_and_without_graphs(tmp_path, prompts):
    """On the GPU, through the Triton experts: float32 token-exact with transformers, eager and with decode
    and piecewise graphs (whose captured batches carry padded rows); bfloat16 with graphs draws what it
    draws eagerly."""
    path, hf_model = moe_checkpoint(tmp_path / "moe")
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    params = SamplingParams(max_tokens=MAX_TOKENS)
    runs = {}
    for dtype, eager in (("float32", True), ("float32", False), ("bfloat16", True), ("bfloat16", False)):
        llm = LLM(model=str(path), dtype=dtype, max_model_len=128, device="cuda", enforce_eager=eager)
        runs[dtype, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.close()
    assert runs["float32", True] == expected and runs["float32", False] == expected
    assert runs["bfloat16", False] == runs["bfloat16", True]


def test_random_weights_of_a_moe_shape_run_as_their_transformers_model(prompts):
    """model.architecture=Qwen3MoeForCausalLM with the expert keys (the qwen3-30b-a3b config's, made small):
    greedy tokens equal those of transformers' model built from the engine's weights (to_hf_model)."""
    llm = LLM(model="tiny", device="cpu", max_model_len=128, architecture="Qwen3MoeForCausalLM", num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0], initializer_range=0.2)
    assert [type(layer.mlp).__name__ for layer in llm.engine.model.model.layers] == ["DecoderMLP", "SparseMoeMLP"]
    expected, gap = reference_outputs(llm.hf_model(), prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_the_floor_counts_the_experts_a_token_reads(make_config):
    """weight_footprint by hand for a 2-layer MoE (hidden 64, 4 query and 2 KV heads of 16, 4 experts of 32,
    2 a token, tied head of 257 x 64): per layer q and o 64 x 64, k and v 64 x 32, QK-norms 2 x 16, the two
    norms 2 x 64, the router 4 x 64, and 2 of the 4 experts' 3 x 64 x 32; the final norm 64; float32. One
    expert of both layers: 2 x 3 x 64 x 32 parameters."""
    from engine.models.decoder import WeightFootprint
    from engine.models.loader import build_model

    cfg = make_config("model.architecture=Qwen3MoeForCausalLM", "model.num_experts=4", "model.num_experts_per_tok=2",
                      "model.moe_intermediate_size=32")
    model, _ = build_model(cfg.model, torch.device("cpu"), torch.float32)
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 2 * 64 + 4 * 64 + 2 * 3 * 64 * 32
    nonembed = 2 * layer + 64
    assert model.weight_footprint() == WeightFootprint(nonembed_params=nonembed, lm_head_params=257 * 64,
                                                       bytes_per_step=(nonembed + 257 * 64) * 4,
                                                       expert_bytes=2 * 3 * 64 * 32 * 4, num_experts=4,
                                                       experts_per_token=2)

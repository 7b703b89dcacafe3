"""The forward of steps with prompt chunks cut at its attention calls (engine/cuda_graphs.PiecewiseGraphs):
the pieces, padded to a bucket of tokens, give the plain forward's hidden states and cache writes; in
the engine, greedy float32 generation stays token-exact with transformers. On the CPU the pieces run
eagerly; on CUDA they are graphs."""
import copy

import pytest
import torch

from engine.block_manager import KVBlockManager
from engine.cuda_graphs import PiecewiseGraphs, token_buckets
from engine.engine import LLMEngine, piecewise_graphs_on
from engine.kv_cache import PagedKVCache
from engine.models.loader import build_model
from engine.sequence import SamplingParams
from engine.stats import steps_table
from test_cascade_engine import interleaved_prefix_prompts  # noqa: F401  (a fixture)
from test_mixed_step import BLOCK, metadata, positions_of
from test_oracle import MAX_TOKENS, reference_outputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_token_buckets():
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16384)[3:6] == [128, 256, 512] and token_buckets(16384)[-2:] == [16128, 16384]
    assert len(token_buckets(16384)) == 4 + 16384 // 256
    # 65,536 / 64 = 1,024: powers of two up to 512, then multiples of 1,024
    assert token_buckets(65536)[:8] == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(65536)[-1] == 65536 and len(token_buckets(65536)) == 6 + 63 + 1


def test_piecewise_default_follows_the_device(make_config):
    """Unset: on for CUDA, off for the CPU (eager pieces would only pad its steps); set: as set;
    enforce_eager: off."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    unset = make_config().model
    assert piecewise_graphs_on(unset, cuda) and not piecewise_graphs_on(unset, cpu)
    assert piecewise_graphs_on(make_config("model.piecewise_graphs=true").model, cpu)
    assert not piecewise_graphs_on(make_config("model.piecewise_graphs=false").model, cuda)
    assert not piecewise_graphs_on(make_config("model.piecewise_graphs=true", "model.enforce_eager=true").model, cuda)


def step_inputs(manager, tokens, seq_ids, counts, num_decode):
    """input_ids, positions and metadata of a step that appends counts[i] tokens to each sequence."""
    starts = [manager.state(s).sequence_length for s in seq_ids]
    slots = manager.slot_mapping_for_append(seq_ids, counts)
    ids = torch.cat([torch.tensor(tokens[s][a:a + n]) for s, a, n in zip(seq_ids, starts, counts)])
    meta = metadata(manager, seq_ids, starts, counts, slots, num_decode)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    meta.slot_mapping, meta.block_tables, meta.seq_lens = to(meta.slot_mapping), to(meta.block_tables), to(meta.seq_lens)
    if meta.prefill is not None:
        p = meta.prefill
        p.block_tables, p.seq_lens, p.cu_seqlens_q = to(p.block_tables), to(p.seq_lens), to(p.cu_seqlens_q)
    return to(ids), to(positions_of(starts, counts)), meta


@pytest.mark.usefixtures("one_thread")
def test_pieces_equal_the_forward(make_config):
    """Steps of 14 tokens (bucket 16: two padding rows), 32 (a bucket exactly) and 20 (bucket 32, after a
    larger step left its rows in the shared buffers): hidden states and caches as the plain forward's."""
    cfg = make_config(f"model.device={DEVICE.type}", "model.dtype=float32", "model.max_model_len=64")
    model, _ = build_model(cfg.model, DEVICE, torch.float32)
    generator = torch.Generator().manual_seed(4)
    tokens = {s: torch.randint(0, 256, (60,), generator=generator).tolist() for s in range(6)}
    manager = KVBlockManager(96, BLOCK, enable_prefix_caching=False)
    cache = PagedKVCache(model.kv_cache_spec, 96, BLOCK, torch.float32, DEVICE)
    pieces = PiecewiseGraphs(model, cache, 48, DEVICE, capture=DEVICE.type == "cuda")
    for s in range(6):
        manager.create_sequence(s)
    plain_manager, plain_cache = copy.deepcopy(manager), copy.deepcopy(cache)
    steps = [([0, 1, 2], [5, 7, 2], 0), ([0, 1, 2, 3, 4], [1, 1, 9, 12, 9], 2), ([0, 1, 2, 3, 5], [1, 1, 1, 6, 11], 3)]
    with torch.inference_mode():
        for seq_ids, counts, num_decode in steps:
            ids, positions, meta = step_inputs(manager, tokens, seq_ids, counts, num_decode)
            got = pieces.run(ids, positions, meta).clone()
            ids, positions, meta = step_inputs(plain_manager, tokens, seq_ids, counts, num_decode)
            want = model(ids, positions, plain_cache, meta)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for got_cache, want_cache in ((cache.key_caches, plain_cache.key_caches),
                                          (cache.value_caches, plain_cache.value_caches)):
                for layer in range(len(got_cache)):  # padding rows write nothing (slot -1)
                    torch.testing.assert_close(got_cache[layer], want_cache[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("one_thread")
def test_greedy_matches_transformers_with_pieces(make_config, qwen3_checkpoint):
    """Prompts longer than the token budget, so most steps carry chunks beside decodes."""
    path, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (70, 5, 33, 90, 17)]
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    engine = LLMEngine(make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto",
                                   "model.dtype=float32", "model.piecewise_graphs=true", "cache.num_blocks=64",
                                   "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=40"))
    assert engine.runner.pieces is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    assert len(list(engine.run())) == len(prompts)
    assert [s.output_token_ids for s in seqs] == expected
    phases = steps_table(engine.stats.steps).column("phase").to_pylist()
    assert phases.count("mixed") >= 3


@pytest.mark.usefixtures("one_thread")
def test_pieces_with_cascade_groups(make_config, qwen3_checkpoint, interleaved_prefix_prompts):
    """Shared-prefix prompts with cascade attention on: mixed steps whose decode rows form groups attend
    between the pieces as in an eager step; greedy outputs stay transformers'."""
    path, _ = qwen3_checkpoint
    prompts, expected = interleaved_prefix_prompts
    engine = LLMEngine(make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto",
                                   "model.dtype=float32", "model.piecewise_graphs=true", "cache.block_size=16",
                                   "cache.cascade_attention=on", "cache.num_blocks=64", "scheduler.max_num_seqs=8",
                                   "scheduler.max_num_batched_tokens=16"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    assert len(list(engine.run())) == len(prompts)
    assert [s.output_token_ids for s in seqs] == expected
    steps = steps_table(engine.stats.steps).to_pylist()
    assert any(r["phase"] == "mixed" and r["cascade_rows"] > 0 for r in steps)

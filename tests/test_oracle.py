"""The engine's greedy outputs against transformers' own Qwen3 on the same checkpoint, in float32."""
import pytest
import torch

from engine.engine import LLMEngine
from engine.sequence import SamplingParams

PROMPT_LENGTHS = (1, 3, 4, 5, 17, 40, 63)
MAX_TOKENS = 24


def reference_outputs(hf_model, prompts):
    """transformers' greedy generate, one prompt at a time (no padding), with its logit margins."""
    outputs, smallest_gap = [], float("inf")
    for prompt in prompts:
        result = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )
        outputs.append(result.sequences[0, len(prompt):].tolist())
        for scores in result.scores:
            top2 = scores[0].float().topk(2).values
            smallest_gap = min(smallest_gap, (top2[0] - top2[1]).item())
    return outputs, smallest_gap


@pytest.fixture(scope="module")
def prompts_and_reference(qwen3_checkpoint):
    _, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    outputs, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    return prompts, outputs


def engine_outputs(config, prompts):
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    finished = list(engine.run())
    assert len(finished) == len(prompts)
    assert engine.block_manager.num_used_blocks == 0
    return [s.output_token_ids for s in seqs], engine


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers(make_config, qwen3_checkpoint, prompts_and_reference, block_size):
    path, _ = qwen3_checkpoint
    prompts, expected = prompts_and_reference
    config = make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto",
                         "model.dtype=float32", f"cache.block_size={block_size}")
    outputs, _ = engine_outputs(config, prompts)
    assert outputs == expected


def test_greedy_matches_transformers_with_queueing_chunking_and_preemption(
    make_config, qwen3_checkpoint, prompts_and_reference
):
    path, _ = qwen3_checkpoint
    prompts, expected = prompts_and_reference
    config = make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto",
                         "model.dtype=float32", "cache.block_size=4", "cache.num_blocks=24", "model.max_model_len=96",
                         "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=16",
                         "scheduler.admission_headroom=0", "cache.check_invariants=true")
    outputs, engine = engine_outputs(config, prompts)
    steps = engine.stats.steps
    assert sum(s.preemptions for s in steps) > 0, "the pool was meant to force preemption"
    assert max(s.waiting_seqs for s in steps) > 0 and max(s.tokens for s in steps) <= 16
    assert outputs == expected


@pytest.fixture(scope="module")
def shared_prefix_prompts_and_reference(qwen3_checkpoint):
    """Prompts built from two shared heads (one of them also sent twice whole), with transformers' outputs."""
    _, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(11)
    draw = lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()  # noqa: E731
    head_a, head_b = draw(23), draw(9)
    prompts = [head_a + draw(n) for n in (1, 6, 17, 30)] + [head_b + draw(n) for n in (3, 12)] + [head_a, head_a]
    outputs, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    return prompts, outputs


@pytest.mark.parametrize("block_size, num_blocks", [(1, 96), (4, 24), (16, 6)])
def test_greedy_matches_transformers_with_prefix_caching_eviction_and_preemption(
    make_config, qwen3_checkpoint, shared_prefix_prompts_and_reference, block_size, num_blocks
):
    path, _ = qwen3_checkpoint
    prompts, expected = shared_prefix_prompts_and_reference
    config = make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto",
                         "model.dtype=float32", f"cache.block_size={block_size}", f"cache.num_blocks={num_blocks}",
                         f"model.max_model_len={block_size * num_blocks}",
                         "scheduler.max_num_seqs=3", "scheduler.max_num_batched_tokens=24",
                         "scheduler.admission_headroom=0", "cache.check_invariants=true",
                         "cache.enable_prefix_caching=true")
    engine = LLMEngine(config)
    manager, evictions = engine.block_manager, []
    allocate = manager.allocate_block

    def counting_allocate():
        evictions.append(not manager.free_blocks and manager.num_cached_blocks > 0)
        return allocate()

    manager.allocate_block = counting_allocate
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    assert len(list(engine.run())) == len(prompts)
    steps = engine.stats.steps
    assert sum(s.prefix_cache_hit_tokens for s in steps) > 0, "shared prefixes were meant to hit the cache"
    assert sum(s.preemptions for s in steps) > 0, "the pool was meant to force preemption"
    assert any(evictions), "the pool was meant to force eviction of cached blocks"
    assert [s.output_token_ids for s in seqs] == expected
    assert manager.num_used_blocks == 0 and manager.invariants_ok()

"""Cascade attention in the engine: greedy float32 generation on prompts that share long prefixes stays
token-exact with transformers, with the path taken (steps.parquet's cascade_rows) or, with off, not."""
import pytest
import torch

from engine.engine import LLMEngine
from engine.errors import ConfigError
from engine.sequence import SamplingParams
from engine.stats import steps_table
from jobs.config import validate
from test_oracle import MAX_TOKENS, reference_outputs


@pytest.fixture(scope="module")
def interleaved_prefix_prompts(qwen3_checkpoint):
    """Prompts from two heads of several 16-token blocks, submitted interleaved (so only the scheduler's
    ordering makes sharers adjacent), with transformers' greedy outputs."""
    _, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(5)
    draw = lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()  # noqa: E731
    head_a, head_b = draw(50), draw(37)
    prompts = [head_a + draw(3), head_b + draw(8), head_a + draw(20), head_b + draw(1), head_a + draw(11), head_a]
    outputs, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    return prompts, outputs


@pytest.mark.parametrize("mode, block_size", [("on", 1), ("on", 16), ("off", 16)])
def test_greedy_matches_transformers_with_cascade(make_config, qwen3_checkpoint, interleaved_prefix_prompts,
                                                   mode, block_size):
    path, _ = qwen3_checkpoint
    prompts, expected = interleaved_prefix_prompts
    config = make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto", "model.dtype=float32",
                         f"cache.block_size={block_size}", f"cache.cascade_attention={mode}",
                         f"cache.num_blocks={len(prompts) * 128 // block_size}",  # on CUDA: not the whole device
                         "scheduler.max_num_seqs=8", "cache.check_invariants=true")
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    assert len(list(engine.run())) == len(prompts)
    assert [s.output_token_ids for s in seqs] == expected
    cascade_rows = steps_table(engine.stats.steps).column("cascade_rows").to_pylist()
    if mode == "off":
        assert sum(cascade_rows) == 0
    else:  # both heads' groups while all six decode: 4 + 2 rows
        assert max(cascade_rows) == len(prompts)


def test_bad_mode_names_the_key_and_the_choices(make_config):
    with pytest.raises(ConfigError, match=r"cache\.cascade_attention must be one of auto, on, off, got 'sometimes'"):
        validate(make_config("cache.cascade_attention=sometimes", "job=generate"))


@pytest.mark.parametrize("block_size", [1, 4])
def test_n_samples_take_the_grouped_path_and_stay_greedy_exact(make_config, qwen3_checkpoint, block_size):
    """n = 4 greedy samples of each of three prompts: each prompt's samples share its blocks (forked), so
    their decode rows form a group of 4 that reads the prompt once; every sample equals transformers'
    greedy output."""
    path, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (9, 22, 14)]
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    config = make_config(f"model.path={path}", "model.max_model_len=128", "model.device=auto", "model.dtype=float32",
                         f"cache.block_size={block_size}", "cache.cascade_attention=on",
                         f"cache.num_blocks={12 * 128 // block_size}", "scheduler.max_num_seqs=16",
                         "cache.check_invariants=true")
    engine = LLMEngine(config)
    firsts = [engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=4))
              for i, p in enumerate(prompts)]
    finished = list(engine.run())
    assert len(finished) == 12
    for first, tokens in zip(firsts, expected):
        samples = [s for s in finished if s.request_id == first.request_id]
        assert [s.output_token_ids for s in samples] == [tokens] * 4
    assert max(steps_table(engine.stats.steps).column("cascade_rows").to_pylist()) == 12

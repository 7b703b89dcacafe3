"""Prefix-cache hits of a small trace through the engine, counted by hand."""
import pytest

from engine.engine import LLMEngine
from engine.sequence import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine_for(make_config, caching: bool) -> LLMEngine:
    return LLMEngine(make_config("model.device=cpu", "cache.block_size=4", "cache.num_blocks=64", "model.max_model_len=256",
                                 f"cache.enable_prefix_caching={str(caching).lower()}", "cache.check_invariants=true"))


def run_one(engine, request_id, prompt):
    seq = engine.add_request(request_id, prompt, PARAMS)
    list(engine.run())
    return seq


def test_hit_counts_of_a_trace_worked_out_by_hand(make_config):
    engine = engine_for(make_config, caching=True)
    p = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111]
    # r1: 10 prompt tokens, nothing cached: 0 hits. It stores 10 + 5 fed outputs = 15 tokens (its last output
    # is never fed back); blocks [0-3], [4-7] (prompt) and [8-11] (p8, p9, out0, out1) are full and hashed.
    r1 = run_one(engine, "r1", p)
    out = r1.output_token_ids
    trace = [
        ("r2", p[:8] + [1, 2, 3], 8),  # 11 tokens: blocks 0 and 1 hit; block 2 would hold its own tokens
        ("r3", p + out[:2] + [5, 6], 12),  # 14 tokens: blocks 0, 1 and r1's block 2 (with its outputs) hit
        ("r4", p[:8], 4),  # 8 tokens: its last token must be computed, so only block 0 (of 2 full) may hit
        ("r5", [12] + p[1:], 0),  # another first token: another chain of hashes, no hit
    ]
    for request_id, prompt, _ in trace:
        run_one(engine, request_id, prompt)
    admissions = [s for s in engine.stats.steps if s.admitted_tokens]
    assert [s.prefix_cache_hit_tokens for s in admissions] == [0] + [hits for _, _, hits in trace]
    assert [s.admitted_tokens for s in admissions] == [10, 11, 14, 8, 10]
    summary = engine.stats.summary(engine.num_blocks, engine.block_size, engine.max_model_len)
    assert summary["prefix_cache_hit_tokens"] == 24
    assert summary["prefix_cache_hit_rate"] == pytest.approx(24 / 53)


def test_hits_change_no_output_and_caching_off_hits_nothing(make_config):
    prompts = [[7] * 9 + [1, 2], [7] * 9 + [3], [7] * 9 + [1, 2]]
    outputs = {}
    for caching in (True, False):
        engine = engine_for(make_config, caching)
        outputs[caching] = [run_one(engine, str(i), p).output_token_ids for i, p in enumerate(prompts)]
        hits = sum(s.prefix_cache_hit_tokens for s in engine.stats.steps)
        assert hits == (8 + 8 if caching else 0)  # the later two share two full blocks of 7s with the first
    assert outputs[True] == outputs[False]

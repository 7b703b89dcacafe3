"""Memory pressure: a pool so small that the scheduler preempts all the time gives the same greedy outputs
as a roomy pool, keeps the block manager's invariants after every step, and leaks no block."""
import random

import pytest

from engine.engine import LLMEngine
from engine.sequence import SamplingParams

MAX_MODEL_LEN, BLOCK_SIZE = 48, 4


def requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(1, 24))],
             SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=rng.random() < 0.8)) for _ in range(n)]


def run_all(engine: LLMEngine, reqs) -> dict:
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(i, prompt, params)
    outputs = {}
    for seq in engine.run():
        assert seq.request_id not in outputs
        outputs[seq.request_id] = (seq.output_token_ids, seq.finish_reason)
    return outputs


def test_a_starved_pool_gives_the_outputs_of_a_roomy_one(make_config, one_thread):
    reqs = requests(60)
    base = ("model.device=cpu", f"model.max_model_len={MAX_MODEL_LEN}", f"cache.block_size={BLOCK_SIZE}",
            "cache.check_invariants=true")
    roomy = LLMEngine(make_config(*base, "scheduler.max_num_seqs=64"))
    expected = run_all(roomy, reqs)
    assert sum(s.preemptions for s in roomy.stats.steps) == 0

    # 12 blocks: exactly one sequence of max_model_len; a small token budget chunks the prefills too
    starved = LLMEngine(make_config(*base, f"cache.num_blocks={MAX_MODEL_LEN // BLOCK_SIZE}",
                                    "scheduler.max_num_seqs=16", "scheduler.max_num_batched_tokens=16",
                                    "scheduler.admission_headroom=0"))  # admissions that fill it
    outputs = run_all(starved, reqs)
    preemptions = sum(s.preemptions for s in starved.stats.steps)
    assert preemptions >= len(reqs) // 2, f"only {preemptions} preemptions: the pool was meant to be starved"
    assert max(s.blocks_used for s in starved.stats.steps) == starved.num_blocks
    assert outputs == expected
    for engine in (roomy, starved):  # nothing leaked: every block is free, no sequence is left
        manager = engine.block_manager
        assert manager.num_used_blocks == 0 and not manager.sequences
        assert manager.invariants_ok() and not engine.scheduler.has_work()


def test_broken_invariants_stop_the_engine(make_config, one_thread):
    engine = LLMEngine(make_config("model.device=cpu", "cache.check_invariants=true"))
    engine.add_request(0, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.block_manager.free_blocks.append(engine.block_manager.sequences[0].block_table[0])  # a block twice
    with pytest.raises(AssertionError, match="invariants broken after step 1"):
        engine.step()

"""Soak: thousands of short requests of random lengths stream through a small pool on the tiny model, with
the block manager's invariants checked after every step: every request finishes exactly once, no block and
no sequence object is left behind, and memory stays flat (no timing assertions)."""
import gc
import random
import weakref

import pytest

from engine.engine import LLMEngine
from engine.sequence import SamplingParams

NUM_REQUESTS = 3000


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_soak(make_config, one_thread):
    engine = LLMEngine(make_config("model.device=cpu", "model.max_model_len=32", "cache.block_size=4",
                                   "cache.num_blocks=24", "scheduler.max_num_seqs=16", "scheduler.admission_headroom=0",
                                   "scheduler.max_num_batched_tokens=48", "cache.check_invariants=true"))
    rng = random.Random(0)
    live = weakref.WeakSet()  # every Sequence the engine holds: it must let go of each once finished
    finished: dict[int, int] = {}
    rss, next_id = {}, 0
    checkpoints = {NUM_REQUESTS // 10: "warm", NUM_REQUESTS // 2: "half", NUM_REQUESTS: "end"}
    while next_id < NUM_REQUESTS or engine.scheduler.has_work():
        # keep a short queue, as a job streaming a big input would: admission, preemption and finishing interleave
        while next_id < NUM_REQUESTS and len(engine.scheduler.waiting) < 32:
            params = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=rng.random() < 0.5,
                                    temperature=rng.choice([0.0, 0.8]), seed=next_id)
            live.add(engine.add_request(next_id, [rng.randrange(256) for _ in range(rng.randint(1, 18))], params))
            next_id += 1
        for seq in engine.step():
            assert seq.request_id not in finished, f"request {seq.request_id} finished twice"
            assert 1 <= len(seq.output_token_ids) <= seq.sampling.max_tokens and seq.finish_reason in ("stop", "length")
            finished[seq.request_id] = len(seq.output_token_ids)
        due = [name for at, name in checkpoints.items() if len(finished) >= at and name not in rss]
        if due:
            gc.collect()
            rss[due[0]] = rss_bytes()
            assert len(live) <= engine.scheduler.max_num_seqs + len(engine.scheduler.waiting)

    assert sorted(finished) == list(range(NUM_REQUESTS))  # nothing lost, nothing twice
    manager, steps = engine.block_manager, engine.stats.steps
    assert manager.num_free_blocks == 24 and not manager.sequences and manager.invariants_ok()
    assert sum(s.preemptions for s in steps) > 0 and max(s.blocks_used for s in steps) == 24
    del seq  # the test's own last reference
    gc.collect()
    assert len(live) == 0, "finished sequences are still referenced"
    print(f"{len(steps)} steps, {sum(s.preemptions for s in steps)} preemptions, RSS MiB "
          f"{ {k: round(v / 2**20, 1) for k, v in rss.items()} }")
    # flat memory: the second half adds no more than the first half after the warm-up did, give or take 16 MiB
    # (steps.parquet's per-step rows are the only thing meant to grow: a few hundred bytes a step)
    first, second = rss["half"] - rss["warm"], rss["end"] - rss["half"]
    assert second <= max(first, 0) + 16 * 2**20, f"RSS grew {first / 2**20:.1f} MiB, then {second / 2**20:.1f} MiB"

"""Forking the n samples of a prompt: the block manager's fork (a hand-worked trace, all-or-nothing failures,
release order, caching on and off), PagedKVCache.copy_blocks against a hand check, and the engine: each prompt
is computed once for n=4 (the steps' tokens == the prompts' + each sample's outputs but its last), every sample
equals a one-sample run with its derived seed, also when the pool is too small to fork or forces preemptions.
The steps' tokens, not their num_prefill_tokens: a prompt's last chunk of one token runs as a decode row."""
import pytest
import torch

from engine.block_manager import DuplicateSequenceError, KVBlockManager, OutOfBlocksError, extend_block_hashes
from engine.engine import LLMEngine
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.sequence import SamplingParams, sample_seed

N, SEED, MAX_TOKENS = 4, 7, 6


def snapshot(manager: KVBlockManager):
    return (list(manager.free_blocks), list(manager.cached_blocks), list(manager.ref_counts), list(manager.block_hash),
            {sid: (s.sequence_length, list(s.block_table), s.num_hashed_blocks)
             for sid, s in manager.sequences.items()})


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_blocks_and_copies_the_partial_one(caching):
    manager = KVBlockManager(num_physical_blocks=8, block_size=4, enable_prefix_caching=caching)
    manager.create_sequence(0)
    manager.append_tokens(0, 10)  # blocks 0 1 full, 2 holds 2 tokens
    manager.register_full_blocks(0, extend_block_hashes([], range(10), 4))
    assert manager.fork(0, [1, 2]) == [(2, 3), (2, 4)]  # the parent's partial block into each child's own
    assert [manager.state(s).block_table for s in (0, 1, 2)] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert manager.ref_counts[:5] == [3, 3, 1, 1, 1] and manager.num_free_blocks == 3
    assert [manager.state(s).num_hashed_blocks for s in (1, 2)] == [2 if caching else 0] * 2
    logical = sum(s.sequence_length for s in manager.sequences.values())  # shared tokens counted per sequence
    assert (manager.internal_fragmentation_tokens(), logical) == (3 * 2, 30)
    assert manager.invariants_ok()
    assert manager.append_token(1) == 3 * 4 + 2  # a child writes into its copy
    manager.release_sequence(0)  # the shared blocks stay with the children; only the parent's own is freed
    assert manager.ref_counts[:5] == [2, 2, 0, 1, 1] and list(manager.free_blocks) == [5, 6, 7, 2]
    manager.release_sequence(2)
    manager.release_sequence(1)  # the last holder: now the shared blocks leave
    assert manager.ref_counts == [0] * 8 and manager.num_cached_blocks == (2 if caching else 0)
    assert sorted(manager.free_blocks) == ([2, 3, 4, 5, 6, 7] if caching else list(range(8)))
    assert manager.invariants_ok()


def test_a_fork_at_a_block_boundary_copies_nothing():
    manager = KVBlockManager(num_physical_blocks=6, block_size=4, enable_prefix_caching=False)
    manager.create_sequence(0)
    manager.append_tokens(0, 8)
    assert manager.fork(0, [1]) == [] and manager.state(1).block_table == [0, 1]
    assert manager.ref_counts[:2] == [2, 2] and manager.invariants_ok()
    assert manager.append_token(1) == 2 * 4 and manager.append_token(0) == 3 * 4  # each its own next block
    assert manager.invariants_ok()


def test_a_fork_that_does_not_fit_changes_nothing():
    manager = KVBlockManager(num_physical_blocks=4, block_size=4)
    manager.create_sequence(0)
    manager.append_tokens(0, 9)  # 3 blocks; 1 free
    manager.create_sequence(5)
    before = snapshot(manager)
    with pytest.raises(OutOfBlocksError):
        manager.fork(0, [1, 2])  # 2 copies, 1 free block
    with pytest.raises(DuplicateSequenceError):
        manager.fork(0, [1, 5])
    with pytest.raises(DuplicateSequenceError):
        manager.fork(0, [1, 1])
    assert snapshot(manager) == before
    assert manager.fork(0, [1]) == [(2, 3)] and manager.invariants_ok()


def test_invariants_catch_a_shared_partial_block():
    manager = KVBlockManager(num_physical_blocks=4, block_size=4)
    manager.create_sequence(0)
    manager.append_tokens(0, 6)
    manager.fork(0, [1])
    manager.state(1).block_table[-1] = 1  # the parent's partial block, with the reference counts to match
    manager.ref_counts[1], manager.ref_counts[2] = 2, 0
    manager.free_blocks.append(2)
    assert not manager.invariants_ok()


def test_copy_blocks_by_hand():
    cache = PagedKVCache(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=3), 5, 4, torch.float32,
                         torch.device("cpu"))
    for layer in (*cache.key_caches, *cache.value_caches):
        layer.copy_(torch.randn(layer.shape))
    before = [c.clone() for c in (*cache.key_caches, *cache.value_caches)]
    cache.copy_blocks(torch.tensor([2, 2, 0]), torch.tensor([4, 1, 3]))
    for old, new in zip(before, (*cache.key_caches, *cache.value_caches)):
        assert torch.equal(new[0], old[0]) and torch.equal(new[2], old[2])
        assert torch.equal(new[4], old[2]) and torch.equal(new[1], old[2]) and torch.equal(new[3], old[0])


def make_engine(make_config, block_size: int, *extra: str) -> LLMEngine:
    return LLMEngine(make_config("model.device=cpu", "model.max_model_len=96", f"cache.block_size={block_size}",
                                 "scheduler.max_num_batched_tokens=16", "cache.check_invariants=true", *extra))


def prompts_for(block_size: int) -> list[list[int]]:
    """Distinct first tokens (no prefix-cache hit between prompts); lengths a multiple of the block size and not,
    and one shorter than a block of 16."""
    return [[10 * j + 1] + list(range(200, 199 + length)) for j, length in
            enumerate((2 * block_size, 2 * block_size + 1, 7))]


def run(engine: LLMEngine, requests) -> dict:
    """(request id, sample index) -> (output token ids, output logprobs) of every finished sample."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return {(s.request_id, s.sample_index): (s.output_token_ids, s.output_logprobs) for s in engine.run()}


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "top_p": 0.9, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                             "logprobs": 2, **kw})


def single_runs(engine: LLMEngine, prompts, max_tokens: int = MAX_TOKENS) -> dict:
    """The oracle: sample i of prompt j as a one-sample request seeded sample_seed(SEED, i)."""
    out = run(engine, [(f"{j}/{i}", p, params(seed=sample_seed(SEED, i), max_tokens=max_tokens))
                       for j, p in enumerate(prompts) for i in range(N)])
    return {(rid.split("/")[0], int(rid.split("/")[1])): v for (rid, _), v in out.items()}


def assert_same(samples: dict, expected: dict) -> None:
    assert samples.keys() == expected.keys()
    for key, (tokens, logprobs) in samples.items():
        assert tokens == expected[key][0], key
        assert logprobs == pytest.approx(expected[key][1], abs=1e-5), key


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_n_samples_prefill_each_prompt_once(make_config, one_thread, block_size):
    engine, prompts = make_engine(make_config, block_size), prompts_for(block_size)
    samples = run(engine, [(str(j), p, params(n=N, seed=SEED)) for j, p in enumerate(prompts)])
    steps = engine.stats.steps
    assert sum(s.tokens for s in steps) == sum(map(len, prompts)) + len(prompts) * N * (MAX_TOKENS - 1)
    assert sum(s.prefix_cache_hit_tokens for s in steps) == 0 and sum(s.preemptions for s in steps) == 0
    assert len({tuple(samples[str(j), i][0]) for j in range(len(prompts)) for i in range(N)}) == len(prompts) * N
    assert_same(samples, single_runs(make_engine(make_config, block_size), prompts))


@pytest.mark.parametrize("caching", [True, False])
def test_without_blocks_for_the_copies_the_samples_wait(make_config, one_thread, caching):
    """A pool of 4 blocks of 4: the prompt takes 3 (the last partial), so the 3 copies do not fit; the other
    samples are queued when the first draws, and run after it (taking its full blocks from the cache, if on).
    Two outputs each: a sample fills 3 blocks, so none is preempted."""
    engine = make_engine(make_config, 4, "cache.num_blocks=4", "model.max_model_len=16", f"cache.enable_prefix_caching={caching}")
    prompt = list(range(100, 110))
    first = engine.add_request("0", prompt, params(n=N, seed=SEED, max_tokens=2))
    others = list(first.held_samples)
    while not first.output_token_ids:
        engine.step()
    assert list(engine.scheduler.waiting) == others and engine.block_manager.sequences.keys() == {first.seq_id}
    samples = {(s.request_id, s.sample_index): (s.output_token_ids, s.output_logprobs) for s in engine.run()}
    steps = engine.stats.steps
    hits = sum(s.prefix_cache_hit_tokens for s in steps)
    assert hits == ((N - 1) * 8 if caching else 0) and sum(s.preemptions for s in steps) == 0
    assert sum(s.tokens for s in steps) == N * len(prompt) - hits + N * (2 - 1)
    assert_same(samples, single_runs(make_engine(make_config, 4), [prompt], max_tokens=2))


def test_forked_samples_survive_preemption(make_config, one_thread, monkeypatch):
    """A pool of 12 blocks of 4 for 6 requests of n=4: forked samples are preempted and recompute their prompt
    and outputs; every sample still equals its one-sample run."""
    prompts = [[j + 1] + list(range(150, 150 + length)) for j, length in enumerate((5, 8, 13, 3, 11, 9))]
    engine = make_engine(make_config, 4, "cache.num_blocks=12", "model.max_model_len=48", "scheduler.max_num_seqs=16",
                         "scheduler.admission_headroom=0")  # admissions that fill the pool, so that forks preempt
    forked, fork_held_samples = [], engine.scheduler._fork_held_samples

    def recording(batch):
        forks = fork_held_samples(batch)
        forked.extend(child for fork in forks for child in fork.children)
        return forks

    monkeypatch.setattr(engine.scheduler, "_fork_held_samples", recording)
    samples = run(engine, [(str(j), p, params(n=N, seed=SEED)) for j, p in enumerate(prompts)])
    assert forked and any(child.num_preemptions for child in forked)
    assert engine.block_manager.num_used_blocks == 0 and not engine.block_manager.sequences
    assert_same(samples, single_runs(make_engine(make_config, 4), prompts))

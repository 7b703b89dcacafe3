import pytest

from engine.block_manager import KVBlockManager
from engine.engine import LLMEngine
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence


def make_seq(seq_id, prompt_len):
    """A sequence whose prompt shares no block with another's (the scheduler hashes prompts it admits)."""
    prompt = list(range(1000 * seq_id, 1000 * seq_id + prompt_len))
    return Sequence(seq_id, str(seq_id), prompt, SamplingParams(), max_num_tokens=prompt_len + 16)


def test_admission_stops_at_the_block_budget():
    # block_size 4, 5 blocks: prompts of 6 tokens need 2 blocks each -> two fit, the third waits.
    scheduler = Scheduler(KVBlockManager(5, 4), max_num_seqs=8, max_num_batched_tokens=100)
    for i in range(3):
        scheduler.add(make_seq(i, 6))
    batch = scheduler.schedule()
    assert batch.phase == "prefill" and [s.seq_id for s in batch.seqs] == [0, 1]
    assert batch.num_new_tokens == [6, 6] and len(scheduler.waiting) == 1
    assert scheduler.block_manager.num_free_blocks == 1


def test_admission_stops_at_the_token_budget_and_chunks_the_rest():
    scheduler = Scheduler(KVBlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    for i in range(3):
        scheduler.add(make_seq(i, 4))
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [4, 4, 2] and batch.num_tokens == 10
    assert [s.num_computed_tokens for s in batch.seqs] == [4, 4, 2]  # counted when their slots were allocated
    follow_up = scheduler.schedule()  # the chunked prompt continues before any decode
    assert follow_up.phase == "prefill" and [s.seq_id for s in follow_up.seqs] == [2] and follow_up.num_new_tokens == [2]


@pytest.mark.parametrize("headroom, admitted", [(8, 5), (64, 3), (0, 10)])
def test_admission_keeps_headroom_for_the_growth_of_every_running_sequence(headroom, admitted):
    """20 blocks of 4; prompts of 8 tokens (2 blocks) that may grow by 16 tokens (4 blocks). The k-th admission
    (k >= 2) keeps free the growth of itself and of the k - 1 before it: with a headroom of 8 tokens (2 blocks
    each) 2 + 2 (k - 1) + 2 <= 20 - 2 (k - 1) holds up to k = 5; with 64, capped at the 16 tokens each may still
    draw (4 blocks), 2 + 4 (k - 1) + 4 <= 20 - 2 (k - 1) up to k = 3; with none, 10 prompts fill the pool."""
    scheduler = Scheduler(KVBlockManager(20, 4), max_num_seqs=16, max_num_batched_tokens=1000,
                          admission_headroom=headroom)
    for i in range(12):
        scheduler.add(make_seq(i, 8))
    assert len(scheduler.schedule().seqs) == admitted and len(scheduler.waiting) == 12 - admitted


def test_a_headroom_of_the_whole_growth_never_preempts_and_changes_no_output(make_config):
    """8 prompts of 8 tokens that grow by 16, in 20 blocks of 4: admitted as they fit now, the newest are
    preempted as the others grow; with a headroom of 16 tokens, none is. Greedy outputs equal a roomy pool's."""
    def run(*overrides):
        engine = LLMEngine(make_config("cache.block_size=4", "model.max_model_len=32", "model.device=cpu",
                                       "cache.enable_prefix_caching=false", "cache.check_invariants=true", *overrides))
        seqs = [engine.add_request(str(i), list(range(10 * i + 1, 10 * i + 9)),
                                   SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)) for i in range(8)]
        list(engine.run())
        return [s.output_token_ids for s in seqs], sum(s.preemptions for s in engine.stats.steps)

    roomy, _ = run("cache.num_blocks=200")
    packed, preempted = run("cache.num_blocks=20", "scheduler.admission_headroom=0")
    kept, none = run("cache.num_blocks=20", "scheduler.admission_headroom=16")
    assert preempted > 0 and none == 0
    assert packed == kept == roomy


def test_a_sequence_is_admitted_alone_whatever_its_headroom(make_config):
    """A pool of one sequence of max_model_len (6 blocks of 4) and a request of 4 samples, whose headroom (64
    tokens each) the pool cannot hold: with nothing running each is admitted anyway, one after another."""
    engine = LLMEngine(make_config("cache.block_size=4", "cache.num_blocks=6", "model.max_model_len=24",
                                   "model.device=cpu", "scheduler.admission_headroom=64"))
    first = engine.add_request("0", list(range(1, 11)), SamplingParams(n=4, seed=1, max_tokens=14, ignore_eos=True))
    samples = [first, *first.held_samples]
    for _ in range(200):  # bounded: a headroom that blocked a lone admission would leave nothing to run
        if not engine.scheduler.has_work():
            break
        engine.step()
    assert not engine.scheduler.has_work() and all(len(s.output_token_ids) == 14 for s in samples)


def test_sequence_cap():
    scheduler = Scheduler(KVBlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        scheduler.add(make_seq(i, 3))
    assert len(scheduler.schedule().seqs) == 2 and len(scheduler.waiting) == 1


def test_slots_of_a_batch_follow_the_address_map():
    manager = KVBlockManager(16, 4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=100)
    for i, n in enumerate((5, 3)):
        scheduler.add(make_seq(i, n))
    batch = scheduler.schedule()
    expected = [t[p // 4] * 4 + p % 4 for seq, n in zip(batch.seqs, batch.num_new_tokens)
                for t in [manager.sequences[seq.seq_id].block_table] for p in range(n)]
    assert batch.slot_mapping.tolist() == expected


def test_freed_blocks_are_reused_and_nothing_leaks(make_config):
    # 8 blocks of 4 tokens; admission needs the prompt's 2 blocks free (no headroom kept for growth), so at most 4
    # run at once, and as they grow to 16 tokens = 4 blocks each, the newest are preempted. (No prefix caching: the
    # five equal prompts would share their blocks.)
    engine = LLMEngine(make_config("cache.block_size=4", "cache.num_blocks=8", "model.max_model_len=32", "model.device=cpu",
                                   "cache.enable_prefix_caching=false", "scheduler.admission_headroom=0"))
    for i in range(5):
        engine.add_request(str(i), list(range(10, 18)), SamplingParams(max_tokens=8, ignore_eos=True))
    seen_blocks, finished = set(), []
    while engine.scheduler.has_work():
        for state in engine.block_manager.sequences.values():
            seen_blocks.update(state.block_table)
        finished += engine.step()
        assert engine.block_manager.invariants_ok()
    assert len(finished) == 5 and all(len(s.output_token_ids) == 8 for s in finished)
    assert max(s.running_seqs for s in engine.stats.steps) == 4
    assert seen_blocks == set(range(8))
    assert engine.block_manager.num_free_blocks == 8 and not engine.block_manager.sequences


def test_preemption_frees_the_newest_and_recomputes(make_config):
    engine = LLMEngine(make_config("cache.block_size=2", "cache.num_blocks=10", "model.max_model_len=20",
                                   "model.device=cpu", "scheduler.admission_headroom=0"))  # admits what fits now
    seqs = [engine.add_request(str(i), list(range(1, 7)), SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    finished = list(engine.run())
    assert len(finished) == 3 and sum(s.preemptions for s in engine.stats.steps) > 0
    assert seqs[-1].num_preemptions > 0 and seqs[0].num_preemptions == 0
    # the same prompt and greedy sampling: preempted or not, every sequence produces the same tokens
    assert seqs[0].output_token_ids == seqs[1].output_token_ids == seqs[2].output_token_ids


def test_stop_token_ends_the_output_even_with_a_step_in_flight(make_config):
    """The host resolves a step's tokens one step late: a sequence that stops must lose the token
    drawn after its stop and free its blocks."""
    config = make_config("cache.block_size=4", "model.device=cpu", "cache.check_invariants=true")
    prompts = [[5, 9, 13], [7, 3, 1, 8, 2], [4] * 9]
    free_run = LLMEngine(config)
    reference = [free_run.add_request(str(i), p, SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]
    list(free_run.run())
    stop = reference[0].output_token_ids[4]
    engine = LLMEngine(config)
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,)))
            for i, p in enumerate(prompts)]
    list(engine.run())
    for seq, ref in zip(seqs, reference):
        cut = ref.output_token_ids.index(stop) + 1 if stop in ref.output_token_ids else len(ref.output_token_ids)
        assert seq.output_token_ids == ref.output_token_ids[:cut]
        assert seq.finish_reason == ("stop" if stop in ref.output_token_ids else "length")
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_admissions_wait_for_a_batch_of_free_slots_while_sequences_decode():
    # max_num_seqs 16 -> admission_batch 2: with 16 running, one finishing frees 1 slot (< 2): nobody is
    # admitted; a second finishing frees 2: both waiting-line heads are admitted in the same step.
    scheduler = Scheduler(KVBlockManager(200, 4), max_num_seqs=16, max_num_batched_tokens=1000)
    assert scheduler.admission_batch == 2
    for i in range(20):
        scheduler.add(make_seq(i, 3))
    first = scheduler.schedule()
    assert len(first.seqs) == 16 and len(scheduler.waiting) == 4
    for seq in first.seqs:
        seq.output_token_ids.append(7)  # the token each drew
    scheduler.finish(first.seqs[0], "stop")
    one_free = scheduler.schedule()
    assert one_free.phase == "decode" and len(one_free.seqs) == 15 and len(scheduler.waiting) == 4
    for seq in one_free.seqs:
        seq.output_token_ids.append(7)
    scheduler.finish(first.seqs[1], "stop")
    two_free = scheduler.schedule()
    assert two_free.phase == "mixed" and two_free.num_decode_seqs == 14
    assert [s.seq_id for s in two_free.seqs[14:]] == [16, 17] and len(scheduler.waiting) == 2

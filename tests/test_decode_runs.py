"""Decode runs (scheduler.num_scheduler_steps): a decode-only batch whose rows draw on the device alone runs several
device steps per scheduling. Oracles: transformers' greedy outputs; the same requests with one step per
scheduling (the noise follows each row's output index, so sampled tokens must agree exactly); the address map
slot = T[p // B] * B + p % B; counts worked out by hand."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import KVBlockManager
from engine.config import engine_config
from engine.engine import LLMEngine
from engine.errors import ConfigError
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import PLACEHOLDER, Sequence
from engine.stats import StepStats, run_stats
from tests.test_oracle import MAX_TOKENS, reference_outputs


def count_runs(monkeypatch) -> list[int]:
    """The num_steps of every decode run the runners launch from now on."""
    runs, launch_run = [], ModelRunner._launch_run

    def counted(self, batch, *args):
        runs.append(batch.num_steps)
        return launch_run(self, batch, *args)
    monkeypatch.setattr(ModelRunner, "_launch_run", counted)
    return runs


@pytest.fixture(scope="module")
def greedy_reference(qwen3_checkpoint):
    _, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(5)
    head = torch.randint(0, 256, (21,), generator=generator).tolist()  # shared: prefix-cache hits on full blocks
    prompts = [head + torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 4, 9, 30)]
    prompts += [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (2, 15)]
    outputs, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    return prompts, outputs


@pytest.mark.parametrize("block_size,steps,pool", [(1, 4, None), (4, 5, None), (16, 3, None), (4, 4, 30)])
def test_greedy_runs_match_transformers(make_config, qwen3_checkpoint, greedy_reference, monkeypatch,
                                        block_size, steps, pool):
    """Token-exact with transformers at block sizes 1, 4 and 16, runs of 3-5 steps; a pool of 30 blocks of 4
    is too small for the six sequences' runs (the batch then takes a single step, or preempts as before)."""
    path, _ = qwen3_checkpoint
    prompts, expected = greedy_reference
    runs = count_runs(monkeypatch)
    overrides = [f"model.path={path}", "model.max_model_len=96", "model.device=cpu", "model.dtype=float32",
                 f"cache.block_size={block_size}", f"scheduler.num_scheduler_steps={steps}",
                 "cache.check_invariants=true", "scheduler.max_num_batched_tokens=32"]
    small_pool = [f"cache.num_blocks={pool}", "scheduler.admission_headroom=0"] if pool else []  # filled by admissions
    engine = LLMEngine(make_config(*overrides, *small_pool))
    max_tokens = [MAX_TOKENS, 7, MAX_TOKENS, 1, 10, MAX_TOKENS]  # rows whose outputs end inside a run
    seqs = [engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=m))
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    assert len(list(engine.run())) == len(prompts)
    assert [s.output_token_ids for s in seqs] == [e[:m] for e, m in zip(expected, max_tokens)]
    assert runs and max(runs) == steps, "decode runs were meant to happen"
    assert engine.block_manager.num_used_blocks == 0 and engine.block_manager.invariants_ok()
    if pool:
        assert sum(s.preemptions for s in engine.stats.steps) > 0, "the pool was meant to force preemption"
    assert sum(s.tokens for s in engine.stats.steps if s.phase == "decode") + sum(
        s.num_prefill_tokens + s.num_decode_seqs for s in engine.stats.steps if s.phase != "decode") >= sum(
        len(p) for p in prompts)


def test_runs_offer_the_blocks_their_outputs_complete_as_single_steps_do(make_config, qwen3_checkpoint,
                                                                        greedy_reference):
    """The prefix cache after the same greedy requests with runs of 4 and with one step a scheduling: each
    sequence's block hashes (its outputs' full blocks included) and the cache's index hold the same hashes."""
    path, _ = qwen3_checkpoint
    prompts, _ = greedy_reference
    caches = []
    for steps in (1, 4):
        engine = LLMEngine(make_config(f"model.path={path}", "model.max_model_len=96", "model.device=cpu",
                                       "model.dtype=float32", "cache.block_size=4",
                                       f"scheduler.num_scheduler_steps={steps}"))
        seqs = [engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
                for i, p in enumerate(prompts)]
        list(engine.run())
        caches.append(([s.block_hashes for s in seqs], set(engine.block_manager.cached_block_of)))
    assert caches[0] == caches[1]
    assert all(len(h) > (len(p) + 8) // 4 for h, p in zip(caches[0][0], prompts))  # outputs' blocks among them


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: the decode graphs and their draw graphs"))])
def test_runs_draw_what_single_steps_draw(monkeypatch, device):
    """Sampled rows (temperature, top-p, n = 3, stop ids that end rows inside a run, EOS) give the same tokens and
    finish reasons with runs of 5 as with one step per scheduling (float32: the batches differ, as rows that
    ended inside a run stay in it); a request with a penalty or logprobs keeps the batches it is in to single
    steps, and its own outputs are unchanged."""
    torch.set_num_threads(1)
    stop_ids = [7, 11, 13]
    params = [SamplingParams(temperature=0.9, max_tokens=40, seed=3, stop_token_ids=stop_ids),
              SamplingParams(temperature=1.0, top_p=0.8, max_tokens=33, seed=4, n=3),
              SamplingParams(temperature=0.0, max_tokens=17),
              SamplingParams(temperature=1.0, max_tokens=29, seed=5, min_tokens=6, stop_token_ids=stop_ids)]
    late = [SamplingParams(temperature=1.0, max_tokens=12, seed=6, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, max_tokens=12, seed=7, logprobs=2)]
    prompts = [list(range(5, 5 + n)) for n in (3, 18, 9, 26)]

    def outputs(steps: int, extra: bool) -> list:
        llm = LLM(model="tiny", max_model_len=128, device=device, dtype="float32", block_size=4,
                  num_scheduler_steps=steps)
        reqs = list(zip(prompts, params)) + (list(zip(prompts[:2], late)) if extra else [])
        results = llm.generate([p for p, _ in reqs], [s for _, s in reqs])
        llm.close()
        return [[(c.token_ids, c.finish_reason) for c in r.outputs] for r in results]

    runs = count_runs(monkeypatch)
    single = outputs(1, extra=False)
    assert not runs
    assert outputs(5, extra=False) == single and max(runs) == 5
    finishes = [reason for request in single for _, reason in request]
    assert "stop" in finishes and "length" in finishes, "rows were meant to end both ways"
    runs.clear()
    with_late = outputs(5, extra=True)
    assert with_late == outputs(1, extra=True)
    assert with_late[:len(prompts)] == single  # the rows' noise does not depend on their batch


def test_no_run_while_a_request_waits(make_config, monkeypatch):
    """Two sequences at a time, five requests: a run would hold back the next admission, so runs start only
    once the queue is empty (the last requests' decodes)."""
    waiting, launch_run = [], ModelRunner._launch_run

    def recorded(self, batch, *args):
        waiting.append(len(engine.scheduler.waiting))
        return launch_run(self, batch, *args)
    monkeypatch.setattr(ModelRunner, "_launch_run", recorded)
    engine = LLMEngine(make_config("model.device=cpu", "model.max_model_len=64", "scheduler.max_num_seqs=2",
                                   "scheduler.num_scheduler_steps=4"))
    for i in range(5):
        engine.add_request(str(i), [3 + i] * 5, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(list(engine.run())) == 5
    assert waiting and set(waiting) == {0}


def make_sequences(manager: KVBlockManager, lengths: list[int], max_tokens: list[int]) -> list[Sequence]:
    """Running sequences of these prompt lengths, each past its prompt with one output drawn (decoding)."""
    seqs = []
    for i, (n, m) in enumerate(zip(lengths, max_tokens)):
        seq = Sequence(i, str(i), list(range(n)), SamplingParams(max_tokens=m), n + m, output_token_ids=[1])
        seq.block_state = manager.create_sequence(i)
        manager.append_tokens(i, n)
        seq.status = seq.status.RUNNING
        seqs.append(seq)
    return seqs


def test_extend_decodes_allocates_each_rows_steps_by_the_address_map():
    manager = KVBlockManager(num_physical_blocks=40, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = make_sequences(manager, [3, 8, 5], [9, 3, 2])  # tokens they may still draw: 8, 2, 1
    scheduler.running.extend(seqs)
    batch = scheduler.schedule()
    assert batch.num_decode_seqs == 3 and batch.num_steps == 1
    scheduler.extend_decodes(batch, 6)
    assert batch.num_steps == 6 and batch.num_new_tokens == [6, 2, 1]
    starts = [3, 8, 5]  # each row's input position at the run's first step: its last token's
    expected = []
    for seq, start, count in zip(seqs, starts, batch.num_new_tokens):
        table = manager.state(seq.seq_id).block_table
        expected += [table[p // 4] * 4 + p % 4 for p in range(start, start + count)]
        assert manager.state(seq.seq_id).sequence_length == start + count
    assert batch.slot_mapping.tolist() == expected and manager.invariants_ok()
    assert batch.num_prefill_tokens == 0 and batch.phase == "decode"


def test_extend_decodes_leaves_a_short_pool_and_the_batch_as_they_were():
    manager = KVBlockManager(num_physical_blocks=6, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = make_sequences(manager, [7, 7], [20, 20])  # 2 blocks each, one more each for the decode step
    scheduler.running.extend(seqs)
    batch = scheduler.schedule()
    free, slots = manager.num_free_blocks, batch.slot_mapping.copy()
    scheduler.extend_decodes(batch, 8)  # 7 more tokens each: 2 blocks each, 1 free
    assert batch.num_steps == 1 and batch.num_new_tokens == [1, 1] and (batch.slot_mapping == slots).all()
    assert manager.num_free_blocks == free and [s.num_computed_tokens for s in seqs] == [8, 8]
    assert manager.invariants_ok()


def test_run_stats_give_a_row_per_device_step():
    stats = StepStats(step=10, phase="decode", seqs=4, tokens=9, num_decode_seqs=4, num_prefill_tokens=0,
                      prefix_cache_hit_tokens=0, admitted_tokens=0, running_seqs=4, waiting_seqs=0, blocks_used=5,
                      blocks_free=3, cached_blocks=0, stored_tokens=20, logical_tokens=20, allocated_slots=20,
                      internal_waste_tokens=0, paged_kv_utilization_pct=100.0, internal_waste_pct=0.0,
                      contiguous_reserved_slots=40, contiguous_kv_utilization_pct=50.0, block_table_bytes=20,
                      preemptions=2, finished=3, step_time_s=0.8)
    rows = run_stats(stats, [3, 1, 4, 1])
    assert [r.step for r in rows] == [10, 11, 12, 13]
    assert [r.seqs for r in rows] == [4, 2, 2, 1] == [r.tokens for r in rows]  # rows with count > j
    assert sum(r.tokens for r in rows) == 3 + 1 + 4 + 1
    assert [r.preemptions for r in rows] == [2, 0, 0, 0] and [r.finished for r in rows] == [0, 0, 0, 3]
    assert sum(r.step_time_s for r in rows) == pytest.approx(0.8)


def test_known_tokens_stop_at_the_trailing_placeholders():
    seq = Sequence(0, "r", [4, 5, 6], SamplingParams(max_tokens=8), 11, output_token_ids=[9, 8])
    assert seq.num_known_tokens == 5
    seq.output_token_ids += [PLACEHOLDER] * 3
    assert seq.num_known_tokens == 5 and seq.has_placeholder


def test_draws_ahead_only_without_host_work_between_draws():
    def seq(**params):
        return Sequence(0, "r", [1], SamplingParams(max_tokens=8, **params), 9, output_token_ids=[2, 3])
    assert seq(temperature=1.0, top_p=0.5, stop=("x",)).draws_ahead
    assert seq(min_tokens=2).draws_ahead and not seq(min_tokens=3).draws_ahead
    assert not seq(logprobs=0).draws_ahead and not seq(presence_penalty=0.5).draws_ahead


def test_num_scheduler_steps_is_checked(make_config):
    with pytest.raises(ConfigError, match="scheduler.num_scheduler_steps must be >= 1"):
        engine_config("tiny", num_scheduler_steps=0)
    assert LLMEngine(make_config("model.device=cpu")).num_scheduler_steps == 1  # the CPU's default


"""Per-step and per-run statistics on traces whose answers are worked out by hand in the tests."""
from types import SimpleNamespace

import pytest

from engine.block_manager import KVBlockManager, internal_waste
from engine.kv_cache import bytes_per_block
from engine.llm import LLM
from engine.sequence import SamplingParams
from engine.stats import STEPS_SCHEMA, StatsRecorder, snapshot, steps_table
from jobs.common import summary_row
from jobs.config import engine_config_of
from jobs.processor import run_of


def take_snapshot(manager, max_model_len, step=0, running=None):
    batch = SimpleNamespace(phase="decode", seqs=[], num_tokens=0, num_decode_seqs=0, num_prefill_tokens=0,
                            num_preempted=0, prefix_cache_hit_tokens=0, admitted_tokens=0)
    scheduler = SimpleNamespace(running=running if running is not None else list(manager.sequences), waiting=[])
    return snapshot(step, batch, scheduler, manager, max_model_len)


@pytest.mark.parametrize("length, block_size, waste", [
    (1, 16, 15), (15, 16, 1), (16, 16, 0), (17, 16, 15), (33, 8, 7), (32, 8, 0), (1, 1, 0), (7, 4, 1), (0, 4, 0),
])
def test_internal_waste_formula(length, block_size, waste):
    assert internal_waste(length, block_size) == waste


def test_waste_of_one_growing_sequence():
    # block size 4: lengths 1..10 leave 3, 2, 1, 0, 3, 2, 1, 0, 3, 2 slots of the last block unused
    manager = KVBlockManager(8, 4)
    manager.create_sequence(0)
    wastes, pcts = [], []
    for _ in range(10):
        manager.append_token(0)
        stats = take_snapshot(manager, max_model_len=32)
        wastes.append(stats.internal_waste_tokens)
        pcts.append(stats.internal_waste_pct)
    assert wastes == [3, 2, 1, 0, 3, 2, 1, 0, 3, 2]
    allocated = [4, 4, 4, 4, 8, 8, 8, 8, 12, 12]
    assert pcts == pytest.approx([100 * w / a for w, a in zip(wastes, allocated)])


def test_snapshot_of_three_sequences_by_hand():
    # block size 4, lengths 5, 8, 1: blocks 2 + 2 + 1 = 5 -> 20 slots; stored 14; waste 3 + 0 + 3 = 6
    manager = KVBlockManager(10, 4)
    for seq, length in enumerate((5, 8, 1)):
        manager.create_sequence(seq)
        manager.append_tokens(seq, length)
    stats = take_snapshot(manager, max_model_len=16)
    assert (stats.blocks_used, stats.blocks_free, stats.allocated_slots) == (5, 5, 20)
    assert (stats.stored_tokens, stats.internal_waste_tokens) == (14, 6)
    assert stats.paged_kv_utilization_pct == pytest.approx(70.0)
    assert stats.internal_waste_pct == pytest.approx(30.0)
    assert stats.contiguous_reserved_slots == 3 * 16
    assert stats.contiguous_kv_utilization_pct == pytest.approx(100 * 14 / 48)
    assert stats.block_table_bytes == 5 * 4  # five int32 entries


def test_counterfactual_when_the_contiguous_cache_could_not_hold_the_batch():
    # 64 blocks of 16 = 1024 slots; max_model_len 256 -> a contiguous cache of the same memory holds 4
    # sequences. Six live sequences of 100 tokens: it would reserve 6 * 256 = 1536 slots for 600 tokens.
    manager = KVBlockManager(64, 16)
    recorder = StatsRecorder()
    for seq in range(6):
        manager.create_sequence(seq)
        manager.append_tokens(seq, 100)
    recorder.add(take_snapshot(manager, max_model_len=256))
    step = recorder.steps[0]
    assert step.contiguous_reserved_slots == 1536
    assert step.contiguous_kv_utilization_pct == pytest.approx(39.0625)  # 600 / 1536
    assert step.paged_kv_utilization_pct == pytest.approx(100 * 600 / (6 * 7 * 16))  # 7 blocks each
    summary = recorder.summary(num_blocks=64, block_size=16, max_model_len=256)
    assert summary["contiguous_max_concurrent_seqs"] == 4
    assert summary["max_running_seqs"] == 6
    assert summary["contiguous_kv_utilization_pct"] == pytest.approx(39.0625)


def run_engine(make_config, requests, *overrides):
    cfg = make_config("model.device=cpu", "model.max_model_len=64", "cache.block_size=4", "cache.num_blocks=32",
                      *overrides)
    llm = LLM.from_config(engine_config_of(cfg))
    outs = llm.generate([list(range(1, prompt_len + 1)) for prompt_len, _ in requests],
                        [SamplingParams(max_tokens=max_tokens, ignore_eos=True) for _, max_tokens in requests])
    return llm, sum(len(out.outputs[0].token_ids) for out in outs)


def summary_of(llm: LLM, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    counts = {"num_requests": num_requests, "num_errors": 0, "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens}
    return summary_row("generate", run_of(llm), counts)


def test_utilization_recomputed_by_hand_on_a_tiny_trace(make_config):
    # Two requests, block size 4: A (prompt 5, 3 tokens) and B (prompt 3, 2 tokens). The host learns a
    # step's tokens one step late, so B, whose last token is drawn in step 1, holds its block in step 2.
    #   step 0, prefill of both: lengths 5, 3 -> blocks 2 + 1 = 12 slots, 8 stored, waste 3 + 1
    #   step 1, decode:          lengths 6, 4 -> 12 slots, 10 stored, waste 2 + 0
    #   step 2, decode of A:     lengths 7, 4 -> 12 slots, 11 stored, waste 1 + 0; B finishes
    #   (then A's last token is resolved with no step of its own)
    llm, output_tokens = run_engine(make_config, [(5, 3), (3, 2)])
    rows = llm.stats().table().to_pylist()
    assert [r["phase"] for r in rows] == ["prefill", "decode", "decode"]
    assert [r["seqs"] for r in rows] == [2, 2, 1]
    assert [r["stored_tokens"] for r in rows] == [8, 10, 11]
    assert [r["allocated_slots"] for r in rows] == [12, 12, 12]
    assert [r["internal_waste_tokens"] for r in rows] == [4, 2, 1]
    assert [r["running_seqs"] for r in rows] == [2, 2, 2]
    util = [100 * 8 / 12, 100 * 10 / 12, 100 * 11 / 12]
    waste = [100 * 4 / 12, 100 * 2 / 12, 100 * 1 / 12]
    contiguous = [100 * 8 / 128, 100 * 10 / 128, 100 * 11 / 128]  # max_model_len 64 reserved per live sequence
    assert [r["paged_kv_utilization_pct"] for r in rows] == pytest.approx(util)
    assert [r["internal_waste_pct"] for r in rows] == pytest.approx(waste)
    assert [r["contiguous_kv_utilization_pct"] for r in rows] == pytest.approx(contiguous)
    assert [r["block_table_bytes"] for r in rows] == [12, 12, 12]

    summary = summary_of(llm, 2, 8, output_tokens)
    assert output_tokens == 5
    assert summary["mean_paged_kv_utilization_pct"] == pytest.approx(sum(util) / 3)
    assert summary["peak_paged_kv_utilization_pct"] == pytest.approx(100 * 11 / 12)
    assert summary["mean_internal_waste_pct"] == pytest.approx(sum(waste) / 3)
    assert summary["contiguous_kv_utilization_pct"] == pytest.approx(sum(contiguous) / 3)
    assert summary["peak_contiguous_kv_utilization_pct"] == pytest.approx(100 * 11 / 128)
    assert summary["peak_blocks_used"] == 3 and summary["peak_block_table_bytes"] == 12
    assert summary["max_running_seqs"] == 2 and summary["mean_running_seqs"] == pytest.approx(2)
    assert summary["preemptions"] == 0 and summary["num_steps"] == 3
    assert summary["contiguous_max_concurrent_seqs"] == 32 * 4 // 64


def test_counterfactual_on_an_engine_trace(make_config):
    # 32 blocks of 4 = 128 slots and max_model_len 64: a contiguous cache of that memory holds 2 sequences.
    # Four requests (prompt 4, 4 tokens) all run at once: lengths 4, 5, 6, 7 over four steps.
    llm, output_tokens = run_engine(make_config, [(4, 4)] * 4)
    rows = llm.stats().table().to_pylist()
    assert [r["stored_tokens"] for r in rows] == [16, 20, 24, 28]
    contiguous = [100 * 16 / 256, 100 * 20 / 256, 100 * 24 / 256, 100 * 28 / 256]
    paged = [100.0, 100 * 5 / 8, 100 * 6 / 8, 100 * 7 / 8]
    assert [r["contiguous_kv_utilization_pct"] for r in rows] == pytest.approx(contiguous)
    assert [r["paged_kv_utilization_pct"] for r in rows] == pytest.approx(paged)
    summary = summary_of(llm, 4, 16, output_tokens)
    assert summary["contiguous_max_concurrent_seqs"] == 2 and summary["max_running_seqs"] == 4
    assert summary["contiguous_kv_utilization_pct"] == pytest.approx(8.59375)
    assert summary["mean_paged_kv_utilization_pct"] == pytest.approx(81.25)


def test_summary_has_the_fields_of_the_sweep(make_config):
    llm, output_tokens = run_engine(make_config, [(6, 5), (9, 3), (2, 7)], "cache.block_size=8",
                                            "cache.num_blocks=null", "cache.kv_budget_gb=0.0001")
    summary = summary_of(llm, 3, 17, output_tokens)
    per_block = 2 * 2 * 2 * 8 * 16 * 4  # K and V, 2 layers, 2 kv heads, 8 tokens, head_dim 16, float32
    assert summary["block_size"] == 8 and summary["num_blocks"] == int(0.0001 * 1e9 // per_block)
    assert summary["kv_budget_bytes"] == summary["num_blocks"] * per_block
    assert per_block == bytes_per_block(llm.engine.model.kv_cache_spec, 8, llm.engine.dtype)
    assert summary["kv_slots"] == summary["num_blocks"] * 8
    for name in ("peak_blocks_used", "peak_paged_kv_utilization_pct", "mean_paged_kv_utilization_pct",
                 "mean_internal_waste_pct", "max_running_seqs", "mean_running_seqs", "preemptions",
                 "peak_block_table_bytes", "output_tok_per_s", "total_tok_per_s", "contiguous_kv_utilization_pct",
                 "contiguous_max_concurrent_seqs", "wall_time_s"):
        assert name in summary
    assert summary["output_tok_per_s"] == pytest.approx(output_tokens / summary["wall_time_s"])
    assert summary["wall_time_s"] == pytest.approx(sum(s.step_time_s for s in llm.stats().steps))


def test_no_steps_still_gives_a_table_and_a_summary():
    recorder = StatsRecorder()
    assert steps_table(recorder.steps).schema == STEPS_SCHEMA and steps_table(recorder.steps).num_rows == 0
    summary = recorder.summary(num_blocks=10, block_size=16, max_model_len=64)
    assert summary["num_steps"] == 0 and summary["mean_paged_kv_utilization_pct"] == 0.0
    assert summary["contiguous_max_concurrent_seqs"] == 2

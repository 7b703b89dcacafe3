"""Several samples per prompt (SamplingParams.n): sample i draws with seed sample_seed(seed, i), so it equals a
one-sample run with that seed; the prompt is prefilled once (the other samples are forked from the first when its
last prompt chunk is computed); the job writes one row per (id, sample_index) and resumes exactly once per (id,
sample_index)."""
import dataclasses
import errno
import gc
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.sequence import request_seed, sample_seed
from jobs import JobError
from jobs.generate import generate_job

N, PROMPT_LEN, BLOCK, BUDGET = 4, 41, 4, 16  # 41 = 10 full blocks + 1: each fork copies a partial block


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return LLM(model="tiny", max_model_len=128, device="cpu", block_size=BLOCK, max_num_batched_tokens=BUDGET)


def test_samples_are_single_runs_with_derived_seeds(tiny):
    prompt = list(range(3, 3 + PROMPT_LEN))
    params = SamplingParams(n=N, temperature=1.0, top_p=0.95, max_tokens=10, seed=11, ignore_eos=True)
    steps = len(tiny.engine.stats.steps)
    out = tiny.generate([prompt], params)[0]
    run = tiny.engine.stats.steps[steps:]
    assert [c.index for c in out.outputs] == list(range(N))
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == N, "samples at temperature 1 should differ"
    # the prompt is prefilled once: sample 0 computes it in chunks of BUDGET; the others are forked from it
    assert sum(s.num_prefill_tokens for s in run) == PROMPT_LEN
    assert sum(s.prefix_cache_hit_tokens for s in run) == 0
    for i, sample in enumerate(samples):
        alone = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=sample_seed(11, i), ignore_eos=True)
        assert tuple(tiny.generate([prompt], alone)[0].outputs[0].token_ids) == sample
    assert sample_seed(11, 0) == 11  # n=1 draws as before
    assert len({sample_seed(s, i) for s in range(50) for i in range(1, 5)}) == 200


@given(st.integers(-2**63, 2**64 - 1) | st.none(), st.integers(0, 40), st.floats(0, 2), st.integers(1, 64))
def test_a_requests_and_a_samples_settings_are_the_checked_copies_with_their_seeds(seed, index, temperature, n):
    """SamplingParams.for_request and sample copy the settings without checking them again: the oracle is
    dataclasses.replace's checked copy, with its noise_seed (cached from the seed) and penalised."""
    params = SamplingParams(temperature=temperature, n=n, seed=seed, presence_penalty=0.5)
    assert params.noise_seed >= 0 and params.penalised  # cached on params before they are copied
    request = params.for_request(index)
    sample = request.sample(index)
    for copy, expected in ((request, dataclasses.replace(params, seed=request_seed(index) if seed is None else seed)),
                           (sample, dataclasses.replace(request, seed=sample_seed(request.seed, index)))):
        assert copy == expected and (copy.noise_seed, copy.penalised) == (expected.noise_seed, expected.penalised)


def test_the_other_samples_are_forked_when_the_first_ones_prompt_is_computed(make_config):
    from engine.engine import LLMEngine

    engine = LLMEngine(make_config("model.device=cpu", "model.max_model_len=128", f"cache.block_size={BLOCK}",
                                   f"scheduler.max_num_batched_tokens={BUDGET}", "cache.check_invariants=true"))
    first = engine.add_request("r", list(range(3, 3 + PROMPT_LEN)), SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    others = list(first.held_samples)
    assert [s.sample_index for s in others] == [1, 2] and list(engine.scheduler.waiting) == [first]
    for _ in range(PROMPT_LEN // BUDGET):  # the prompt's chunks before its last
        engine.step()
        assert first.num_computed_tokens < PROMPT_LEN and all(s not in engine.scheduler.running for s in others)
    engine.step()  # the last chunk: the others draw their first token with it, past their prefill
    assert list(engine.scheduler.running) == [first, *others] and not engine.scheduler.waiting
    assert [s.num_computed_tokens for s in others] == [PROMPT_LEN] * 2
    assert [len(s.output_token_ids) for s in [first, *others]] == [1] * 3
    tables = [engine.block_manager.state(s.seq_id).block_table for s in [first, *others]]
    full = PROMPT_LEN // BLOCK
    assert tables[1][:full] == tables[2][:full] == tables[0][:full]  # every full block shared
    assert len({t[full] for t in tables}) == 3  # the partial last block: one copy each
    assert [engine.block_manager.ref_counts[b] for b in tables[0]] == [3] * full + [1]
    engine.step()
    assert engine.stats.steps[-1].phase == "decode" and engine.stats.steps[-1].num_decode_seqs == 3
    assert len(list(engine.run())) == 3


def test_the_samples_share_one_prompt_that_the_garbage_collector_leaves_alone(make_config):
    """A request's samples hold one copy of its prompt, made when it is added (a later change to the caller's list
    leaves it as it was), and the garbage collector stops tracking it: a full collection would otherwise traverse
    every sample's prompt token by token."""
    from engine.engine import LLMEngine

    engine = LLMEngine(make_config("model.device=cpu", "model.max_model_len=128", f"cache.block_size={BLOCK}"))
    ids = list(range(3, 3 + PROMPT_LEN))
    first = engine.add_request("r", ids, SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    ids.append(7)
    assert all(s.prompt_token_ids is first.prompt_token_ids for s in first.held_samples)
    assert list(first.prompt_token_ids) == ids[:-1]
    gc.collect()
    assert not gc.is_tracked(first.prompt_token_ids)
    finished = [seq for _ in range(20) for seq in engine.step()]
    assert sorted(s.sample_index for s in finished) == [0, 1, 2] and all(len(s.output_token_ids) == 2 for s in finished)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt(tiny):
    prompt = list(range(100, 100 + PROMPT_LEN))
    tiny.generate([prompt], SamplingParams(max_tokens=1))  # its blocks are in the cache now
    steps = len(tiny.engine.stats.steps)
    tiny.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, n=2))
    run = tiny.engine.stats.steps[steps:]
    assert sum(s.prefix_cache_hit_tokens for s in run) == 0 and sum(s.num_prefill_tokens for s in run) == 2 * PROMPT_LEN


def test_samples_without_the_prefix_cache(tiny):
    plain = LLM(model="tiny", max_model_len=128, device="cpu", block_size=BLOCK, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=5, ignore_eos=True)
    expected = tiny.generate(["shared prompt"], params)[0]
    assert [c.token_ids for c in plain.generate(["shared prompt"], params)[0].outputs] == \
        [c.token_ids for c in expected.outputs]


def job_config(make_config, tmp_path, *extra):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"prompt {i}" for i in range(6)],
                             "n": [3, None, 2, 0, 1, 3]}), path)
    return make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=128", "sampling.max_tokens=3",
                       "sampling.ignore_eos=true", "sampling.temperature=1.0", "sampling.n=2", "job.flush_every=2",
                       f"cache.block_size={BLOCK}", *extra)


def test_the_job_writes_a_row_per_sample_and_resumes_each_once(make_config, tmp_path, monkeypatch, one_thread):
    import jobs.parquet

    cfg = job_config(make_config, tmp_path)
    whole = tmp_path / "whole"
    whole.mkdir()
    generate_job(cfg, whole)
    rows = pq.read_table(whole / "generations.parquet").to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [
        ("r0", 0), ("r0", 1), ("r0", 2), ("r1", 0), ("r1", 1), ("r2", 0), ("r2", 1), ("r3", 0), ("r4", 0),
        ("r5", 0), ("r5", 1), ("r5", 2)]  # n per row, sampling.n where the row has none
    assert rows[7]["finish_reason"] == "error" and rows[7]["error"] == "n must be >= 1, got 0"
    assert all(r["output_tokens"] == 3 for r in rows if r["id"] != "r3")
    assert all(r["prompt"] == f"prompt {r['id'][1]}" for r in rows)
    summary = pq.read_table(whole / "summary.parquet").to_pylist()[0]
    assert summary["num_requests"] == 5 and summary["output_tokens"] == 3 * 11
    steps = pq.read_table(whole / "steps.parquet").to_pylist()  # a prompt is computed once, whatever its n
    assert sum(s["num_prefill_tokens"] + s["prefix_cache_hit_tokens"] for s in steps) == summary["prompt_tokens"]

    # the disk fills up after two parts; the run started again computes the rest, each sample once
    run = tmp_path / "run"
    run.mkdir()
    real_write, written = pq.write_table, []

    def write_table(table, where, **kwargs):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(table.select(["row", "sample_index"]).to_pylist())
        real_write(table, where, **kwargs)

    monkeypatch.setattr(jobs.parquet.pq, "write_table", write_table)
    with pytest.raises(JobError, match="No space left on device"):
        generate_job(cfg, run)
    monkeypatch.undo()
    first_rows = {r["row"] for part in written for r in part}
    generate_job(cfg, run)
    parts = [pq.read_table(p, columns=["row", "sample_index"]).to_pylist()
             for p in sorted(Path(run / "generations.parts").glob("part-*.parquet"))]
    saved = [(r["row"], r["sample_index"]) for part in parts for r in part]
    assert len(saved) == len(set(saved)) == len(rows)  # every sample saved exactly once
    assert all(len({r["row"] for r in part} & first_rows) == 0 for part in parts[2:])  # resumed rows not computed again
    assert pq.read_table(run / "generations.parquet").to_pylist() == rows  # the same as the run without a stop

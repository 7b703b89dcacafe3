"""The bench job: nano-vllm's workload reproduced exactly, the long and shared_prefix workloads as defined,
its JSON-schema constraints, and a run on CPU with its floor and the transformers baseline."""
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
import torch

from engine import LLM
from engine.errors import ConfigError
from engine.models.loader import build_model
from engine.sequence import SamplingParams
from engine.stats import floor_model, workload_floor_s
from jobs import JobError
from jobs.bench import JSON_SCHEMAS, hf_generate, run, workload
from jobs.config import BenchJob, validate

ROOT = Path(__file__).resolve().parents[1]


def test_nano_workload_is_nano_vllms():
    requests = workload(BenchJob(workload="nano"), SamplingParams(), vocab_size=151936)
    assert len(requests) == 256
    assert sum(len(p) for p, _ in requests) == 142_827  # the figures nano-vllm's bench.py produces
    assert sum(s.max_tokens for _, s in requests) == 133_966
    assert all(s.temperature == 0.6 and s.ignore_eos for _, s in requests)
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p, _ in requests)


def test_long_workload():
    sampling = SamplingParams(temperature=0.0, top_p=0.95, top_k=20)  # the run's settings but the temperature stay
    requests = workload(BenchJob(workload="long"), sampling, vocab_size=151936)
    assert len(requests) == 1024
    assert all(512 <= len(p) <= 3584 and 32 <= s.max_tokens <= 512 and 0 <= min(p) and max(p) < 10000 for p, s in requests)
    assert max(len(p) + s.max_tokens for p, s in requests) <= 4096
    assert all((s.temperature, s.top_p, s.top_k, s.ignore_eos) == (0.6, 0.95, 20, True) for _, s in requests)
    lengths = [len(p) for p, _ in requests]
    assert min(lengths) < 600 and max(lengths) > 3500  # spread over the range


def test_shared_prefix_workload_as_documented():
    requests = workload(BenchJob(workload="shared_prefix"), SamplingParams(top_p=0.9), vocab_size=257)
    rng = random.Random(0)  # jobs/bench.py's recipe: the prefix, then per request its suffix and output length
    prefix = [rng.randrange(10000) % 257 for _ in range(2048)]
    expected = []
    for _ in range(1024):
        suffix = [rng.randrange(10000) % 257 for _ in range(rng.randint(16, 256))]
        expected.append((tuple(prefix + suffix), rng.randint(32, 256)))
    assert [(p, s.max_tokens) for p, s in requests] == expected
    assert all(16 <= len(p) - 2048 <= 256 and 32 <= n <= 256 for p, n in expected)
    assert len({tuple(p) for p, _ in requests}) == 1024  # the suffixes make every prompt unique
    assert all((s.temperature, s.top_p, s.ignore_eos) == (0.6, 0.9, True) for _, s in requests)


def test_rollout_workload_as_documented():
    """512 prompts, each 16 samples at temperature 1.0 (the run's other settings kept), from random.Random(0):
    per request its prompt's length and tokens, then its output length."""
    requests = workload(BenchJob(workload="rollout"), SamplingParams(top_k=50, n=2), vocab_size=151936)
    rng = random.Random(0)
    expected = []
    for _ in range(512):
        prompt = [rng.randrange(10000) for _ in range(rng.randint(256, 1536))]
        expected.append((tuple(prompt), rng.randint(64, 512)))
    assert [(p, s.max_tokens) for p, s in requests] == expected
    assert all((s.n, s.temperature, s.top_k, s.ignore_eos) == (16, 1.0, 50, True) for _, s in requests)
    assert max(len(p) + n for p, n in expected) <= 4096


def test_json_schemas_constrain_the_same_requests_in_turn():
    plain = workload(BenchJob(workload="nano"), SamplingParams(), vocab_size=151936)
    constrained = workload(BenchJob(workload="nano", json_schemas=3), SamplingParams(), vocab_size=151936)
    assert [(p, dataclasses.replace(s, structured_outputs=None)) for p, s in constrained] == plain
    assert [json.loads(s.structured_outputs.json) for _, s in constrained] == [JSON_SCHEMAS[i % 3] for i in range(256)]
    for schema in JSON_SCHEMAS:  # valid schemas, each with free text of more items than any output has tokens
        jsonschema.Draft202012Validator.check_schema(schema)
        assert max(field.get("minItems", 0) for field in schema["properties"].values()) > 4096


@pytest.mark.skipif(torch.cuda.is_available(), reason="a float32 CPU run of the tiny model")
def test_bench_with_json_schemas_runs_every_request_to_its_max_tokens(tmp_path, make_config):
    overrides = ["job=bench", "job.num_prompts=8", "job.input_len=[8,40]", "job.output_len=[40,80]", "job.json_schemas=4"]
    result = subprocess.run([sys.executable, "-m", "engine.run", *overrides, f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    summary = pq.read_table(tmp_path / "summary.parquet").to_pylist()[0]
    requests = workload(make_config(*overrides).job, SamplingParams(), vocab_size=257)
    assert summary["output_tokens"] == sum(s.max_tokens for _, s in requests)  # the grammars kept them open
    assert 0 < summary["first_token_s"] <= summary["wall_time_s"]


@pytest.mark.parametrize("json_schemas", [-1, len(JSON_SCHEMAS) + 1])
def test_json_schemas_out_of_range_is_refused(make_config, json_schemas):
    with pytest.raises(ConfigError, match="job.json_schemas"):
        validate(make_config("job=bench", f"job.json_schemas={json_schemas}"))


@pytest.mark.parametrize("workload_name, longest", [("long", 4096), ("shared_prefix", 2560)])
def test_a_workload_longer_than_max_model_len_is_refused(make_config, workload_name, longest):
    cfg = make_config("job=bench", f"job.workload={workload_name}", "model.max_model_len=2048")
    with pytest.raises(JobError, match=f"requests of up to {longest} tokens .* need model.max_model_len >= {longest}, it is 2048"):
        run(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a float32 CPU run (on CUDA the bench runs in bf16)")
@pytest.mark.parametrize("penalty", ["sampling.repetition_penalty=1.0", "sampling.repetition_penalty=1.5"])
def test_bench_with_its_floor_and_the_transformers_baseline_on_the_tiny_model(tmp_path, make_config, penalty):
    """transformers draws with the run's settings (a repetition penalty too: it matched 0% when left out)."""
    overrides = ["job=bench", "job.num_prompts=6", "job.input_len=[8,40]", "job.output_len=[8,16]",
                 "sampling.temperature=0", penalty]
    result = subprocess.run(
        [sys.executable, "-m", "engine.run", *overrides, "job.baseline=hf", "job.hf_batch_size=4", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "MINIPAGED_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr
    summary = pq.read_table(tmp_path / "summary.parquet").to_pylist()[0]
    assert summary["num_requests"] == 6 and summary["device"] == "cpu"
    assert (tmp_path / "cache" / "device_rates.json").exists()
    # the floor of the same workload, from the run's rates: every request ran to its max_tokens (ignore_eos)
    cfg = make_config(*overrides)
    model, _ = build_model(cfg.model, torch.device("cpu"), torch.float32)
    requests = workload(cfg.job, SamplingParams(), model.arch.vocab_size)
    assert summary["output_tokens"] == sum(s.max_tokens for _, s in requests)
    floor = workload_floor_s([(p, s.max_tokens) for p, s in requests],
                             floor_model(model, summary["kv_budget_bytes"] // summary["kv_slots"]),
                             summary["copy_gb_per_s"] * 1e9, summary["matmul_tflop_per_s"] * 1e12)
    assert floor == pytest.approx({k: summary[k] for k in floor}) and summary["floor_s"] > 0
    assert summary["pct_of_floor"] > 0
    assert summary["pct_of_floor"] == pytest.approx(100 * summary["floor_s"] / summary["wall_time_s"])
    assert summary["speedup_vs_hf"] == summary["output_tok_per_s"] / summary["hf_output_tok_per_s"]
    # float32, greedy, same weights: transformers' padded batches give the same tokens as the engine
    assert summary["hf_match_first32_pct"] == 100.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a float32 CPU run (on CUDA the bench runs in bf16)")
def test_the_bench_floor_counts_every_sample(tmp_path, make_config):
    """sampling.n=2: each request's two samples are two rows of the floor, sharing their prompt; the engine
    is built for the 8 sequences (max_num_seqs)."""
    overrides = ["job=bench", "job.num_prompts=4", "job.input_len=[8,20]", "job.output_len=[4,8]", "sampling.n=2",
                 "sampling.temperature=0.8"]
    result = subprocess.run([sys.executable, "-m", "engine.run", *overrides, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "MINIPAGED_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    summary = pq.read_table(tmp_path / "summary.parquet").to_pylist()[0]
    cfg = make_config(*overrides)
    model, _ = build_model(cfg.model, torch.device("cpu"), torch.float32)
    requests = workload(cfg.job, SamplingParams(), model.arch.vocab_size)
    assert summary["output_tokens"] == 2 * sum(s.max_tokens for _, s in requests)
    floor = workload_floor_s([(p, s.max_tokens) for p, s in requests for _ in range(2)],
                             floor_model(model, summary["kv_budget_bytes"] // summary["kv_slots"]),
                             summary["copy_gb_per_s"] * 1e9, summary["matmul_tflop_per_s"] * 1e12)
    assert floor == pytest.approx({k: summary[k] for k in floor})
    assert summary["floor_prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert summary["max_num_seqs"] == 4 * 2


def test_keys_of_the_random_workload_set_for_a_fixed_one_are_warned_of(make_config, caplog):
    from jobs.bench import warn_unused_keys

    with caplog.at_level(logging.WARNING, logger="minipaged"):
        for overrides in (["job.workload=nano"], ["job.num_prompts=4"]):  # defaults, or the random workload's own
            cfg = make_config("job=bench", *overrides)
            warn_unused_keys(cfg.job, cfg.sampling)
        assert caplog.messages == []
        cfg = make_config("job=bench", "job.workload=nano", "job.num_prompts=4", "job.output_len=[2,4]")
        warn_unused_keys(cfg.job, cfg.sampling)
    assert caplog.messages == ["job.workload=nano has prompts and lengths of its own: job.num_prompts=4, "
                               "job.output_len=[2, 4] apply to job.workload=random only"]


@pytest.mark.parametrize("workload_name", ["random", "nano", "long", "rollout"])
def test_the_sampling_keys_a_workload_draws_itself_are_warned_of(make_config, caplog, workload_name):
    """The keys warned of are those whose configured value no request of the workload keeps (the oracle: the
    workload's own requests)."""
    from jobs.bench import warn_unused_keys

    configured = {"max_tokens": 3, "ignore_eos": False, "temperature": 0.25, "n": 2}
    cfg = make_config("job=bench", f"job.workload={workload_name}",
                      *(f"sampling.{k}={v}" for k, v in configured.items()))
    requests = workload(cfg.job, SamplingParams(**configured), 257)
    drawn = [k for k, v in configured.items() if all(getattr(s, k) != v for _, s in requests)]
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        warn_unused_keys(cfg.job, cfg.sampling)
    warned = ", ".join(f"sampling.{k}={configured[k]}" for k in drawn)
    assert caplog.messages[0] == (f"job.workload={workload_name} draws these settings of each request itself, so the "
                                  f"config's are not used: {warned}")


def test_the_baseline_takes_the_settings_transformers_shares_and_matches_only_what_it_can_draw():
    from jobs.bench import comparable, hf_sampling

    assert hf_sampling(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2)) == dict(
        do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2)
    assert hf_sampling(SamplingParams()) == dict(do_sample=False, temperature=None, top_k=None, top_p=None, min_p=None,
                                                 repetition_penalty=None)
    assert hf_sampling(SamplingParams(temperature=1.0)) == dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                                                min_p=None, repetition_penalty=None)  # both off
    assert comparable(SamplingParams(repetition_penalty=1.3))
    assert not comparable(SamplingParams(presence_penalty=0.5)) and not comparable(SamplingParams(temperature=1.0))


def test_the_transformers_baseline_runs_each_requests_n_samples(monkeypatch):
    """The baseline's workload is the run's: a request of n samples is n sequences of its prompt (in batches of
    job.hf_batch_size sequences), its tokens counted n times; the outputs compared are each request's first."""
    llm = LLM(model="tiny", max_model_len=64, device="cpu")
    requests = [((5, 6, 7), SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=1)),
                ((8, 9), SamplingParams(temperature=1.0, max_tokens=6, n=1, seed=2)),
                ((10,), SamplingParams(temperature=1.0, max_tokens=2, n=2, seed=3))]
    hf_model, rows = llm.hf_model(), []
    generate = hf_model.generate

    def recorded(**kwargs):
        out = generate(**kwargs)
        rows.extend(kwargs["input_ids"][:, -1].tolist())  # each sequence's last prompt token
        return out
    monkeypatch.setattr(hf_model, "generate", recorded)
    monkeypatch.setattr(llm, "hf_model", lambda: hf_model)
    _, outputs = hf_generate(llm, requests, batch_size=4)
    assert rows == [7, 7, 7, 9, 10, 10]
    assert [len(o) for o in outputs] == [4, 6, 2]

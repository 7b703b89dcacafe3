"""The workload's floor (engine/stats.py) against hand computations and a per-token transcription of its
definition, the model numbers it takes, and the device-rates cache (engine/hardware.py)."""
import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import hardware
from engine.hardware import device_rates
from engine.models.loader import build_model
from engine.stats import FloorModel, spread_prefix_hits, workload_floor_s
from jobs.bench import floor_model, floor_summary

# N = 100 non-embedding parameters, lm_head H = 10, 4-byte weights: a decode step reads (100 + 10) * 4 = 440
# bytes; 8 bytes of K/V a token; one layer, one query head of 2 dims: A = 4 * 1 * 1 * 2 = 8 FLOPs per query-key
SMALL = FloorModel(nonembed_params=100, lm_head_params=10, weight_bytes_per_step=440, kv_bytes_per_token=8,
                   num_layers=1, num_q_heads=1, head_dim=2)


def test_floor_by_hand():
    # request 1: P=3, nothing cached, O=2; request 2: P=4, 2 cached, O=3
    # prefill: r1 positions 0,1,2: 3 * 2N = 600, attention 8 * (1 + 2 + 3) = 48, logits 2H = 20 -> 668
    #          r2 positions 2,3:    2 * 2N = 400, attention 8 * (3 + 4) = 56,     logits 20     -> 476; 1144 FLOPs
    # decode tokens: r1 at position 3 (4 K/V entries); r2 at positions 4, 5 (5 and 6); steps = max(O) - 1 = 2
    # decode bytes: 2 * 440 + (4 + 5 + 6) * 8 = 1000; decode FLOPs: 3 tokens * 2 (N + H) = 660, + 8 * 15 = 780
    requests = [(3, 0, 2), (4, 2, 3)]
    # at 100 FLOP/s and 10 B/s: prefill 11.44 s; decode max(100 s of bytes, 7.8 s of FLOPs)
    assert workload_floor_s(requests, SMALL, 10.0, 100.0) == pytest.approx(
        {"floor_s": 111.44, "floor_prefill_s": 11.44, "floor_decode_bytes_s": 100.0, "floor_decode_flops_s": 7.8})
    # at 1000 B/s the decode FLOPs bound instead: 11.44 + max(1.0, 7.8)
    assert workload_floor_s(requests, SMALL, 1000.0, 100.0)["floor_s"] == pytest.approx(19.24)


def floor_token_by_token(requests, m: FloorModel, copy_rate: float, matmul_rate: float) -> float:
    """The docstring's definition, one position at a time."""
    attention = 4 * m.num_layers * m.num_q_heads * m.head_dim
    prefill = decode_flops = kv_bytes = 0
    for prompt_len, cached, output_len in requests:
        for pos in range(cached, prompt_len):
            prefill += 2 * m.nonembed_params + attention * (pos + 1)
        prefill += 2 * m.lm_head_params
        for pos in range(prompt_len, prompt_len + output_len - 1):
            decode_flops += 2 * (m.nonembed_params + m.lm_head_params) + attention * (pos + 1)
            kv_bytes += (pos + 1) * m.kv_bytes_per_token
    steps = max(o for _, _, o in requests) - 1
    return prefill / matmul_rate + max((steps * m.weight_bytes_per_step + kv_bytes) / copy_rate, decode_flops / matmul_rate)


request = st.integers(1, 60).flatmap(lambda p: st.tuples(st.just(p), st.integers(0, p - 1), st.integers(1, 40)))


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=6), st.sampled_from([1.0, 50.0, 1e4]))
def test_floor_matches_the_definition_token_by_token(requests, copy_rate):
    floor = workload_floor_s(requests, SMALL, copy_rate, 100.0)
    assert floor["floor_s"] == pytest.approx(floor_token_by_token(requests, SMALL, copy_rate, 100.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(request, min_size=1, max_size=6), st.integers(0, 5))
def test_floor_grows_with_the_work(requests, index):
    floor = workload_floor_s(requests, SMALL, 50.0, 100.0)["floor_s"]
    i = index % len(requests)
    prompt_len, cached, output_len = requests[i]
    more_output = requests[:i] + [(prompt_len, cached, output_len + 1)] + requests[i + 1:]
    longer_prompt = requests[:i] + [(prompt_len + 1, cached, output_len)] + requests[i + 1:]
    assert workload_floor_s(more_output, SMALL, 50.0, 100.0)["floor_s"] > floor
    assert workload_floor_s(longer_prompt, SMALL, 50.0, 100.0)["floor_s"] > floor
    assert workload_floor_s(requests + [(1, 0, 1)], SMALL, 50.0, 100.0)["floor_s"] > floor
    if cached > 0:
        assert workload_floor_s(requests[:i] + [(prompt_len, cached - 1, output_len)] + requests[i + 1:],
                                SMALL, 50.0, 100.0)["floor_s"] > floor
    assert workload_floor_s(requests, SMALL, 100.0, 200.0)["floor_s"] == pytest.approx(floor / 2)  # twice the rates


def test_prefix_hits_spread_over_the_requests():
    # an equal share of 60 is 20, but the 5-token prompt caps at 4: the two others share the other 56
    assert spread_prefix_hits([100, 5, 100], 60) == [28, 4, 28]
    assert spread_prefix_hits([100, 5, 100], 1000) == [99, 4, 99]  # never the last prompt token
    assert spread_prefix_hits([2060, 2100, 2050, 2300], 3 * 2048) == [1536] * 4
    assert spread_prefix_hits([7, 9], 0) == [0, 0]


def test_model_numbers_by_hand(make_config):
    # tiny: hidden 64, intermediate 128, 2 layers, 4 query heads and 2 kv heads of 16 dims, vocab 257.
    # A layer: qkv_proj 64 x (64 + 2 * 32) = 8192, o_proj 64 x 64 = 4096, q/k norms 2 x 16, gate_up_proj
    # 64 x 256 = 16384, down_proj 128 x 64 = 8192, two layer norms 2 x 64: 37024; 2 layers and the final
    # norm (64): 74112. lm_head 257 x 64 = 16448, tied to the embedding or not.
    for tied in ("true", "false"):
        cfg = make_config(f"model.tie_word_embeddings={tied}")
        model, _ = build_model(cfg.model, torch.device("cpu"), torch.float32)
        numbers = floor_model(model, kv_bytes_per_token=512)
        assert numbers == FloorModel(nonembed_params=74112, lm_head_params=16448,
                                     weight_bytes_per_step=(74112 + 16448) * 4, kv_bytes_per_token=512,
                                     num_layers=2, num_q_heads=4, head_dim=16)


def test_the_bench_floor_counts_only_uncached_prompt_tokens(make_config):
    model, _ = build_model(make_config().model, torch.device("cpu"), torch.float32)
    seqs = [SimpleNamespace(prompt_token_ids=[0] * 40, output_token_ids=[1] * 5),
            SimpleNamespace(prompt_token_ids=[0] * 36, output_token_ids=[1] * 9)]
    summary = {"kv_budget_bytes": 512 * 64, "kv_slots": 64, "wall_time_s": 2.0, "prefix_cache_hit_tokens": 64}
    columns = floor_summary(SimpleNamespace(model=model), seqs, summary, (1e9, 1e12))
    # 32 cached tokens each, at the front of the prompts: 8 and 4 computed positions
    expected = workload_floor_s([(40, 32, 5), (36, 32, 9)], floor_model(model, 512), 1e9, 1e12)
    assert columns == {**expected, "pct_of_floor": pytest.approx(50 * expected["floor_s"]),
                       "copy_gb_per_s": 1.0, "matmul_tflop_per_s": 1.0}
    without_cache = floor_summary(SimpleNamespace(model=model), seqs, {**summary, "prefix_cache_hit_tokens": 0}, (1e9, 1e12))
    assert without_cache["floor_prefill_s"] > columns["floor_prefill_s"]


# -- the device rates and their cache ------------------------------------------------------------------
@pytest.fixture
def measured(tmp_path, monkeypatch):
    """The cache in a temporary directory; measure() replaced by a counter of its calls."""
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(device, dtype):
        calls.append(dtype)
        return 1e9 * len(calls), 1e12 * len(calls)

    monkeypatch.setattr(hardware, "measure", fake_measure)
    return calls


def test_rates_are_measured_once_then_read_from_the_cache(tmp_path, measured):
    cpu = torch.device("cpu")
    assert device_rates(cpu, torch.float32) == (1e9, 1e12)
    assert device_rates(cpu, torch.float32) == (1e9, 1e12) and len(measured) == 1  # from the cache
    assert device_rates(cpu, torch.bfloat16) == (2e9, 2e12) and len(measured) == 2  # another dtype, another entry
    cache = json.loads((tmp_path / "device_rates.json").read_text())
    assert cache[hardware.device_key(cpu, torch.float32)] == {"copy_bytes_per_s": 1e9, "matmul_flop_per_s": 1e12}
    assert len(cache) == 2


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"KEY": {"copy_bytes_per_s": -1, "matmul_flop_per_s": 5}}'])
def test_a_corrupt_cache_is_measured_again_and_rewritten(tmp_path, measured, content):
    cpu = torch.device("cpu")
    (tmp_path / "device_rates.json").write_text(content.replace("KEY", hardware.device_key(cpu, torch.float32)))
    assert device_rates(cpu, torch.float32) == (1e9, 1e12) and len(measured) == 1
    assert device_rates(cpu, torch.float32) == (1e9, 1e12) and len(measured) == 1
    assert json.loads((tmp_path / "device_rates.json").read_text())[hardware.device_key(cpu, torch.float32)]["copy_bytes_per_s"] == 1e9


def test_measuring_on_the_cpu(monkeypatch):
    monkeypatch.setitem(hardware.SIZES, "cpu", (2**20, 64, 2))  # small: only that the figures are rates
    copy_rate, matmul_rate = hardware.measure(torch.device("cpu"), torch.float32)
    assert copy_rate > 0 and matmul_rate > 0

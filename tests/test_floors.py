"""The workload's floor (engine/stats.py) against hand computations and a per-token transcription of its
definition, the model numbers it takes, and the device-rates cache (engine/hardware.py)."""
import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import hardware
from engine.hardware import device_rates
from engine.models.loader import build_model
from engine.models.quantization import fp8_projections, store_fp8
from engine.sequence import SamplingParams
from engine.stats import FloorModel, expected_experts, floor_model, weight_reads_bytes, workload_floor_s
from jobs.bench import floor_summary

# N = 100 non-embedding parameters, lm_head H = 10, 4-byte weights: a forward pass reads (100 + 10) * 4 = 440
# bytes; 8 bytes of K/V a token; one layer, one query head of 2 dims: A = 4 * 1 * 1 * 2 = 8 FLOPs per query-key
SMALL = FloorModel(nonembed_params=100, lm_head_params=10, weight_bytes_per_step=440, kv_bytes_per_token=8,
                   num_layers=1, num_q_heads=1, head_dim=2)


def test_floor_by_hand():
    # row 1: prompt [1, 2, 3], O = 2; row 2: prompt [4, 5, 6, 7], O = 3; nothing shared
    # FLOPs: prefill 7 positions * 2N = 1400, attention 8 * ((1 + 2 + 3) + (1 + 2 + 3 + 4)) = 128, logits 2 * 2H = 40;
    #        decode 3 tokens * 2 (N + H) = 660, row 1's at position 3 (4 keys), row 2's at 4, 5: 8 * 15 = 120 -> 2348
    # bytes: max O = 3 passes * 440 = 1320; K/V read: row 1 3 prompt + 1 own, row 2 4 + 4 + (1 + 2) = 15 entries;
    #        written: 7 prompt + 3 decode = 10; (15 + 10) * 8 = 200 -> 1520
    rows = [([1, 2, 3], 2), ([4, 5, 6, 7], 3)]
    assert workload_floor_s(rows, SMALL, 10.0, 100.0) == pytest.approx(
        {"floor_s": 152.0, "floor_flops_s": 23.48, "floor_bytes_s": 152.0, "floor_prompt_tokens": 7,
         "floor_kv_read_tokens": 15})
    assert workload_floor_s(rows, SMALL, 1000.0, 100.0)["floor_s"] == pytest.approx(23.48)  # the FLOPs bound


def test_fp8_weights_take_the_fp8_rate_by_hand():
    """test_floor_by_hand's rows with 60 of N's 100 parameters in FP8: 2 * 60 FLOPs for each of the 7 prompt and 3
    decode positions (1200) go at the FP8 rate, the other 2348 - 1200 at the matmul rate; attention and the
    logits stay in the model's dtype."""
    rows = [([1, 2, 3], 2), ([4, 5, 6, 7], 3)]
    fp8 = dataclasses.replace(SMALL, fp8_params=60)
    assert workload_floor_s(rows, fp8, 1000.0, 100.0, 200.0)["floor_flops_s"] == pytest.approx(1148 / 100 + 1200 / 200)
    assert workload_floor_s(rows, fp8, 1000.0, 100.0)["floor_flops_s"] == pytest.approx(23.48)  # no FP8 rate given
    assert workload_floor_s(rows, SMALL, 1000.0, 100.0, 200.0)["floor_flops_s"] == pytest.approx(23.48)  # no FP8 weights


def test_the_samples_of_a_prompt_count_every_token_and_share_the_prompt():
    """n = 2: one prompt [1, 2, 3] drawn twice, outputs of 5 and 3 tokens (4 and 2 decode tokens).
    FLOPs: prefill once: 3 * 2N = 600, attention 8 * 6 = 48, logits once 20 = 668; decode 6 tokens * 220 = 1320,
    attention 8 * ((4 + 5 + 6 + 7) + (4 + 5)) = 248 -> 2236. Bytes: 5 passes * 440 = 2200; prompt K/V read by
    the longer sample's 4 steps: 3 * 4 = 12, own outputs 1 + 2 + 3 + 4 and 1 + 2: 13 -> 25 read; written 3 + 6;
    (25 + 9) * 8 = 272 -> 2472."""
    floor = workload_floor_s([([1, 2, 3], 5), ([1, 2, 3], 3)], SMALL, 1.0, 1.0)
    assert (floor["floor_flops_s"], floor["floor_bytes_s"], floor["floor_kv_read_tokens"]) == (2236, 2472, 25)
    alone = workload_floor_s([([1, 2, 3], 5)], SMALL, 1.0, 1.0)
    assert floor["floor_bytes_s"] > alone["floor_bytes_s"] and floor["floor_flops_s"] > alone["floor_flops_s"]


def test_two_prompts_sharing_a_prefix_read_it_once_a_step():
    """[1, 2, 3, 4, 5, 6] (O = 4: 3 decode tokens) and [1, 2, 3, 7, 8] (O = 6: 5): [1, 2, 3] is computed once and
    read by the 5 steps of the longer row; [4, 5, 6] by 3 steps, [7, 8] by 5. Prompt positions 3 + 3 + 2 = 8;
    attention keys (1 + 2 + 3) + (4 + 5 + 6) + (4 + 5) = 30; prompt K/V read 3 * 5 + 3 * 3 + 2 * 5 = 34."""
    rows = [([1, 2, 3, 4, 5, 6], 4), ([1, 2, 3, 7, 8], 6)]
    floor = workload_floor_s(rows, SMALL, 1.0, 1.0)
    # FLOPs: 8 * 200 + 8 * 30 + 2 * 20 = 1880; decode 8 tokens * 220 = 1760, attention 8 * ((7 + 8 + 9) + (6 + ... + 10))
    assert floor["floor_flops_s"] == 1880 + 1760 + 8 * (24 + 40)
    assert floor["floor_prompt_tokens"] == 8 and floor["floor_kv_read_tokens"] == 34 + 6 + 15
    # bytes: 6 passes * 440 + (55 read + 8 + 8 written) * 8
    assert floor["floor_bytes_s"] == 6 * 440 + (55 + 16) * 8


def floor_token_by_token(rows, m: FloorModel, copy_rate: float, matmul_rate: float) -> float:
    """The docstring's definition, one prefix at a time: each distinct prefix of a prompt (a node) is computed
    once and read by the decode steps of the row among those holding it that has the most."""
    attention = 4 * m.num_layers * m.num_q_heads * m.head_dim
    holders = {}
    for prompt, output_len in rows:
        for end in range(1, len(prompt) + 1):
            holders.setdefault(tuple(prompt[:end]), []).append(output_len - 1)
    flops = sum(2 * m.nonembed_params + attention * len(prefix) for prefix in holders)
    flops += 2 * m.lm_head_params * len({tuple(p) for p, _ in rows})
    kv = sum(max(decode) for decode in holders.values()) + len(holders)
    for prompt, output_len in rows:
        for pos in range(len(prompt), len(prompt) + output_len - 1):
            flops += 2 * (m.nonembed_params + m.lm_head_params) + attention * (pos + 1)
            kv += pos - len(prompt) + 1 + 1  # its own outputs so far, read; its own entry, written
    passes = max(o for _, o in rows)
    return max(flops / matmul_rate, (passes * m.weight_bytes_per_step + kv * m.kv_bytes_per_token) / copy_rate)


# prompts over a 3-token alphabet, often sharing prefixes (and sometimes equal: the samples of one prompt)
row = st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.integers(1, 30))


@settings(max_examples=80, deadline=None)
@given(st.lists(row, min_size=1, max_size=8), st.sampled_from([1.0, 50.0, 1e4]))
def test_floor_matches_the_definition_prefix_by_prefix(rows, copy_rate):
    floor = workload_floor_s(rows, SMALL, copy_rate, 100.0)
    assert floor["floor_s"] == pytest.approx(floor_token_by_token(rows, SMALL, copy_rate, 100.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(row, min_size=1, max_size=6), st.integers(0, 5))
def test_floor_grows_with_the_work_and_shrinks_with_sharing(rows, index):
    floor = workload_floor_s(rows, SMALL, 50.0, 100.0)["floor_s"]
    i = index % len(rows)
    prompt, output_len = rows[i]
    more_output = rows[:i] + [(prompt, output_len + 1)] + rows[i + 1:]
    assert workload_floor_s(more_output, SMALL, 50.0, 100.0)["floor_s"] >= floor
    assert workload_floor_s(rows + [([7] + prompt, 2)], SMALL, 50.0, 100.0)["floor_s"] > floor  # shares nothing
    unshared = [([9 + j] + p, o) for j, (p, o) in enumerate(rows)]  # no two prompts share a first token
    assert workload_floor_s(unshared, SMALL, 50.0, 100.0)["floor_s"] >= floor
    assert workload_floor_s(rows, SMALL, 100.0, 200.0)["floor_s"] == pytest.approx(floor / 2)  # twice the rates


# -- a mixture of experts: the experts a pass's rows route to -----------------------------------------------
# SMALL with 4 experts of 30 bytes (over every sparse layer), 2 a token: its 440 bytes hold 2 experts' 60
MOE = FloorModel(nonembed_params=100, lm_head_params=10, weight_bytes_per_step=440, kv_bytes_per_token=8,
                 num_layers=1, num_q_heads=1, head_dim=2, expert_bytes=30, num_experts=4, experts_per_token=2)


def test_expected_experts_against_random_routing():
    """E (1 - (1 - k/E)^B) against the mean distinct count of B tokens each drawing k of E experts at random."""
    generator = torch.Generator().manual_seed(0)
    for experts, k, tokens in [(4, 2, 1), (4, 2, 3), (8, 2, 5), (128, 8, 16), (128, 8, 64)]:
        picks = torch.rand(20000, tokens, experts, generator=generator).argsort(-1)[..., :k]
        touched = torch.zeros(20000, experts).scatter_(1, picks.reshape(20000, -1), 1.0).sum(1)
        assert expected_experts(tokens, experts, k) == pytest.approx(touched.mean().item(), rel=0.01)


def test_moe_floor_by_hand():
    """Rows of O = 3 and 1: pass 1 carries both rows, passes 2 and 3 one. Two tokens touch 4 (1 - 1/4) = 3
    experts, one more than one token's 2: weights 3 x 440 + 1 x 30 bytes; K/V as for SMALL."""
    rows = [([1, 2, 3], 3), ([4, 5], 1)]
    moe, dense = workload_floor_s(rows, MOE, 1.0, 1e9), workload_floor_s(rows, SMALL, 1.0, 1e9)
    assert moe["floor_bytes_s"] - dense["floor_bytes_s"] == pytest.approx(30.0)
    assert moe["floor_flops_s"] == dense["floor_flops_s"]  # each token multiplies its k experts either way


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(0, 6), st.randoms(use_true_random=False))
def test_no_schedule_touches_fewer_experts(outputs, spare_passes, random):
    """Any schedule (each row's O tokens in O distinct passes, in order, over max O + spare passes) expects at
    least weight_reads_bytes' experts: E[distinct] summed over its passes."""
    passes = max(outputs) + spare_passes
    carried = [0] * passes
    for o in outputs:
        for p in random.sample(range(passes), o):
            carried[p] += 1
    expected = sum(MOE.weight_bytes_per_step + MOE.expert_bytes * (expected_experts(b, 4, 2) - 2)
                   for b in carried if b)
    assert weight_reads_bytes(outputs, MOE) <= expected + 1e-9


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


def test_fp8_weights_counted_by_hand(make_config):
    """Projections stored in FP8 (as on a device with FP8 GEMMs) count as fp8_params, at a byte each: the tiny
    model's 8192 + 4096 + 16384 + 8192 = 36864 projection weights a layer of test_model_numbers_by_hand."""
    model, _ = build_model(make_config().model, torch.device("cpu"), torch.float32)
    for layer in model.model.layers:
        store_fp8(fp8_projections(layer))
    numbers = floor_model(model, kv_bytes_per_token=512)
    assert numbers.fp8_params == 2 * 36864 and numbers.nonembed_params == 74112
    assert numbers.weight_bytes_per_step == 2 * 36864 + (74112 - 2 * 36864 + 16448) * 4


def test_the_bench_floor_takes_every_finished_sample(make_config):
    """floor_summary over the output rows of the bench (two samples of one request, and another request) is
    workload_floor_s over their prompts and outputs."""
    model, _ = build_model(make_config().model, torch.device("cpu"), torch.float32)
    requests = [([0] * 40, SamplingParams(n=2)), ([2] * 36, SamplingParams())]
    rows = [{"row": 0, "output_tokens": 5}, {"row": 0, "output_tokens": 7}, {"row": 1, "output_tokens": 9}]
    columns = floor_summary(requests, rows, floor_model(model, 512), 2.0, (1e9, 1e12, 2e12))
    expected = workload_floor_s([([0] * 40, 5), ([0] * 40, 7), ([2] * 36, 9)], floor_model(model, 512), 1e9, 1e12)
    assert columns == {**expected, "pct_of_floor": pytest.approx(50 * expected["floor_s"]),
                       "copy_gb_per_s": 1.0, "matmul_tflop_per_s": 1.0, "fp8_matmul_tflop_per_s": None}
    assert columns["floor_prompt_tokens"] == 40 + 36


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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs need CUDA of compute capability 8.9+")
def test_the_fp8_rate_is_measured_apart(tmp_path, monkeypatch):
    """FP8's matmul rate is an entry of its own, measured with torch._scaled_mm."""
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(hardware.SIZES, "cuda", (2**24, 1024, 2))
    cuda = torch.device("cuda")
    assert min(device_rates(cuda, torch.float8_e4m3fn)) > 0 and min(device_rates(cuda, torch.bfloat16)) > 0
    assert len(json.loads((tmp_path / "device_rates.json").read_text())) == 2


def test_measuring_on_the_cpu(monkeypatch):
    monkeypatch.setitem(hardware.SIZES, "cpu", (2**20, 64, 2))  # small: only that the figures are rates
    copy_rate, matmul_rate = hardware.measure(torch.device("cpu"), torch.float32)
    assert copy_rate > 0 and matmul_rate > 0

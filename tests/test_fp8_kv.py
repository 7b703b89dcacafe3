"""An FP8 KV cache (cache.kv_cache_dtype): K and V stored in e4m3 or e5m2, unscaled, clamped to the type's
finite range (ops/paged_attention_reference.to_cache), and read back exactly by every attention op.

The oracle of a whole run is transformers' greedy generate with each layer's cache update rounding the keys
and values it stores (and attends over) to the same FP8 type: the engine on the CPU must give its tokens.
The kernels are checked against float64 oracles in tests/test_ops.py and tests/test_fused.py."""
import pytest
import torch
from transformers.cache_utils import DynamicLayer

from engine.config import engine_config
from engine.errors import ConfigError
from engine.kv_cache import bytes_per_block
from engine.llm import LLM, SamplingParams
from ops.paged_attention_reference import to_cache
from test_oracle import MAX_TOKENS, reference_outputs

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 6, 19, 45)]


def rounded_reference(hf_model, prompts, cache_dtype, monkeypatch):
    """transformers' greedy tokens with every layer's keys and values rounded to cache_dtype as stored."""
    update = DynamicLayer.update

    def rounding_update(self, key_states, value_states, *args, **kwargs):
        return update(self, to_cache(key_states, cache_dtype).to(key_states.dtype),
                      to_cache(value_states, cache_dtype).to(value_states.dtype), *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(DynamicLayer, "update", rounding_update)
        return reference_outputs(hf_model, prompts)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_greedy_over_an_fp8_cache_matches_transformers_over_rounded_keys_and_values(qwen3_checkpoint, prompts, name,
                                                                                     monkeypatch):
    path, hf_model = qwen3_checkpoint
    expected, gap = rounded_reference(hf_model, prompts, FP8[name], monkeypatch)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    if name == "fp8_e5m2":  # two mantissa bits: the rounding must show in the tokens, or the oracle is weak
        assert expected != reference_outputs(hf_model, prompts)[0], "FP8 rounding changed no token: a weak oracle"
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=4, kv_cache_dtype=name)
    assert llm.engine.kv_cache.key_caches[0].dtype == FP8[name]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_same_budget_holds_twice_the_slots_in_fp8(dtype):
    """kv_budget_gb // bytes_per_block, the block's bytes counted by hand: 2 (K, V) x layers x kv heads x
    block_size x head_dim x (2 bytes, or 1 in FP8)."""
    budget = 0.002
    slots = {}
    for cache_dtype in ("auto", "fp8"):
        llm = LLM(model="tiny", device="cpu", dtype=dtype, kv_budget_gb=budget, max_model_len=64, kv_cache_dtype=cache_dtype)
        spec, settings = llm.engine.model.kv_cache_spec, llm.settings()
        per_block = 2 * spec.num_layers * spec.num_kv_heads * settings.block_size * spec.head_dim * (2 if cache_dtype == "auto" else 1)
        assert per_block == bytes_per_block(spec, settings.block_size, llm.engine.kv_cache.key_caches[0].dtype)
        assert settings.num_blocks == int(budget * 1e9 // per_block)
        assert settings.kv_budget_bytes == settings.num_blocks * per_block
        slots[cache_dtype] = settings.kv_slots
    assert slots["fp8"] in (2 * slots["auto"], 2 * slots["auto"] + settings.block_size)


def test_an_unknown_kv_cache_dtype_is_named():
    with pytest.raises(ConfigError, match=r"cache.kv_cache_dtype must be one of .* \(did you mean fp8_e5m2\?\), got 'fp8_e5m3'"):
        engine_config("tiny", kv_cache_dtype="fp8_e5m3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device's compute capability")
def test_fp8_on_a_gpu_without_it_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"cache.kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later"):
        LLM(model="tiny", max_model_len=64, kv_cache_dtype="fp8")

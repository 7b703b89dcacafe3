"""Llama 3 and Qwen2 against transformers' own models on the same checkpoints (float32, greedy), the
loader's packed shards, the RoPE tables, the registry's errors and the weight footprint (the bench floor's)."""
import json
import re

import pytest
import torch
from conftest import draw_norm_weights
from test_oracle import engine_outputs, reference_outputs

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.models.decoder import WeightFootprint
from engine.models import loader
from engine.models.decoder import FOLDED_NORMS
from engine.models.loader import build_model, max_model_len_of, model_spec, to_hf_model, unpacked_state_dict
from engine.models.registry import MODELS
from engine.models.rope import Rope, inverse_frequencies, rope_from_config
from engine.tokenizer import byte_level_tokenizer

PROMPT_LENGTHS = (1, 3, 5, 17, 40, 63)
SUPPORTED = re.escape(f"(supported architectures: {', '.join(MODELS)})")  # the registry's, in its order
# llama3 scaling over a short original context, so that head_dim 16's frequencies fall in all three of its
# bands: kept (wavelength < 64 / 4), interpolated, divided by factor (wavelength > 64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama(**changes):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**dict(
        vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.2,
        tie_word_embeddings=False, rope_parameters=LLAMA3, eos_token_id=256, bos_token_id=None, pad_token_id=256),
        **changes})
    return LlamaForCausalLM(config)


def qwen2():
    """Qwen2.5-0.5B's head grouping (7 query heads a K/V head), tied head, q/k/v biases drawn non-zero."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=257, hidden_size=112, intermediate_size=192, num_hidden_layers=2, num_attention_heads=7,
        num_key_value_heads=1, max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=True,
        eos_token_id=256, bos_token_id=None, pad_token_id=256)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


MODELS = {"llama": lambda: draw_norm_weights(llama()), "qwen2": lambda: draw_norm_weights(qwen2())}


def save(model, path):
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    """(path, transformers' model, prompts, its greedy outputs) of a small random checkpoint."""
    torch.manual_seed(1234)
    hf_model = MODELS[request.param]().eval()
    path = save(hf_model, tmp_path_factory.mktemp(request.param))
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    outputs, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    return path, hf_model, prompts, outputs


@pytest.mark.parametrize("block_size, num_blocks", [(1, 96), (16, 6)])
def test_greedy_matches_transformers_with_preemption(make_config, checkpoint, block_size, num_blocks):
    path, _, prompts, expected = checkpoint
    config = make_config(f"model.path={path}", "model.max_model_len=96", "model.device=auto",  # a pool's worth
                         "model.dtype=float32", f"cache.block_size={block_size}", f"cache.num_blocks={num_blocks}",
                         "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=16",
                         "scheduler.admission_headroom=0", "cache.check_invariants=true")  # admissions fill the pool
    outputs, engine = engine_outputs(config, prompts)
    assert sum(s.preemptions for s in engine.stats.steps) > 0, "the pool was meant to force preemption"
    assert outputs == expected


def test_to_hf_model_is_transformers_model_with_our_weights(make_config, checkpoint):
    path, hf_model, prompts, _ = checkpoint
    model, _ = build_model(make_config(f"model.path={path}").model, torch.device("cpu"), torch.float32)
    ours = to_hf_model(model)
    assert type(ours) is type(hf_model)
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():  # the same function up to rounding: ours holds each norm's weight in the projection after it
        torch.testing.assert_close(ours(ids).logits, hf_model(ids).logits, rtol=1e-4, atol=1e-4)
    norm, projection = ours.model.layers[0].input_layernorm.weight, ours.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(norm, torch.ones_like(norm))
    theirs = hf_model.model.layers[0]
    assert torch.equal(projection, theirs.self_attn.q_proj.weight * theirs.input_layernorm.weight)


def test_loader_places_shards_by_mapping_when_gate_up_has_qkv_size(make_config, tmp_path):
    # q 4 x 16 + k, v 2 x 16 each = 128 rows, and gate + up 2 x 64 = 128 rows: shapes cannot tell them apart
    torch.manual_seed(0)
    hf_model = llama(intermediate_size=64)
    model, _ = build_model(make_config(f"model.path={save(hf_model, tmp_path)}").model, torch.device("cpu"),
                           torch.float32)
    mlp = model.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(mlp[64:], hf_model.model.layers[1].mlp.up_proj.weight)
    theirs, ours = hf_model.state_dict(), unpacked_state_dict(model)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 500000.0}, LLAMA3])
def test_rope_frequencies_are_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaRotaryEmbedding(llama(rope_parameters=rope).config)
    assert torch.equal(inverse_frequencies(rope_from_config({"rope_parameters": rope}, "x"), 16), hf.inv_freq)


def test_rope_of_every_config_format():
    # transformers 5 (rope_parameters), earlier checkpoints (rope_theta and rope_scaling, "type" before "rope_type")
    scaling = {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}
    expected = Rope(10000.0, "llama3", 4.0, 1.0, 4.0, 64)
    assert rope_from_config({"rope_parameters": LLAMA3}, "x") == expected
    assert rope_from_config({"rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}, "x") == expected
    assert rope_from_config({"rope_theta": 10000.0, "rope_scaling": {"type": "llama3", **scaling}}, "x") == expected
    assert rope_from_config({"rope_theta": 5.0, "rope_scaling": None}, "x") == Rope(5.0)
    assert rope_from_config({}, "x") == Rope(10000.0)  # transformers' default
    with pytest.raises(ConfigError, match=r"^x: rope_type 'llama3' needs low_freq_factor, original_max_position"):
        rope_from_config({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "x")
    with pytest.raises(ConfigError, match=r"^x: rope_type 'llama3' needs positive numbers .* high_freq_factor=1.0"):
        rope_from_config({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}}, "x")


@pytest.mark.parametrize("overrides, message", [
    (["model.architecture=MistralForCausalLM"], r"^model: architecture 'MistralForCausalLM' is not supported " + SUPPORTED),
    (["model.rope_type=yarn"], r"^model: rope_type 'yarn' is not supported \(supported: default, llama3\)"),
    (["model.num_attention_heads=3"], r"^model: num_attention_heads 3 is not a multiple of num_key_value_heads 2"),
])
def test_unsupported_random_weights_are_named(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_model(make_config(*overrides).model, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": None, "model_type": "mistral"},
     r"model_type 'mistral' \(and no architectures\) is not supported " + SUPPORTED),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"rope_type 'yarn' is not supported \(supported: default, llama3\)"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, r"use_sliding_window is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(only 'silu'\)"),
])
def test_unsupported_checkpoints_are_named(make_config, tmp_path, changes, message):
    torch.manual_seed(0)
    path = save(llama(), tmp_path / "ckpt")
    config = {**json.loads((path / "config.json").read_text()), **changes}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ConfigError, match=r"^model.path: .*config.json: " + message):
        build_model(make_config(f"model.path={path}").model, torch.device("cpu"), torch.float32)


def test_a_tensor_without_a_place_is_named(make_config, tmp_path):
    # a Qwen2 checkpoint (q/k/v biases) read as Llama (none): the biases must not be dropped silently
    torch.manual_seed(0)
    path = save(qwen2(), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"holds model.layers.0.self_attn.[qkv]_proj.bias, which LlamaForCausalLM"):
        build_model(make_config(f"model.path={path}").model, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("tied", ["false", "true"])
def test_random_weights_are_one_seeded_draw_in_parameter_order(make_config, tied):
    """build_model draws part by part; the weights are those of one generator run over a whole model's
    parameters in order, norms one and biases zero (the folded norms, ones, change no projection)."""
    cfg = make_config("model.num_hidden_layers=3", f"model.tie_word_embeddings={tied}").model
    model, _ = build_model(cfg, torch.device("cpu"), torch.float32)
    cls, arch, _ = model_spec(cfg, None)
    generator, expected = torch.Generator().manual_seed(cfg.seed), {}
    for name, param in cls(arch, max_model_len_of(cfg)[0]).named_parameters():
        expected[name] = torch.ones(param.shape) if "norm" in name else torch.zeros(param.shape) \
            if name.endswith("bias") else torch.randn(param.shape, generator=generator) * cfg.initializer_range
    actual = dict(model.named_parameters())
    folded = {f"model.layers.{i}.{norm}.weight" for i in range(3) for norm in FOLDED_NORMS}
    assert set(actual) == set(expected) - folded
    for name, tensor in actual.items():
        assert torch.equal(tensor, expected[name]), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (tied == "true")


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_the_build_holds_one_part_in_float32_at_a_time(make_config, monkeypatch, quantization):
    """While build_model draws a part's weights, the parts before it are finished (in the run's dtype) and
    the parts after it have no storage yet (meta): a build needs one part's float32 beyond the model."""
    parts_of, draw, states, built = loader.model_parts, loader.init_random_weights, [], {}

    def kind(module):
        param = next(module.parameters())
        return "meta" if param.is_meta else param.dtype

    def recording_parts(model):
        built["parts"] = parts_of(model)
        return built["parts"]

    def recording_draw(part, *args):
        states.append([kind(module) for _, module in built["parts"]])
        draw(part, *args)

    monkeypatch.setattr(loader, "model_parts", recording_parts)
    monkeypatch.setattr(loader, "init_random_weights", recording_draw)
    cfg = make_config("model.num_hidden_layers=3", f"model.quantization={quantization}").model
    model, _ = build_model(cfg, torch.device("cpu"), torch.bfloat16)
    count = len(built["parts"])
    assert states == [[torch.bfloat16] * k + [torch.float32] + ["meta"] * (count - k - 1) for k in range(count)]
    assert all(not tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    assert model.model.rotary.cos.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the allocator's peak)")
def test_an_fp8_build_peaks_at_a_few_parts_beyond_the_model(make_config):
    """model.quantization=fp8 on CUDA in bfloat16: the allocator's peak exceeds the finished model by at
    most three times its largest part in float32 (a layer in float32, its FP8 copy, its bfloat16 cast and
    the rounding's temporaries); a model built whole in float32 first would exceed it by ~3 bytes a weight."""
    cfg = make_config("model.num_hidden_layers=16", "model.hidden_size=512", "model.intermediate_size=1536",
                      "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.head_dim=64",
                      "model.quantization=fp8").model
    cls, arch, _ = model_spec(cfg, None)
    with torch.device("meta"):
        layout = cls(arch, max_model_len_of(cfg)[0])
    largest = max(sum(p.numel() for p in part.parameters()) * 4 for _, part in loader.model_parts(layout))
    device = torch.device("cuda")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model, _ = build_model(cfg, device, torch.bfloat16)
    finished = torch.cuda.memory_allocated(device) - before
    peak = torch.cuda.max_memory_allocated(device) - before
    whole_fp32 = sum(p.numel() for p in layout.parameters()) * 4
    assert peak - finished <= 3 * largest + (8 << 20) < whole_fp32 - finished
    del model


@pytest.mark.parametrize("architecture, tied, nonembed", [
    # the tiny shape: a layer's qkv_proj 64 x 128 = 8192, o_proj 4096, gate_up_proj 16384, down_proj 8192, two
    # norms 128: 36992; Qwen2 adds q/k/v biases (128), Qwen3 the q/k norms (32). Two layers and the final norm (64).
    ("LlamaForCausalLM", "false", 2 * 36992 + 64),
    ("Qwen2ForCausalLM", "true", 2 * (36992 + 128) + 64),
    ("Qwen3ForCausalLM", "false", 2 * (36992 + 32) + 64),
])
def test_weight_footprint_by_hand(make_config, architecture, tied, nonembed):
    cfg = make_config(f"model.architecture={architecture}", f"model.tie_word_embeddings={tied}")
    model, _ = build_model(cfg.model, torch.device("cpu"), torch.float32)
    assert model.weight_footprint() == WeightFootprint(
        nonembed_params=nonembed, lm_head_params=257 * 64, bytes_per_step=(nonembed + 257 * 64) * 4)


@pytest.mark.parametrize("name, architecture, params", [
    ("llama-3.2-1b", "LlamaForCausalLM", 1_235_814_400), ("qwen2.5-0.5b", "Qwen2ForCausalLM", 494_032_768),
    ("qwen3-8b", "Qwen3ForCausalLM", 8_190_735_360), ("llama-3.3-70b", "LlamaForCausalLM", 70_553_706_496),
    # by hand: embedding and untied head 2 x 151,936 x 2,048; 48 layers of attention (2,048 x 4,096 q and o,
    # 2,048 x 512 k and v, 2 x 128 QK-norm), router 128 x 2,048, 128 experts of 3 x 2,048 x 768, two norms of
    # 2,048; the final norm 2,048
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 2 * 151_936 * 2_048 + 48 * (
        2 * 2_048 * 4_096 + 2 * 2_048 * 512 + 256 + 128 * 2_048 + 128 * 3 * 2_048 * 768 + 2 * 2_048) + 2_048)])
def test_model_configs_have_the_published_sizes(make_config, name, architecture, params):
    cls, arch, _ = model_spec(make_config(f"model={name}").model, None)
    assert cls.__name__ == architecture
    with torch.device("meta"):
        model = cls(arch, max_positions=16)
    assert sum(p.numel() for p in model.parameters()) == params


def test_a_text_prompt_gets_the_special_tokens_its_tokenizer_adds(tmp_path):
    """As vLLM's generate: a text prompt is tokenized with the tokenizer's special tokens, so a Llama checkpoint
    whose tokenizer puts <|begin_of_text|> first runs the prompt after it; the greedy tokens are transformers'
    on the same ids."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = byte_level_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.add_special_tokens(["<|begin_of_text|>"])
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 257)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|endoftext|>")
    model = draw_norm_weights(llama(vocab_size=258, bos_token_id=257))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = AutoTokenizer.from_pretrained(tmp_path)("Hello there").input_ids
    assert ids[0] == 257 and len(ids) == len("Hello there") + 1
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64)
    out = llm.generate("Hello there", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    llm.close()
    assert out.prompt_token_ids == ids
    expected = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()

"""FP8 weights (engine/models/quantization.py): checkpoints in Qwen's block-scaled format and in
compressed-tensors' per-channel format, and model.quantization=fp8, against transformers running the
weights they round to in float32.

The checkpoints are written here from the session's tiny Qwen3: each projection of its layers quantized to
e4m3 by this file's own rounding (block or row scales = amax / 448), with the scale tensors each format
names. The oracle is transformers' greedy generate with every such weight replaced by q * scale (the
product of an e4m3 value and a float32 scale is exact in float64, so its float32 rounding is the loader's
float32 product); the engine loads the FP8 files and must give the same tokens."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ConfigError
from engine.llm import LLM, SamplingParams
from test_oracle import MAX_TOKENS, reference_outputs

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (32, 40)  # not a divisor of the tiny model's sizes (96, 48, 192): partial blocks at the edges
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
COMPRESSED_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                              "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "dynamic": True}}}}


def block_quantized(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale float32 [ceil(out / rows), ceil(in / cols)]), block by block, in float64."""
    out, columns = weight.shape
    scale = torch.zeros(-(-out // rows), -(-columns // cols), dtype=torch.float64)
    q = torch.zeros(out, columns, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].double()
            scale[i, j] = block.abs().max() / 448
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale.float()


def block_dequantized(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    expanded = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            expanded[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = scale[i, j].double()
    return (q.double() * expanded).float()


def row_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale float32 [out, 1]): one scale per row."""
    scale = (weight.double().abs().amax(dim=1, keepdim=True) / 448).float()
    return (weight.double() / scale.double()).to(torch.float8_e4m3fn), scale


def fp8_checkpoint(base, directory, quantization_config: dict, quantize, dequantize):
    """base's checkpoint with its projections in FP8 (quantize: weight -> (q, scale)), its config.json
    carrying quantization_config; returns (directory, transformers' model on the rounded weights)."""
    path, hf_model = base
    shutil.copytree(path, directory)
    state = {k: v.clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    rounded = dict(state)
    suffix = "weight_scale_inv" if quantization_config["quant_method"] == "fp8" else "weight_scale"
    for name in [k for k in state if k.endswith("weight") and k.split(".")[-2] in PROJECTIONS]:
        q, scale = quantize(state[name])
        state[name], state[name.removesuffix("weight") + suffix] = q, scale
        rounded[name] = dequantize(q, scale)
    for file in directory.glob("*.safetensors"):
        file.unlink()
    save_file(state, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return directory, rounded_model(hf_model, rounded)


def rounded_model(hf_model, weights: dict):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(hf_model.config).eval()
    model.load_state_dict(weights, strict=False)  # lm_head is tied to the embedding
    return model


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 6, 19, 33)]


def engine_tokens(path, prompts, **options) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=4, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def check_greedy_matches(path, rounded, prompts, original, **options):
    expected, gap = reference_outputs(rounded, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    assert expected != reference_outputs(original, prompts)[0], "FP8 rounding changed no token: a weak oracle"
    assert engine_tokens(path, prompts, **options) == expected


def test_qwen_block_scaled_fp8_checkpoint_matches_transformers_on_its_weights(qwen3_checkpoint, tmp_path, prompts):
    path, rounded = fp8_checkpoint(qwen3_checkpoint, tmp_path / "fp8", QWEN_FP8, lambda w: block_quantized(w, *BLOCK),
                                   lambda q, s: block_dequantized(q, s, *BLOCK))
    check_greedy_matches(path, rounded, prompts, qwen3_checkpoint[1])


def test_compressed_tensors_per_channel_checkpoint_matches_transformers_on_its_weights(qwen3_checkpoint, tmp_path,
                                                                                        prompts):
    path, rounded = fp8_checkpoint(qwen3_checkpoint, tmp_path / "ct", COMPRESSED_FP8, row_quantized,
                                   lambda q, s: (q.double() * s.double()).float())
    check_greedy_matches(path, rounded, prompts, qwen3_checkpoint[1])


def test_quantization_fp8_rounds_the_projections_on_load(qwen3_checkpoint, prompts):
    path, hf_model = qwen3_checkpoint
    weights = dict(hf_model.state_dict())
    for name in [k for k in weights if k.endswith("weight") and k.split(".")[-2] in PROJECTIONS]:
        q, scale = row_quantized(weights[name])
        weights[name] = (q.double() * scale.double()).float()
    check_greedy_matches(path, rounded_model(hf_model, weights), prompts, hf_model, quantization="fp8")


def test_random_weights_take_quantization_fp8():
    plain = LLM(model="tiny", device="cpu", max_model_len=64)
    fp8 = LLM(model="tiny", device="cpu", max_model_len=64, quantization="fp8")
    for ours, theirs in zip(plain.hf_model().model.layers, fp8.hf_model().model.layers):
        weight, rounded = ours.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight
        q, scale = row_quantized(weight)
        assert torch.equal(rounded, (q.double() * scale.double()).float()) and not torch.equal(rounded, weight)


@pytest.mark.parametrize("damage, message", [
    (lambda cfg, state: cfg.update(quantization_config={"quant_method": "awq"}),
     r"quantization_config.quant_method 'awq' is not read here"),
    (lambda cfg, state: state.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2)}),
     r"holds model.layers.0.self_attn.q_proj.weight_scale_inv, which has shape \(2, 2\); a \(32, 40\) block scale "
     r"of a 96 x 96 weight has shape \(3, 3\)"),
    (lambda cfg, state: state.pop("model.layers.1.mlp.down_proj.weight_scale_inv"),
     r"holds model.layers.1.mlp.down_proj.weight in torch.float8_e4m3fn without its scale "
     r"model.layers.1.mlp.down_proj.weight_scale_inv"),
    (lambda cfg, state: cfg.pop("quantization_config"), r"holds model.layers.0.* in torch.float8_e4m3fn, but config.json "
                                                        r"has no quantization_config"),
    (lambda cfg, state: cfg.update(quantization_config={**QWEN_FP8, "weight_block_size": [128]}),
     r"quantization_config.weight_block_size must be \[rows, columns\]"),
])
def test_a_broken_fp8_checkpoint_is_named(qwen3_checkpoint, tmp_path, prompts, damage, message):
    path, _ = fp8_checkpoint(qwen3_checkpoint, tmp_path / "fp8", QWEN_FP8, lambda w: block_quantized(w, *BLOCK),
                             lambda q, s: block_dequantized(q, s, *BLOCK))
    state, config = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    damage(config, state)
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu")


def test_an_unknown_quantization_is_named():
    with pytest.raises(ConfigError, match=r"model.quantization must be null or one of \(.fp8.,\), got .int4."):
        LLM(model="tiny", device="cpu", quantization="int4")

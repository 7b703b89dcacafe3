"""Build the Qwen3 of engine/models/qwen3.py: from a Hugging Face checkpoint directory, or with seeded
random weights of the configured shape (the embedded default and the benchmarks)."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ConfigError
from engine.models.qwen3 import Qwen3Arch, Qwen3ForCausalLM

# Hugging Face parameter -> (our fused parameter, shard index) for the fused projections.
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def arch_from_model_config(model_cfg) -> Qwen3Arch:
    return Qwen3Arch(**{f: model_cfg[f] for f in Qwen3Arch.__dataclass_fields__ if f in model_cfg})


def arch_from_checkpoint(path: Path) -> tuple[Qwen3Arch, list[int]]:
    """The architecture and EOS ids from a checkpoint's config.json."""
    config = json.loads((path / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 1000000.0))
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"model.path: rope_type {rope['rope_type']!r} is not supported (only 'default')")
    heads = config["num_attention_heads"]
    arch = Qwen3Arch(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads, rope_theta=theta,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", False),
    )
    eos = config.get("eos_token_id")
    return arch, ([] if eos is None else [eos] if isinstance(eos, int) else list(eos))


def check_checkpoint(path: Path) -> None:
    if not path.is_dir():
        raise ConfigError(f"model.path {str(path)!r} is not a directory")
    missing = [what for what, ok in (
        ("config.json", (path / "config.json").is_file()),
        ("*.safetensors weights", any(path.glob("*.safetensors"))),
        ("tokenizer files (tokenizer.json or tokenizer_config.json)",
         (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()),
    ) if not ok]
    if missing:
        raise ConfigError(f"model.path {str(path)!r} lacks {', '.join(missing)}")


def load_weights(model: Qwen3ForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    loaded = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target, shard = _target(name)
                if target not in params:
                    continue  # e.g. lm_head.weight of a tied checkpoint
                _copy_shard(params[target], f.get_tensor(name), shard, model)
                loaded.add(target)
    missing = set(params) - loaded
    if missing:
        raise ConfigError(f"model.path {str(path)!r}: weights missing for {sorted(missing)[:5]}")


def _target(hf_name: str) -> tuple[str, int | None]:
    for hf_part, (ours, shard) in FUSED.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(hf_part, ours), shard
    return hf_name, None


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, model: Qwen3ForCausalLM) -> None:
    with torch.no_grad():
        if shard is None:
            param.copy_(tensor)
            return
        attn = model.model.layers[0].self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size] if param.shape[0] == attn.q_size + 2 * attn.kv_size \
            else [param.shape[0] // 2] * 2
        start = sum(sizes[:shard])
        param[start:start + sizes[shard]].copy_(tensor)


def init_random_weights(model: Qwen3ForCausalLM, seed: int, std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_model(model_cfg, device: torch.device, dtype: torch.dtype) -> tuple[Qwen3ForCausalLM, list[int]]:
    """The model on `device` in `dtype`, and its EOS token ids."""
    if model_cfg.path:
        path = Path(model_cfg.path)
        check_checkpoint(path)
        arch, eos = arch_from_checkpoint(path)
    else:
        arch, eos = arch_from_model_config(model_cfg), [model_cfg.eos_token_id]
    model = Qwen3ForCausalLM(arch, model_cfg.max_model_len)
    if model_cfg.path:
        load_weights(model, Path(model_cfg.path))
    else:
        init_random_weights(model, model_cfg.seed, model_cfg.initializer_range)
    return model.requires_grad_(False).to(device=device, dtype=dtype).eval(), eos


def to_hf_model(model: Qwen3ForCausalLM):
    """transformers' Qwen3ForCausalLM with this model's weights (unfused), on its device and dtype."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    arch, weight = model.arch, model.lm_head.weight
    config = Qwen3Config(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings, attention_bias=arch.attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        max_position_embeddings=model.model.rotary.cos.shape[0],
    )
    hf_model = HFQwen3(config).to(device=weight.device, dtype=weight.dtype).eval()
    hf_model.load_state_dict(unfused_state_dict(model), strict=not arch.tie_word_embeddings)
    return hf_model


def unfused_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face's names, fused projections split back."""
    attn = model.model.layers[0].self_attn
    sizes = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
             "gate_up_proj": [model.arch.intermediate_size] * 2}
    parts = {fused: [hf for hf, (f, _) in FUSED.items() if f == fused] for fused in sizes}
    state = {}
    for name, tensor in model.state_dict().items():
        fused = next((f for f in sizes if f".{f}." in name), None)
        if fused is None:
            state[name] = tensor
            continue
        for hf_part, piece in zip(parts[fused], tensor.split(sizes[fused])):
            state[name.replace(fused, hf_part)] = piece
    return state

"""Build the Qwen3 of engine/models/qwen3.py: from a Hugging Face checkpoint (a directory, or a hub id
resolved to its snapshot in the local hub cache), or with seeded random weights of the configured shape
(the embedded default and the benchmarks)."""
import functools
import json
import math
from pathlib import Path

import torch
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, \
    RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open

from engine.config import ConfigError
from engine.models.qwen3 import Qwen3Arch, Qwen3ForCausalLM

# What a hub snapshot needs: config.json, generation_config.json, the weights (and their index), tokenizer files.
HUB_FILES = ["*.json", "*.safetensors", "merges.txt", "tokenizer.model", "*.jinja"]
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
COUNT_KEYS = (*SHAPE_KEYS, "num_key_value_heads", "head_dim")  # positive integers where present
SCALE_KEYS = ("rope_theta", "rms_norm_eps")  # positive finite numbers where present

# Hugging Face parameter -> (our fused parameter, shard index) for the fused projections.
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def arch_from_model_config(model_cfg) -> Qwen3Arch:
    return Qwen3Arch(**{f: model_cfg[f] for f in Qwen3Arch.__dataclass_fields__ if f in model_cfg})


def resolve_model_path(model_cfg) -> Path | None:
    """model.path as a local checkpoint directory; None for random weights. A path that is not a directory
    but reads as a Hugging Face id (org/name) is that model's snapshot in the hub cache (HF_HUB_CACHE),
    downloaded first where the network allows; offline (HF_HUB_OFFLINE=1) or unreachable, the cached one."""
    if not model_cfg.path:
        return None
    path = Path(model_cfg.path).expanduser()
    if path.is_dir():
        return path
    if not _is_hub_id(model_cfg.path):
        raise ConfigError(f"model.path {model_cfg.path!r} is not a directory (nor a Hugging Face id, org/name)")
    return _hub_snapshot(model_cfg.path, str(constants.HF_HUB_CACHE))


def _is_hub_id(text: str) -> bool:
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.count("/") == 1


@functools.cache
def _hub_snapshot(repo_id: str, cache_dir: str) -> Path:
    """Once per process and cache: online, each call asks the Hub for the newest commit."""
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=HUB_FILES))
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(f"model.path {repo_id!r} is not a directory, and the Hugging Face Hub has no model {repo_id!r} "
                          f"that this machine may read (a gated or private one needs `hf auth login`)") from None
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
        raise ConfigError(f"model.path {repo_id!r} is neither a directory nor in the local Hugging Face cache "
                          f"({cache_dir}), and {reason}: download it first, where the network is reachable, with "
                          f"`hf download {repo_id}`, or set HF_HUB_CACHE to a cache that holds it") from None
    except OSError as err:  # HTTP errors too
        raise ConfigError(f"model.path {repo_id!r}: downloading it from the Hugging Face Hub failed: {err}") from None


def read_checkpoint_config(path: Path) -> dict:
    """A checkpoint's config.json: a JSON object with a Qwen3's shape keys, else ConfigError."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"model.path: {file} is not valid JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"model.path: cannot read {file} ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.path: {file} holds a JSON {type(config).__name__}, not an object")
    if config.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"model.path: {file} describes a {config['model_type']!r} model; only qwen3 is supported")
    missing = [key for key in SHAPE_KEYS if key not in config]
    if missing:
        raise ConfigError(f"model.path: {file} lacks {', '.join(missing)}")
    bad = [f"{key}={config[key]!r}" for key in (*COUNT_KEYS, *SCALE_KEYS)
           if config.get(key) is not None and not _positive(config[key], int if key in COUNT_KEYS else float)]
    if bad:
        raise ConfigError(f"model.path: {file} has impossible values: {', '.join(bad)}")
    return config


def _positive(value, kind: type) -> bool:
    """A positive int (kind int) or a positive finite number (kind float); a bool is neither."""
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return value > 0 and math.isfinite(value)


def arch_from_checkpoint(path: Path) -> tuple[Qwen3Arch, list[int]]:
    """The architecture and EOS ids from a checkpoint's config.json."""
    config = read_checkpoint_config(path)
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
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    target, shard = _target(name)
                    if target not in params:
                        continue  # e.g. lm_head.weight of a tied checkpoint
                    tensor = f.get_tensor(name)
                    if not _copy_shard(params[target], tensor, shard, model):
                        raise ConfigError(f"model.path: {file} holds {name} of shape {tuple(tensor.shape)}, which "
                                          f"does not fit the shape config.json gives the model")
                    loaded.add(target)
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"model.path: cannot read the weights in {file} ({err})") from None
    missing = set(params) - loaded
    if missing:
        raise ConfigError(f"model.path {str(path)!r}: weights missing for {sorted(missing)[:5]}")


def _target(hf_name: str) -> tuple[str, int | None]:
    for hf_part, (ours, shard) in FUSED.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(hf_part, ours), shard
    return hf_name, None


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, model: Qwen3ForCausalLM) -> bool:
    """Copy `tensor` into its place in `param`; False, copying nothing, if the shapes differ."""
    with torch.no_grad():
        if shard is not None:
            attn = model.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size] if param.shape[0] == attn.q_size + 2 * attn.kv_size \
                else [param.shape[0] // 2] * 2
            start = sum(sizes[:shard])
            param = param[start:start + sizes[shard]]
        if param.shape != tensor.shape:
            return False
        param.copy_(tensor)
        return True


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
    path = resolve_model_path(model_cfg)
    if path:
        check_checkpoint(path)
        arch, eos = arch_from_checkpoint(path)
    else:
        arch, eos = arch_from_model_config(model_cfg), [model_cfg.eos_token_id]
    model = Qwen3ForCausalLM(arch, model_cfg.max_model_len)
    if path:
        load_weights(model, path)
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

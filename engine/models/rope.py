"""Rotary position embeddings: the RoPE a config.json asks for, and its cos/sin tables.

ops.rope_and_write_kv_cache applies the tables as x*cos + rotate_half(x)*sin. The inverse frequencies are
computed with transformers' operations for the same rope_type, so the float32 tables are theirs bit for bit:
    default  inv_freq[i] = 1 / theta^(2i / head_dim)
    llama3   Llama 3.1+'s long-context scaling of the default: wavelengths 2*pi / inv_freq longer than
             original_max_position_embeddings / low_freq_factor are stretched by factor, those shorter than
             original_max_position_embeddings / high_freq_factor kept, those in between interpolated
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ConfigError

ROPE_TYPES = ("default", "llama3")
DEFAULT_THETA = 10000.0  # transformers' default for every supported model
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Rope:
    """theta, and for rope_type llama3 its four numbers (named as in config.json's rope_parameters)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def hf_parameters(self) -> dict:
        """transformers' rope_parameters for this RoPE."""
        scaling = {key: getattr(self, key) for key in LLAMA3_KEYS} if self.rope_type == "llama3" else {}
        return {"rope_type": self.rope_type, "rope_theta": self.theta, **scaling}


def rope_from_config(config: dict, where: str) -> Rope:
    """The RoPE of a config.json dict: rope_parameters (transformers 5), or rope_theta and rope_scaling
    (earlier checkpoints). ConfigError, prefixed with `where`, for a rope_type not in ROPE_TYPES or
    llama3 numbers that are missing or impossible."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if not is_positive(theta):
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if rope_type == "default":
        return Rope(theta)
    missing = [key for key in LLAMA3_KEYS if key not in params]
    if missing:
        raise ConfigError(f"{where}: rope_type 'llama3' needs {', '.join(missing)}")
    bad = [f"{key}={params[key]!r}" for key in LLAMA3_KEYS if not is_positive(params[key])]
    if bad or params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ConfigError(f"{where}: rope_type 'llama3' needs positive numbers with high_freq_factor > "
                          f"low_freq_factor, got {', '.join(f'{k}={params[k]!r}' for k in LLAMA3_KEYS)}")
    return Rope(theta, rope_type, **{key: params[key] for key in LLAMA3_KEYS})


def is_positive(value, kind: type = float) -> bool:
    """Whether a config.json value is a positive int (kind int) or a positive finite number (kind float); a
    bool is neither."""
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return value > 0 and math.isfinite(value)


def inverse_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """float32 [head_dim / 2]."""
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if rope.rope_type == "default":
        return inv_freq
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / rope.low_freq_factor, old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim] in float32; rotate_half(x) = cat(-x2, x1), so the two
    halves of a row repeat the same angles."""

    def __init__(self, head_dim: int, rope: Rope, max_positions: int):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Computes the tables on their device: again after a model built on the meta device (the loader's)
        gets its storage."""
        if self.cos.is_meta:
            return
        with torch.device(self.cos.device):
            freqs = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32),
                                inverse_frequencies(self.rope, self.head_dim))
            # the angles in sin's storage, then each table in place: the tables and freqs are the peak
            torch.cat([freqs, freqs], dim=-1, out=self.sin)
            torch.cos(self.sin, out=self.cos)
            self.sin.sin_()

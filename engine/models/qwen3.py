"""Qwen3 (QK-norm, RoPE, GQA, SwiGLU, optionally tied embeddings) over the paged KV cache.

Tensors are flat over the tokens of a step: hidden [T, hidden_size], q [T, Hq, D], k/v [T, Hkv, D].
The cache and the step's layout belong to engine/attention.py: this file computes q, k and v and hands
them to PagedAttention. Parameter names follow Hugging Face's, except that q/k/v_proj are fused into
qkv_proj and gate/up_proj into gate_up_proj (see engine/models/loader.py).
"""
from dataclasses import dataclass

import torch
from torch import nn

import ops
from engine.attention import AttentionMetadata, PagedAttention
from engine.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class Qwen3Arch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), one kernel (ops.rms_norm).
        With residual: (norm(x + residual), x + residual), the sum in the model dtype."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim] in float32; ops.qk_norm_rope applies them as
    x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)


class Qwen3Attention(nn.Module):
    def __init__(self, arch: Qwen3Arch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def forward(self, x, positions, rotary, key_cache, value_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q_norm / k_norm, then RoPE, in one kernel (the same rounding steps as the modules)
        q, k = ops.qk_norm_rope(
            q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim),
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rotary.cos, rotary.sin, positions,
        )
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, key_cache, value_cache, meta))


class Qwen3MLP(nn.Module):
    def __init__(self, arch: Qwen3Arch):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # silu(gate) * up


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, arch: Qwen3Arch):
        super().__init__()
        self.self_attn = Qwen3Attention(arch)
        self.mlp = Qwen3MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, key_cache, value_cache, meta):
        """(x, residual) -> (mlp_out, residual): the residual stream is x + residual (None in the first
        layer), added in the next norm's kernel; the caller adds the last mlp_out in the final norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, key_cache, value_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, arch: Qwen3Arch, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions)

    def forward(self, input_ids, positions, kv_cache, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer, key_cache, value_cache in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches):
            x, residual = layer(x, residual, positions, self.rotary, key_cache, value_cache, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, arch: Qwen3Arch, max_positions: int):
        super().__init__()
        self.arch = arch
        self.model = Qwen3Model(arch, max_positions)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_cache_spec = KVCacheSpec(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim)

    def forward(self, input_ids, positions, kv_cache, meta):
        """Final hidden states [T, hidden_size]; compute_logits takes the rows that need logits."""
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden):
        """Logits [rows, vocab] in the model's dtype: the sampler widens them to float32 as it reads them."""
        return self.lm_head(hidden)

"""The decoder every supported model is, over the paged KV cache: token embedding; layers of RMSNorm,
attention (RoPE, grouped-query heads), RMSNorm, SwiGLU MLP around a residual stream; a final RMSNorm; an
LM head, optionally the embedding matrix. The models differ only by DecoderArch's flags: QK-norm (Qwen3),
biases (Qwen2's q/k/v; Llama's when its config asks) and the RoPE (Llama 3's llama3 scaling).

Tensors are flat over the tokens of a step: hidden [T, hidden_size], q [T, Hq, D], k/v [T, Hkv, D].
The cache and the step's layout belong to engine/attention.py: a layer computes q, k and v and hands
them to PagedAttention. Parameter names follow Hugging Face's, except that q/k/v_proj are packed into
qkv_proj and gate/up_proj into gate_up_proj (packed_modules_mapping says which shard each fills).

A model file (engine/models/<name>.py, listed in engine/models/registry.py) subclasses DecoderForCausalLM
and says how its config.json sets the flags (arch_options) and how transformers' config of the same model
reads them back (config_options, for to_hf_model). What the engine uses of a model: forward,
compute_logits, kv_cache_spec, arch (sizes), model.embed_tokens and lm_head (the bench's floor); the
loader: packed_modules_mapping and each PackedLinear's shards.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import ops
from engine.attention import PagedAttention
from engine.config import ConfigError
from engine.kv_cache import KVCacheSpec
from engine.models.layers import PackedLinear, RMSNorm, add_linear_
from engine.models.rope import Rope, RotaryEmbedding, rope_from_config


@dataclass(frozen=True)
class DecoderArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: Rope
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False


class DecoderAttention(nn.Module):
    def __init__(self, arch: DecoderArch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.attn = PagedAttention(self.head_dim**-0.5)
        self.qkv_proj = PackedLinear(arch.hidden_size, [q_size, kv_size, kv_size], bias=arch.qkv_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def rotated_q(self, hidden, input_norm_eps, positions, rotary, key_cache, value_cache, slot_mapping, out=None):
        """The projections of the residual stream hidden [T, hidden_size] (the layer's input RMSNorm folded
        into qkv_proj's weight), then, in one kernel, the norm's row scale, the bias, the QK-norm, RoPE and
        the step's K/V into the cache -> the rotated q [T, Hq, D] (into out when given)."""
        q, k, v = F.linear(hidden, self.qkv_proj.weight).split(self.qkv_proj.output_sizes, dim=-1)
        q, k = q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.shards(self.qkv_proj.bias)
        return self.attn.write(q, k, v, positions, rotary, key_cache, value_cache, slot_mapping, qk_norm,
                               (hidden, input_norm_eps), bias, out)


class DecoderMLP(nn.Module):
    def __init__(self, arch: DecoderArch):
        super().__init__()
        self.gate_up_proj = PackedLinear(arch.hidden_size, [arch.intermediate_size] * 2, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def add_to(self, hidden, input_norm_eps):
        """hidden += down(silu(gate) * up) of the RMSNorm of hidden, in place (the norm folded into
        gate_up_proj's weight, its row scale in the SiLU's kernel)."""
        gate_up = F.linear(hidden, self.gate_up_proj.weight)
        act = ops.silu_and_mul(gate_up, input_norm=(hidden, input_norm_eps), bias=self.gate_up_proj.bias)
        add_linear_(hidden, act, self.down_proj)


class DecoderLayer(nn.Module):
    """A layer over the residual stream, which it updates in place. Once fold_norm_weights has run (the loader
    runs it), each RMSNorm's weight lives in the projection after it and the norm itself holds ones: the
    projections read the raw stream, and the kernel after each (the RoPE's, the SiLU's) applies the row
    scale rsqrt(mean(x^2) + eps). A decode step saves two norm kernels a layer; the sums into the stream
    happen in o_proj's and down_proj's matmuls (add_linear_)."""

    def __init__(self, arch: DecoderArch):
        super().__init__()
        self.self_attn = DecoderAttention(arch)
        self.mlp = DecoderMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, hidden, positions, rotary, key_cache, value_cache, meta):
        """The residual stream hidden [T, hidden_size], updated in place and returned."""
        q = self.before_attention(hidden, positions, rotary, key_cache, value_cache, meta.slot_mapping)
        return self.after_attention(self.self_attn.attn.attend(q, key_cache, value_cache, meta), hidden)

    def before_attention(self, hidden, positions, rotary, key_cache, value_cache, slot_mapping, q_out=None):
        """-> the rotated q: everything before attention proper, which needs only the step's tokens."""
        return self.self_attn.rotated_q(hidden, self.input_layernorm.eps, positions, rotary, key_cache, value_cache,
                                        slot_mapping, q_out)

    def after_attention(self, attn_out, hidden):
        """attention output [T, Hq * D]: hidden += o_proj(attn_out), then hidden += mlp(norm(hidden)) -> hidden."""
        add_linear_(hidden, attn_out, self.self_attn.o_proj)
        self.mlp.add_to(hidden, self.post_attention_layernorm.eps)
        return hidden

    def fold_norm_weights(self) -> None:
        self.input_layernorm.fold_into(self.self_attn.qkv_proj)
        self.post_attention_layernorm.fold_into(self.mlp.gate_up_proj)


class DecoderModel(nn.Module):
    def __init__(self, arch: DecoderArch, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope, max_positions)

    def forward(self, input_ids, positions, kv_cache, meta):
        hidden = self.embed_tokens(input_ids)
        for layer, key_cache, value_cache in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches):
            layer(hidden, positions, self.rotary, key_cache, value_cache, meta)
        return self.norm(hidden)


class DecoderForCausalLM(nn.Module):
    model_type = ""  # transformers' model_type of the same architecture
    # checkpoint projection -> (the PackedLinear it goes into, its shard there)
    packed_modules_mapping = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, arch: DecoderArch, max_positions: int):
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, max_positions)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_cache_spec = KVCacheSpec(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim)

    def forward(self, input_ids, positions, kv_cache, meta):
        """Final hidden states [T, hidden_size]; compute_logits takes the rows that need logits."""
        return self.model(input_ids, positions, kv_cache, meta)

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """Each layer's two RMSNorm weights into the projections after them (DecoderLayer says why): the
        function the model computes is unchanged, and its state dict still describes it (norms of ones)."""
        for layer in self.model.layers:
            layer.fold_norm_weights()

    def compute_logits(self, hidden):
        """Logits [rows, vocab] in the model's dtype: the sampler widens them to float32 as it reads them."""
        return self.lm_head(hidden)

    @classmethod
    def arch_from_config(cls, config: dict, where: str) -> DecoderArch:
        """The arch of a config.json dict whose shape keys are present and positive (the loader checks);
        ConfigError, prefixed with `where`, for what the decoder cannot run."""
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if config.get("use_sliding_window"):  # Qwen2/Qwen3 configs have the switch; the released models leave it off
            raise ConfigError(f"{where}: use_sliding_window is not supported (the attention here sees every token)")
        return DecoderArch(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads, rope=rope_from_config(config, where),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), tie_word_embeddings=config.get("tie_word_embeddings", False),
            **cls.arch_options(config, where))

    @classmethod
    def arch_options(cls, config: dict, where: str) -> dict:
        """DecoderArch's flags (qk_norm, biases) as this model's config.json sets them."""
        return {}

    @classmethod
    def config_options(cls, arch: DecoderArch) -> dict:
        """transformers' config keys of this model that set arch's flags (arch_options' inverse)."""
        return {}

    def hf_config(self) -> dict:
        """transformers' config of this model (model_type's config class takes it as keyword arguments)."""
        arch, positions = self.arch, self.model.rotary.cos.shape[0]
        if arch.rope.rope_type == "llama3":  # transformers warns when the scaled context is the longer
            positions = max(positions, arch.rope.original_max_position_embeddings)
        return dict(
            vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
            num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
            tie_word_embeddings=arch.tie_word_embeddings, rope_parameters=arch.rope.hf_parameters(),
            max_position_embeddings=positions, **self.config_options(arch))

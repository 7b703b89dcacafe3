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
reads them back (config_options, for to_hf_model). What the engine uses of a model: forward and its
pieces (num_pieces, piece, attend: engine/cuda_graphs.py's PiecewiseGraphs), compute_logits, kv_cache_spec,
arch (sizes), dtype and weight_footprint (the bench's floor); the loader: packed_modules_mapping, each
PackedLinear's shards, each layer's fold_norm_weights and FOLDED_NORMS.
"""
from dataclasses import dataclass

import torch
from torch import nn

import ops
from engine.attention import PagedAttention
from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec
from engine.models.layers import PackedLinear, RMSNorm, add_linear_, is_fp8, project_scaled_by_reader
from engine.models.moe import SparseMoeMLP
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
    # mixture of experts (engine/models/moe.py): the layers whose MLP is sparse, and its sizes
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True


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

    def project_and_write_kv(self, hidden, input_norm_eps, positions, rotary, key_cache, value_cache, slot_mapping,
                             out=None, hidden_e4m3=None):
        """The projections of the residual stream hidden [T, hidden_size] (the layer's input RMSNorm folded
        into qkv_proj's weight; hidden_e4m3: its rows already rounded for an FP8 qkv_proj), then, in one
        kernel, the norm's row scale, the bias, the QK-norm, RoPE and the step's K/V into the cache -> the
        rotated q [T, Hq, D] (into out when given)."""
        qkv, scales = project_scaled_by_reader(hidden, self.qkv_proj, hidden_e4m3)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q, k = q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.shards(self.qkv_proj.bias)
        scales = None if scales is None else (scales[0], self.qkv_proj.shards(scales[1]))
        return self.attn.write(q, k, v, positions, rotary, key_cache, value_cache, slot_mapping, qk_norm,
                               (hidden, input_norm_eps), bias, out, scales)


class DecoderMLP(nn.Module):
    def __init__(self, arch: DecoderArch):
        super().__init__()
        self.gate_up_proj = PackedLinear(arch.hidden_size, [arch.intermediate_size] * 2, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def add_to(self, hidden, input_norm_eps, all_reduce=None, hidden_e4m3=None, reader=None):
        """hidden += down(silu(gate) * up) of the RMSNorm of hidden, in place (the norm folded into
        gate_up_proj's weight, its row scale in the SiLU's kernel); all_reduce and reader: add_linear_'s, whose
        result this returns; hidden_e4m3: hidden's rows already rounded for an FP8 gate_up_proj. Above
        ops.SILU_E4M3_ABOVE_ROWS rows, the SiLU's kernel rounds its rows for an FP8 down_proj itself."""
        gate_up, scales = project_scaled_by_reader(hidden, self.gate_up_proj, hidden_e4m3)
        to_e4m3 = is_fp8(self.down_proj) and hidden.shape[0] > ops.SILU_E4M3_ABOVE_ROWS
        act = ops.silu_and_mul(gate_up, input_norm=(hidden, input_norm_eps), bias=self.gate_up_proj.bias,
                               scales=scales, to_e4m3=to_e4m3)
        return add_linear_(hidden, act, self.down_proj, all_reduce, reader)

    def fold_norm(self, norm: RMSNorm, apart=frozenset()) -> None:
        norm.fold_into(self.gate_up_proj, self.gate_up_proj in apart)

    @property
    def norm_reader(self) -> nn.Module:
        """The projection the post-attention norm folds into (its input_weight, if folded apart)."""
        return self.gate_up_proj


# A layer's RMSNorms whose weights fold_norm_weights moves into the projections after them (and removes)
FOLDED_NORMS = ("input_layernorm", "post_attention_layernorm")


class DecoderLayer(nn.Module):
    """A layer over the residual stream, which it updates in place, in three parts: before_attention (which
    writes the step's K/V), attend, after_attention. Its two RMSNorms (FOLDED_NORMS) hold a checkpoint's
    weights until fold_norm_weights (the loader runs it) moves each into the projection after it and removes
    the norm, leaving its epsilon (norm_eps): the projections read the raw stream, and the kernel after each
    (the RoPE's, the SiLU's) applies the row scale rsqrt(mean(x^2) + eps). A decode step saves two norm
    kernels a layer; the sums into the stream happen in o_proj's and down_proj's matmuls (add_linear_)."""

    def __init__(self, arch: DecoderArch, index: int):
        super().__init__()
        self.self_attn = DecoderAttention(arch)
        self.mlp = SparseMoeMLP(arch) if index in arch.moe_layers else DecoderMLP(arch)
        self.norm_eps = arch.rms_norm_eps
        self.all_reduce = None  # tensor parallelism's sum of the row-parallel partial sums (tensor_parallel.py)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def before_attention(self, hidden, positions, rotary, key_cache, value_cache, slot_mapping, q_out=None,
                         hidden_e4m3=None):
        """-> the rotated q [T, Hq, D]: everything before attention proper, which needs only the step's tokens
        (hidden_e4m3: after_attention's of the layer before)."""
        return self.self_attn.project_and_write_kv(hidden, self.norm_eps, positions, rotary, key_cache, value_cache,
                                                   slot_mapping, q_out, hidden_e4m3)

    def attend(self, q, key_cache, value_cache, meta, out=None):
        """Rotated q [T, Hq, D] -> attention output [T, Hq * D] (a view of out [T, Hq, D] when given)."""
        return self.self_attn.attn.attend(q, key_cache, value_cache, meta, out)

    def after_attention(self, attn_out, hidden, reader=None):
        """attention output [T, Hq * D]: hidden += o_proj(attn_out), then hidden += mlp(norm(hidden)), in place.
        reader: the projection that reads hidden next (the next layer's qkv_proj; None after the last layer).
        Returns hidden's rows rounded for it where both its input and the last sum are FP8 (add_linear_), else
        None; o_proj's sum rounds them for gate_up_proj in the same way."""
        hidden_e4m3 = add_linear_(hidden, attn_out, self.self_attn.o_proj, self.all_reduce, self.mlp.norm_reader)
        return self.mlp.add_to(hidden, self.norm_eps, self.all_reduce, hidden_e4m3, reader)

    def fold_norm_weights(self, apart=frozenset()) -> None:
        """The two RMSNorm weights into the projections after them, the norms removed: the function the layer
        computes is unchanged; to_hf_model gives the norms back as ones (or as the input_weight of the
        projections in apart, whose weights go to FP8: RMSNorm.fold_into's)."""
        self.input_layernorm.fold_into(self.self_attn.qkv_proj, self.self_attn.qkv_proj in apart)
        self.mlp.fold_norm(self.post_attention_layernorm, apart)
        for name in FOLDED_NORMS:
            delattr(self, name)


class DecoderModel(nn.Module):
    """The decoder's modules under Hugging Face's names (model.embed_tokens, model.layers.i, model.norm);
    DecoderForCausalLM's pieces run them."""

    def __init__(self, arch: DecoderArch, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope, max_positions)


@dataclass
class ForwardState:
    """What a forward's pieces pass on. Set by the caller: the step's token inputs [T] (input_ids, positions,
    slot_mapping: each row's cache slot, -1: none) and q_out, where every layer's rotated q goes (None: new
    tensors). Set by the pieces: hidden, the residual stream [T, hidden_size] (the final hidden states after
    the last piece); q, the rotated q [T, Hq, D] of the layer about to attend. Set by the caller of attend:
    attn_out, that layer's attention output [T, Hq * D]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    q_out: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    q: torch.Tensor | None = None
    attn_out: torch.Tensor | None = None


@dataclass(frozen=True)
class WeightFootprint:
    """What a forward pass reads of a model's weights (the bench's floor). nonembed_params: the checkpoint's
    parameters but the token embedding and the lm_head (norms included, the folded ones too); lm_head_params:
    vocab * hidden, also when the head is tied to the embedding (the logits' matmul happens anyway);
    bytes_per_step: the bytes of both, each parameter by its dtype, a tied weight once (of the embedding a
    pass reads only its tokens' rows: not counted). A mixture of experts counts experts_per_token of its
    num_experts experts in each sparse layer (what one token reads); expert_bytes: the bytes of one expert
    in every sparse layer together (0 for a dense model), which the floor adds for each further expert a
    step's tokens route to. fp8_params: those of nonembed_params stored in FP8, which multiply on the FP8
    tensor cores (the model keeps weights in FP8 only where they run W8A8: engine/models/quantization.py)."""

    nonembed_params: int
    lm_head_params: int
    bytes_per_step: int
    expert_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    fp8_params: int = 0


class DecoderForCausalLM(nn.Module):
    """The decoder and its LM head. The forward is declared once, as num_pieces = num_layers + 1 pieces with
    each layer's attention between two:

        piece 0          the embedding, then layer 0 before its attention
        attend i         layer i's attention
        piece i + 1      layer i after its attention, then layer i + 1 before its attention (the last piece:
                         the final norm instead)

    and compute_logits, the head, after them. A piece depends only on the step's tokens (its kernels' grids
    only on their count), an attention call also on its sequences (lengths, blocks, groups). forward runs
    the pieces and attention in turn; engine/cuda_graphs.py's PiecewiseGraphs captures each piece as a CUDA
    graph per token count and runs the attention between them eagerly."""

    model_type = ""  # transformers' model_type of the same architecture
    # checkpoint projection -> (the PackedLinear it goes into, its shard there)
    packed_modules_mapping = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # an expert's projection (mlp.experts.<e>.<name>.weight) -> (its StackedExperts parameter, part)
    expert_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                              "down_proj": ("down_proj", None)}

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
        state = ForwardState(input_ids, positions, meta.slot_mapping)
        for index in range(self.num_pieces):
            self.piece(index, state, kv_cache)
            if index < self.arch.num_hidden_layers:
                state.attn_out = self.attend(index, state.q, kv_cache, meta)
        return state.hidden

    @property
    def num_pieces(self) -> int:
        return self.arch.num_hidden_layers + 1

    def piece(self, index: int, state: ForwardState, kv_cache) -> None:
        """Piece `index` of the forward, on `state`: the embedding of its input_ids into hidden (piece 0), or
        layer index - 1 finished from attn_out (hidden updated in place; q and attn_out dropped, so that a
        layer's tensors are freed before the next layer's exist); then layer `index` up to its attention (q;
        the step's K/V into kv_cache), or, in the last piece, the final norm (hidden)."""
        decoder, last = self.model, index == self.arch.num_hidden_layers
        hidden_e4m3 = None  # the stream's rows rounded for an FP8 qkv_proj by the sum before it
        if index == 0:
            state.hidden = decoder.embed_tokens(state.input_ids)
        else:
            reader = None if last else decoder.layers[index].self_attn.qkv_proj
            hidden_e4m3 = decoder.layers[index - 1].after_attention(state.attn_out, state.hidden, reader)
            state.q = state.attn_out = None
        if last:
            state.hidden = decoder.norm(state.hidden)
            return
        state.q = decoder.layers[index].before_attention(
            state.hidden, state.positions, decoder.rotary, kv_cache.key_caches[index], kv_cache.value_caches[index],
            state.slot_mapping, state.q_out, hidden_e4m3)

    def attend(self, index: int, q, kv_cache, meta, out=None):
        """Layer `index`'s attention, between piece index and piece index + 1: its rotated q [T, Hq, D] ->
        [T, Hq * D] (a view of out [T, Hq, D] when given)."""
        return self.model.layers[index].attend(q, kv_cache.key_caches[index], kv_cache.value_caches[index], meta, out)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, which is the activations'."""
        return self.lm_head.weight.dtype

    def weight_footprint(self) -> WeightFootprint:
        """The footprint of a model whose norms are folded (build_model's): a folded norm counts as the
        hidden_size parameters it was, in the model's dtype. A mixture-of-experts layer's experts count
        num_experts_per_tok of num_experts: what one token reads and multiplies (expert_bytes: one expert
        of every sparse layer, for the floor's count of the experts a batch touches)."""
        embed, head = self.model.embed_tokens.weight, self.lm_head.weight
        weights = [p for p in self.parameters() if p is not embed or p is head]  # a tied weight once
        folded = len(FOLDED_NORMS) * self.arch.num_hidden_layers * self.arch.hidden_size
        params = sum(p.numel() for p in weights) + folded
        nbytes = sum(p.numel() * p.element_size() for p in weights) + folded * self.dtype.itemsize
        fp8_params = sum(p.numel() for p in weights if p.dtype in ops.FP8_DTYPES and p is not head)
        sparse = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeMLP)]
        expert_bytes = 0
        for mlp in sparse:
            for stacked in mlp.experts.parameters():  # [E, ...]: the unrouted experts' share
                one = stacked.numel() // stacked.shape[0]
                unread = one * (stacked.shape[0] - mlp.top_k)
                params, nbytes = params - unread, nbytes - unread * stacked.element_size()
                fp8_params -= unread if stacked.dtype in ops.FP8_DTYPES else 0
                expert_bytes += one * stacked.element_size()
        experts = (sparse[0].experts.gate_up_proj.shape[0], sparse[0].top_k) if sparse else (0, 0)
        return WeightFootprint(params - head.numel(), head.numel(), nbytes, expert_bytes, *experts, fp8_params)

    def compile_launches(self, max_tokens: int) -> int:
        """Compile, before a run, the launches that steps of up to max_tokens tokens can pick beyond those the
        warm-up's steps reach: the experts' tuned launches (every sparse layer has one shape, so one layer's).
        Returns the launches run."""
        sparse = next((layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeMLP)), None)
        return 0 if sparse is None else sparse.compile_launches(max_tokens)

    def compute_logits(self, hidden, out=None):
        """Logits [rows, vocab] in the model's dtype: the sampler widens them to float32 as it reads them.
        out: the tensor to write them into (a decode graph's static buffer)."""
        if out is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)

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

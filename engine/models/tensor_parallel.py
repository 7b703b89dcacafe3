"""A decoder split over the ranks of a tensor-parallel group (Megatron-style): shard_layer keeps, of a
finished layer (norms folded, in its dtype), the share of rank r of W, and shard_vocab, of a built model,
that of the embedding and the head (the loader calls them as it builds: engine/models/loader.py).

- Column-parallel (each rank a slice of the outputs; the weight's rows split): qkv_proj, each of q, k and v
  by heads (Hq / W and Hkv / W each); gate_up_proj, gate and up each by I / W; the experts' gate_up_proj.
- Row-parallel (each rank a partial sum over its slice of the inputs; the weight's columns split): o_proj,
  down_proj and the experts' down_proj. One all-reduce a layer after attention, one after the MLP, before
  the sum joins the residual stream (DecoderLayer.all_reduce; a bias is added once, after the sum).
- Vocabulary-parallel: the embedding and the head keep ceil(V / W) rows each (the last rank's padded with
  zero rows); an embedding row outside a rank's slice is zero there, and the all-reduce sums the one rank
  that has it; the head's logits are gathered from every rank and cut back to V.

Everything else is replicated: the norms (folded), the QK-norms, the router, RoPE; so is the residual stream
[T, hidden], which every rank holds whole after each all-reduce. Each rank's KV cache holds its own Hkv / W
heads (kv_cache_spec). A per-row FP8 weight's scales go with its rows; a row-parallel one keeps them whole.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec
from engine.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP
from engine.models.layers import PackedLinear
from engine.models.moe import SparseMoeMLP


@dataclass(frozen=True)
class Collectives:
    """A rank's place in its group and the group's two collectives: all_reduce(t) sums t over the ranks in
    place; all_gather(t [rows, n]) -> [rows, W * n], the ranks' t side by side in rank order."""

    rank: int
    world: int
    all_reduce: Callable[[torch.Tensor], None]
    all_gather: Callable[[torch.Tensor], torch.Tensor]


class VocabParallelEmbedding(nn.Module):
    """Rows start .. start + len(weight) of the embedding (zeros past the vocabulary); the lookup of the
    other ids is zero here and summed in from the rank that has them."""

    def __init__(self, weight: nn.Parameter, start: int, all_reduce: Callable[[torch.Tensor], None]):
        super().__init__()
        self.weight, self.start, self.all_reduce = weight, start, all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        rows.mul_(mine.unsqueeze(-1).to(rows.dtype))
        self.all_reduce(rows)
        return rows


class VocabParallelHead(nn.Module):
    """The head's rows of this rank's slice of the vocabulary; the logits [rows, vocab] gathered whole."""

    def __init__(self, weight: nn.Parameter, vocab: int, all_gather: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weight, self.vocab, self.all_gather = weight, vocab, all_gather

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.all_gather(nn.functional.linear(hidden, self.weight).contiguous())[:, :self.vocab]


def check_divisible(arch, world: int) -> None:
    """ConfigError naming model.tensor_parallel_size unless it divides the heads and the MLP widths."""
    sizes = {"num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads}
    if len(arch.moe_layers) < arch.num_hidden_layers:
        sizes["intermediate_size"] = arch.intermediate_size
    if arch.moe_layers:
        sizes["moe_intermediate_size"] = arch.moe_intermediate_size
    indivisible = {name: size for name, size in sizes.items() if size % world}
    if indivisible:
        raise ConfigError(f"model.tensor_parallel_size {world} must divide the model's "
                          + ", ".join(f"{name} ({size})" for name, size in indivisible.items()))


@torch.no_grad()
def shard_layer(layer: DecoderLayer, group: Collectives) -> None:
    """Keep rank group.rank's share of the layer's weights (the module docstring's split), in place."""
    rank, world = group.rank, group.world
    attn = layer.self_attn
    _split_rows(attn.qkv_proj, rank, world)
    attn.num_heads, attn.num_kv_heads = attn.num_heads // world, attn.num_kv_heads // world
    _split_columns(attn.o_proj, rank, world)
    if isinstance(layer.mlp, DecoderMLP):
        _split_rows(layer.mlp.gate_up_proj, rank, world)
        _split_columns(layer.mlp.down_proj, rank, world)
    elif isinstance(layer.mlp, SparseMoeMLP):
        experts = layer.mlp.experts
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        experts.gate_up_proj = _kept(torch.cat([gate.chunk(world, 1)[rank], up.chunk(world, 1)[rank]], 1))
        experts.down_proj = _kept(experts.down_proj.chunk(world, 2)[rank])
        experts.intermediate_size //= world
    layer.all_reduce = group.all_reduce


@torch.no_grad()
def shard_vocab(model: DecoderForCausalLM, group: Collectives) -> None:
    """Keep rank group.rank's slice of the embedding and the head, and its K/V heads in kv_cache_spec."""
    rank, world, arch = group.rank, group.world, model.arch
    per_rank = -(-arch.vocab_size // world)
    embedding = _vocab_slice(model.model.embed_tokens.weight, rank, per_rank)
    model.model.embed_tokens = VocabParallelEmbedding(embedding, rank * per_rank, group.all_reduce)
    head = embedding if arch.tie_word_embeddings else _vocab_slice(model.lm_head.weight, rank, per_rank)
    model.lm_head = VocabParallelHead(head, arch.vocab_size, group.all_gather)
    model.kv_cache_spec = KVCacheSpec(arch.num_hidden_layers, arch.num_key_value_heads // world, arch.head_dim)


def _kept(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous(), requires_grad=False)


def _split_rows(linear: PackedLinear, rank: int, world: int) -> None:
    """Each of the PackedLinear's shards keeps its rank-th slice of rows (with their bias and FP8 scales)."""
    def rows(tensor):
        return torch.cat([shard.chunk(world)[rank] for shard in linear.shards(tensor)])
    linear.weight = _kept(rows(linear.weight))
    if linear.bias is not None:
        linear.bias = _kept(rows(linear.bias))
    if hasattr(linear, "weight_scale"):
        linear.weight_scale = rows(linear.weight_scale).contiguous()
    linear.output_sizes = [size // world for size in linear.output_sizes]
    linear.out_features = sum(linear.output_sizes)


def _split_columns(linear: nn.Linear, rank: int, world: int) -> None:
    linear.weight = _kept(linear.weight.chunk(world, dim=1)[rank])
    linear.in_features = linear.weight.shape[1]


def _vocab_slice(weight: torch.Tensor, rank: int, per_rank: int) -> nn.Parameter:
    rows = weight[rank * per_rank:(rank + 1) * per_rank]
    padding = rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])
    return _kept(torch.cat([rows, padding]))

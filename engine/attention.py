"""Paged attention for any decoder: rotate q and k (RoPE, after the optional QK-norm) and write this
step's K/V through slot_mapping, in one kernel, then attend through block tables and sequence lengths,
sending decode rows and prefill rows to their kernels.

A step's rows are ordered decode first: sequences 0 .. num_decode_seqs - 1 have one query token each
(rows 0 .. num_decode_seqs - 1), the prefill chunks of the other sequences follow. A decode-only step is
what the decode CUDA graphs capture; the per-layer graphs of steps with prompt chunks hold every layer's
write but never its attend (engine/cuda_graphs.py). Decode rows in groups that share a prefix of blocks
(engine/prefix_groups.py) take cascade attention, which reads each group's prefix once; a step without
groups takes the plain path.
The model file only computes q, k and v and owns the rotary tables and norms; everything about the cache
and the batch's layout lives here.
"""
from dataclasses import dataclass

import torch
from torch import nn

import ops


@dataclass
class PrefillMetadata:
    """The prefill chunks of a step, in tensors of their own (int32, on the model's device): a slice of
    the decode rows' tensors could start off a 16-byte boundary, and Triton compiles a new kernel
    variant for every alignment it meets.
    block_tables [Bp, M] (-1 padded), seq_lens [Bp] (tokens stored after this step's writes),
    cu_seqlens_q [Bp + 1] (row offsets of the chunks, from the first prefill row)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor


@dataclass
class CascadeMetadata:
    """Groups of decode rows that share a prefix (int32, on the model's device; the layout of
    ops.cascade_attention_decode): rows cu_group_rows[g]:cu_group_rows[g + 1] ([G + 1]) share their
    first group_prefix_lens[g] ([G]) tokens; rows after cu_group_rows[G] share nothing. plan: the op's
    prefix pass's work list ([1 + W, ops.cascade.WORK_FIELDS], the first rows of a larger buffer in a
    graph), None where the op plans itself (the CPU's reference needs none)."""

    cu_group_rows: torch.Tensor
    group_prefix_lens: torch.Tensor
    plan: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step addressing shared by every layer. slot_mapping [T]: the cache slot of each row's K/V
    (-1: write nothing); block_tables [Bd, M] and seq_lens [Bd] of the decode rows; prefill: the
    chunks, None in a decode-only step; cascade: the decode rows' shared-prefix groups, None when
    no row reads a shared prefix this step; decode_order [Bd]: the order in which plain decode starts
    the decode rows (the model runner's: longest first), None: batch order."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    prefill: PrefillMetadata | None = None
    cascade: CascadeMetadata | None = None
    decode_order: torch.Tensor | None = None

    @property
    def num_decode_seqs(self) -> int:
        return self.seq_lens.shape[0]


class PagedAttention(nn.Module):
    """A layer's attention in two parts: write (what depends only on the step's tokens, so a CUDA graph of
    a token count can hold it) and attend (what depends on the step's sequences: lengths, blocks, groups).
    Their composition maps q [T, Hq, D], k and v [T, Hkv, D], before RoPE, to the output [T, Hq * D]."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    @staticmethod
    def write(q, k, v, positions, rotary, key_cache, value_cache, slot_mapping, qk_norm=None, input_norm=None,
              bias=None, out=None, scales=None):
        """RoPE of q and k with rotary's cos/sin tables, after the per-head RMSNorm qk_norm = (q_weight,
        k_weight, eps) when given, and before it the folded input norm's row scale and the bias
        (ops.rope_and_write_kv_cache's input_norm and bias), and before those an FP8 product's scales (its
        scales); the step's K/V into the cache -> the rotated q (into out when given)."""
        return ops.rope_and_write_kv_cache(q, k, v, rotary.cos, rotary.sin, positions, key_cache, value_cache,
                                           slot_mapping, qk_norm=qk_norm, input_norm=input_norm, bias=bias, out=out,
                                           scales=scales)

    def attend(self, q, key_cache, value_cache, meta: AttentionMetadata, out=None) -> torch.Tensor:
        """Rotated q [T, Hq, D] -> attention output [T, Hq * D] (a view of out [T, Hq, D] when given)."""
        out = torch.empty_like(q) if out is None else out  # decode rows' kernels write its first rows, prefill the rest
        n = meta.num_decode_seqs
        if n:
            self._decode(q[:n], key_cache, value_cache, meta, out[:n])
        if meta.prefill is not None:
            self._prefill(q[n:], key_cache, value_cache, meta.prefill, out[n:])
        return out.flatten(1)

    def _decode(self, q, key_cache, value_cache, meta: AttentionMetadata, out):
        if meta.cascade is None:
            ops.paged_attention_decode(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, self.scale,
                                       row_order=meta.decode_order, out=out)
        else:
            ops.cascade_attention_decode(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, self.scale,
                                         meta.cascade.cu_group_rows, meta.cascade.group_prefix_lens,
                                         plan=meta.cascade.plan, out=out)

    def _prefill(self, q, key_cache, value_cache, chunks: PrefillMetadata, out):
        # no max_seqlen_q hint: a tile size per chunk length would be one more kernel to compile mid-run
        ops.paged_attention_prefill(q, key_cache, value_cache, chunks.block_tables, chunks.cu_seqlens_q,
                                    chunks.seq_lens, self.scale, out=out)

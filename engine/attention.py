"""Paged attention for any decoder: write this step's K/V through slot_mapping, then attend through
block_tables and seq_lens, sending decode rows and prefill rows to their kernels.

A step's rows are ordered decode first: sequences 0 .. num_decode_seqs - 1 have one query token each
(rows 0 .. num_decode_seqs - 1), the rest are prefill chunks of any length (rows num_decode_seqs ..).
A decode-only step (num_decode_seqs == B) is what the CUDA graphs capture. The model file only computes
q, k, v; everything about the cache and the batch's layout lives here.
"""
from dataclasses import dataclass

import torch
from torch import nn

import ops


@dataclass
class AttentionMetadata:
    """Per-step addressing shared by every layer (int32 tensors on the model's device).

    slot_mapping [T]: the cache slot of each row's K/V (-1: write nothing);
    block_tables [B, M] (-1 padded), seq_lens [B]: tokens stored after this step's writes;
    cu_seqlens_q [B + 1 - num_decode_seqs]: row offsets of the prefill chunks, counted from the first
    prefill row (None in a decode-only step); max_seqlen_q: the longest chunk (1 when decode-only).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    num_decode_seqs: int
    max_seqlen_q: int = 1

    @property
    def decode_only(self) -> bool:
        return self.num_decode_seqs == self.block_tables.shape[0]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> attention output [T, Hq * D]."""
        ops.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        n = meta.num_decode_seqs
        if meta.decode_only:
            out = self._decode(q, key_cache, value_cache, meta.block_tables, meta.seq_lens)
        elif n == 0:
            out = self._prefill(q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta)
        else:
            out = torch.cat([
                self._decode(q[:n], key_cache, value_cache, meta.block_tables[:n], meta.seq_lens[:n]),
                self._prefill(q[n:], key_cache, value_cache, meta.block_tables[n:], meta.seq_lens[n:], meta),
            ])
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _decode(self, q, key_cache, value_cache, block_tables, seq_lens):
        return ops.paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, self.scale)

    def _prefill(self, q, key_cache, value_cache, block_tables, seq_lens, meta):
        return ops.paged_attention_prefill(q, key_cache, value_cache, block_tables, meta.cu_seqlens_q, seq_lens,
                                           self.scale, max_seqlen_q=meta.max_seqlen_q)

"""Readable PyTorch versions of the three paged-KV ops (the contracts of DESIGN.md).

Shapes (int32 metadata; a slot of -1 is skipped):
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    write_kv_cache(key[T,Hkv,D], value[T,Hkv,D], key_cache, value_cache, slot_mapping[T])
    paged_attention_decode(q[B,Hq,D], ..., block_tables[B,M], seq_lens[B], scale) -> [B,Hq,D]
    paged_attention_prefill(q[T,Hq,D], ..., block_tables[B,M], cu_seqlens_q[B+1], seq_lens[B], scale)
        -> [T,Hq,D]; query i of sequence b sits at position seq_lens[b] - len_q(b) + i (causal).
Query head qh reads kv head qh // (Hq // Hkv). Attention math runs in float32.
"""
import torch


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    key_cache[blocks, :, offsets, :] = key[keep].to(key_cache.dtype)
    value_cache[blocks, :, offsets, :] = value[keep].to(value_cache.dtype)


def gather_sequence_kv(cache, block_table, seq_len):
    """The first seq_len tokens of one sequence as [seq_len, Hkv, D]: pos -> block_table[pos // B], pos % B."""
    block_size = cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [n, Hkv, B, D]
    return blocks.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]


def attend(q, k, v, scale, first_query_pos):
    """Causal attention of q [n, Hq, D] at positions first_query_pos.. over k, v [L, Hkv, D], in float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    query_pos = first_query_pos + torch.arange(q.shape[0], device=q.device)
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q=None):
    """max_seqlen_q: a tiling hint for the Triton version, not needed here."""
    out = torch.empty_like(q)
    bounds, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = bounds[b], bounds[b + 1]
        k = gather_sequence_kv(key_cache, block_tables[b], seq_len)
        v = gather_sequence_kv(value_cache, block_tables[b], seq_len)
        out[start:end] = attend(q[start:end], k, v, scale, seq_len - (end - start)).to(q.dtype)
    return out


def paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len=None):
    """max_seq_len: a grid-sizing hint for the Triton version, not needed here."""
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)

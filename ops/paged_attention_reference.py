"""Readable PyTorch versions of the paged-KV ops (the contracts of docs/design.md; Triton versions:
ops/paged_attention.py, ops/cascade.py for cascade_attention_decode, and for write_kv_cache the cache write
inside ops/fused.py's rope_and_write_kv_cache, whose reference, ops/fused_reference.py, calls it).

Shapes (int32 metadata; a slot of -1 is skipped):
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    write_kv_cache(key[T,Hkv,D], value[T,Hkv,D], key_cache, value_cache, slot_mapping[T])
    paged_attention_decode(q[B,Hq,D], ..., block_tables[B,M], seq_lens[B], scale) -> [B,Hq,D]
        (each attention op takes an optional out=, a tensor shaped as q, and writes into it and returns it)
    paged_attention_prefill(q[T,Hq,D], ..., block_tables[B,M], cu_seqlens_q[B+1], seq_lens[B], scale)
        -> [T,Hq,D]; query i of sequence b sits at position seq_lens[b] - len_q(b) + i (causal).
    cascade_attention_decode(q[B,Hq,D], ..., block_tables[B,M], seq_lens[B], scale,
                             cu_group_rows[G+1], group_prefix_lens[G]) -> [B,Hq,D]
        = paged_attention_decode, computed as a shared-prefix pass per group of rows, a suffix pass per
        row and a log-sum-exp merge (check_cascade_groups states what the groups must satisfy).
Query head qh reads kv head qh // (Hq // Hkv). Attention math runs in float32. The caches may be of the
model's dtype or of an FP8 type (cache.kv_cache_dtype): K and V are stored unscaled, clamped to its finite
range (to_cache), and read back exactly (every FP8 value is one of the model's dtype).
"""
import torch


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # an FP8 KV cache's (cache.kv_cache_dtype)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: e4m3's largest finite value


def to_cache(x, dtype):
    """x as a cache of dtype stores it: an FP8 type's finite range first (its cast would give NaN or inf
    beyond it), no scale."""
    if dtype in FP8_DTYPES:
        most = torch.finfo(dtype).max
        x = x.float().clamp(-most, most)
    return x.to(dtype)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    key_cache[blocks, :, offsets, :] = to_cache(key[keep], key_cache.dtype)
    value_cache[blocks, :, offsets, :] = to_cache(value[keep], value_cache.dtype)


def gather_sequence_kv(cache, block_table, seq_len):
    """The first seq_len tokens of one sequence as [seq_len, Hkv, D]: pos -> block_table[pos // B], pos % B."""
    block_size = cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [n, Hkv, B, D]
    return blocks.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]


def _scores(q, k, scale):
    """[Hq, n, L] float32 scores of q [n, Hq, D] against k [L, Hkv, D] (query head qh reads kv head qh // group)."""
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("qhd,khd->hqk", q.float(), k) * scale


def _weighted_values(p, v):
    """[n, Hq, D]: the probabilities p [Hq, n, L] applied to v [L, Hkv, D]."""
    return torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(p.shape[0] // v.shape[1], dim=1))


def attend(q, k, v, scale, first_query_pos):
    """Causal attention of q [n, Hq, D] at positions first_query_pos.. over k, v [L, Hkv, D], in float32."""
    scores = _scores(q, k, scale)
    query_pos = first_query_pos + torch.arange(q.shape[0], device=q.device)
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    return _weighted_values(scores.softmax(dim=-1), v)


def attend_with_lse(q, k, v, scale):
    """Attention of q [n, Hq, D] over all of k, v [L, Hkv, D] -> (out [n, Hq, D], lse [n, Hq]), float32,
    lse = log-sum-exp of the scores; with L = 0: out 0, lse -inf."""
    scores = _scores(q, k, scale)
    lse = scores.logsumexp(dim=-1)  # -inf when L = 0
    p = (scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None]).exp()
    return _weighted_values(p, v), lse.transpose(0, 1)


def merge_attention(o1, lse1, o2, lse2):
    """Attention over the union of two disjoint key sets from each set's (out [..., D], lse [...]);
    a side with lse -inf (no keys) gets weight 0."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.clamp_min(torch.finfo(torch.float32).min)[..., None]
    return (lse1[..., None] - safe).exp() * o1 + (lse2[..., None] - safe).exp() * o2


def paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q=None,
                            out=None):
    """max_seqlen_q: a tiling hint for the Triton version, not needed here."""
    out = torch.empty_like(q) if out is None else out
    bounds, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = bounds[b], bounds[b + 1]
        k = gather_sequence_kv(key_cache, block_tables[b], seq_len)
        v = gather_sequence_kv(value_cache, block_tables[b], seq_len)
        out[start:end] = attend(q[start:end], k, v, scale, seq_len - (end - start)).to(q.dtype)
    return out


def paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len=None,
                           row_order=None, out=None):
    """max_seq_len and row_order: grid-sizing and scheduling hints for the Triton version, not needed here."""
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=out)


def check_cascade_groups(block_tables, seq_lens, cu_group_rows, group_prefix_lens, block_size):
    """What cascade_attention_decode needs of its groups (read on the host): cu_group_rows [G+1] starts
    at 0, never decreases and ends at most at B (rows after it share nothing; empty groups are fine);
    each prefix length lies in [0, seq_len] of every member of its group, and every member maps the
    prefix's positions to the same physical blocks. Returns (bounds, prefix lengths) as lists."""
    bounds, prefixes, lens = cu_group_rows.tolist(), group_prefix_lens.tolist(), seq_lens.tolist()
    if len(bounds) != len(prefixes) + 1:
        raise ValueError(f"cu_group_rows has {len(bounds)} entries and group_prefix_lens {len(prefixes)}: "
                         "need G + 1 and G")
    if bounds[0] != 0 or bounds[-1] > len(lens) or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_group_rows must start at 0, never decrease and end at most at B={len(lens)}: {bounds}")
    for g, prefix in enumerate(prefixes):
        first, end = bounds[g], bounds[g + 1]
        for row in range(first, end):
            if not 0 <= prefix <= lens[row]:
                raise ValueError(f"group_prefix_lens[{g}] = {prefix} is not in [0, seq_lens[{row}] = {lens[row]}]")
        if first == end:
            continue
        n = -(-prefix // block_size)
        differs = (block_tables[first:end, :n] != block_tables[first, :n]).any(dim=1).nonzero()
        if differs.numel():
            raise ValueError(f"block_tables[{first + int(differs[0])}] maps the first {prefix} tokens of group {g} "
                             f"to other blocks than block_tables[{first}]")
    return bounds, prefixes


def cascade_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, cu_group_rows,
                             group_prefix_lens, out=None):
    bounds, prefixes = check_cascade_groups(block_tables, seq_lens, cu_group_rows, group_prefix_lens,
                                            key_cache.shape[2])
    out = torch.empty_like(q) if out is None else out
    for g, prefix in enumerate(prefixes):
        rows = slice(bounds[g], bounds[g + 1])
        if rows.start == rows.stop:
            continue
        k = gather_sequence_kv(key_cache, block_tables[rows.start], prefix)
        v = gather_sequence_kv(value_cache, block_tables[rows.start], prefix)
        shared = attend_with_lse(q[rows], k, v, scale)
        for i, seq_len in enumerate(seq_lens[rows].tolist()):
            row = rows.start + i
            k = gather_sequence_kv(key_cache, block_tables[row], seq_len)[prefix:]
            v = gather_sequence_kv(value_cache, block_tables[row], seq_len)[prefix:]
            own = attend_with_lse(q[row:row + 1], k, v, scale)
            out[row] = merge_attention(shared[0][i], shared[1][i], own[0][0], own[1][0]).to(q.dtype)
    rest = slice(bounds[-1], q.shape[0])
    paged_attention_decode(q[rest], key_cache, value_cache, block_tables[rest], seq_lens[rest], scale, out=out[rest])
    return out

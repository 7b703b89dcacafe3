"""Paged-KV ops. Each takes backend=None|"triton"|"torch": None picks Triton for CUDA tensors
and the PyTorch reference otherwise. Contracts and shapes: ops/reference.py and DESIGN.md."""
from ops import reference

BACKENDS = ("triton", "torch")


def _pick(backend, tensor):
    if backend is None:
        backend = "triton" if tensor.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return reference
    from ops import triton_ops  # imported lazily: triton is optional on CPU

    return triton_ops


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend=None):
    return _pick(backend, key).write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, backend=None, *,
                           max_seq_len=None):
    """max_seq_len (optional, keyword): a CPU-side bound of seq_lens; the Triton backend uses it only
    to size its split-KV grid (results are right for any value), the reference ignores it."""
    impl = _pick(backend, q)
    if impl is reference:
        return reference.paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale)
    return impl.paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                       max_seq_len=max_seq_len)


def paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, backend=None, *,
                            max_seqlen_q=None):
    """max_seqlen_q (optional, keyword): a CPU-side upper bound of the query lengths; the Triton
    backend uses it to pick a smaller query tile for short chunks (it never needs it, and never
    synchronises with the device); the reference ignores it."""
    impl = _pick(backend, q)
    if impl is reference:
        return reference.paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    return impl.paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                        max_seqlen_q=max_seqlen_q)

"""The GPU data plane's storage: per-layer key and value tensors [num_blocks, num_kv_heads, block_size, head_dim].

The block table of a sequence is shared by every layer; each layer has its own cache tensors. Slot s
of a layer lives at [s // block_size, :, s % block_size, :].
"""
from dataclasses import dataclass

import torch

from engine.config import ConfigError


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model's KV cache is made of, whatever the model: layers, K/V heads per layer, head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * block_size * spec.head_dim * element


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.bytes = bytes_per_block(spec, block_size, dtype) * num_blocks


def num_blocks_for(cache_cfg, spec: KVCacheSpec, dtype: torch.dtype, free_bytes: int | None, default_blocks: int) -> int:
    """Pool size: cache.num_blocks, else cache.kv_budget_gb, else the free device memory (CUDA), else
    default_blocks (CPU: every sequence of the batch at max_model_len)."""
    per_block = bytes_per_block(spec, cache_cfg.block_size, dtype)
    if cache_cfg.num_blocks is not None:
        return cache_cfg.num_blocks
    if cache_cfg.kv_budget_gb is not None:
        blocks = int(cache_cfg.kv_budget_gb * 1e9 // per_block)
        if blocks < 1:
            raise ConfigError(f"cache.kv_budget_gb {cache_cfg.kv_budget_gb} holds no block of {per_block} bytes")
        return blocks
    if free_bytes is not None:
        blocks = free_bytes // per_block
        if blocks < 1:
            raise ConfigError("cache.gpu_memory_utilization leaves no memory for KV blocks")
        return blocks
    return default_blocks

"""The GPU data plane's storage: per-layer key and value tensors [num_blocks, num_kv_heads, block_size, head_dim].

The block table of a sequence is shared by every layer; each layer has its own cache tensors. Slot s
of a layer lives at [s // block_size, :, s % block_size, :].
"""
import torch

from engine.config import ConfigError
from engine.models.qwen3 import Qwen3Arch


def bytes_per_block(arch: Qwen3Arch, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * block_size * arch.head_dim * element


class PagedKVCache:
    def __init__(self, arch: Qwen3Arch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, arch.num_key_value_heads, block_size, arch.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
        self.bytes = bytes_per_block(arch, block_size, dtype) * num_blocks


def num_blocks_for(cache_cfg, arch: Qwen3Arch, dtype: torch.dtype, free_bytes: int | None, default_blocks: int) -> int:
    """Pool size: cache.num_blocks, else cache.kv_budget_gb, else the free device memory (CUDA), else
    default_blocks (CPU: every sequence of the batch at max_model_len)."""
    per_block = bytes_per_block(arch, cache_cfg.block_size, dtype)
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

"""The GPU data plane's storage: per-layer key and value tensors [num_blocks, num_kv_heads, block_size, head_dim],
of the model's dtype or of an FP8 type (cache.kv_cache_dtype: cache_dtype), half the bytes a token.

The block table of a sequence is shared by every layer; each layer has its own cache tensors. Slot s
of a layer lives at [s // block_size, :, s % block_size, :].
"""
import logging
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_manager import blocks_needed
from engine.errors import ConfigError


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model's KV cache is made of, whatever the model: layers, K/V heads per layer, head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 in hardware (Triton's fp8e4nv, torch._scaled_mm's FP8 GEMMs)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the pool stores K and V in: the model's for "auto", else the FP8 type named by
    cache.kv_cache_dtype; ConfigError naming it on a CUDA device older than FP8_CAPABILITY."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        (major, minor), name = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
        raise ConfigError(f"cache.kv_cache_dtype {kv_cache_dtype} needs a GPU of compute capability "
                          f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later (FP8), but {name} is {major}.{minor}; "
                          f"use cache.kv_cache_dtype=auto")
    return FP8_CACHE_DTYPES[kv_cache_dtype]


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * block_size * spec.head_dim * element


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.key_caches = [zeros_on_first_touch(shape, dtype, device) for _ in range(spec.num_layers)]
        self.value_caches = [zeros_on_first_touch(shape, dtype, device) for _ in range(spec.num_layers)]
        self.bytes = bytes_per_block(spec, block_size, dtype) * num_blocks

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks src[i] -> dst[i] (int64 [N] on the cache's device) in every layer's K and V, in
        stream order and without waiting for the device. dst holds no duplicates, and no block of src.
        Copied as bytes: indexing kernels need not know an FP8 dtype."""
        for cache in (*self.key_caches, *self.value_caches):
            raw = cache.view(torch.uint8)
            raw[dst] = raw[src]


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), except that on the CPU its memory is a private anonymous mapping, which the
    operating system fills with zeros a page at a time when the page is first touched: a CPU pool costs the
    host the blocks that the job's rows write, not its whole size at start (torch.zeros writes every page:
    seconds and GBs for a pool sized for max_num_seqs sequences of a large model)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


log = logging.getLogger("minipaged")
HOST_KV_SHARE = 0.5  # of the host memory available after the weights: the rest for activations and everyone else
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP, CGROUP_ROOT = Path("/proc/self/cgroup"), Path("/sys/fs/cgroup")
# a memory cgroup's files (limit, usage, the stat keys of its page cache, which the kernel reclaims before it
# kills anything in the cgroup: a checkpoint read twice is active file cache): v2's, then v1's
CGROUP_FILES = {"v2": ("memory.max", "memory.current", ("inactive_file", "active_file")),
                "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_active_file"))}
NO_LIMIT = 1 << 62  # v1 writes "no limit" as the largest page multiple below 2^63


def num_blocks_for(cache_cfg, per_block: int, device: torch.device, max_model_len: int, max_num_seqs: int,
                   free_bytes: int | None = None) -> int:
    """Pool size in blocks of per_block bytes (bytes_per_block's result), decided before anything is allocated.

    cache.num_blocks, else cache.kv_budget_gb // per_block: either must fit in the memory available now
    (host memory on the CPU, torch.cuda.mem_get_info on CUDA). Without them: on CUDA free_bytes (the
    share of device memory left for KV, kv_bytes_left), on the CPU HOST_KV_SHARE of the host memory
    available after the weights, at most max_num_seqs sequences of max_model_len (a bound: the memory of a
    CPU pool is taken block by block as the job writes them, zeros_on_first_touch). Every pool must hold one
    sequence of max_model_len, or a request could never finish: this is the one place that rule is kept.
    Raises ConfigError, with the blocks or bytes needed and available, otherwise."""
    seq_blocks = blocks_needed(max_model_len, cache_cfg.block_size)
    if cache_cfg.num_blocks is not None or cache_cfg.kv_budget_gb is not None:
        blocks = cache_cfg.num_blocks
        if blocks is None:
            blocks = int(cache_cfg.kv_budget_gb * 1e9 // per_block)
            if blocks < 1:
                raise ConfigError(f"cache.kv_budget_gb {cache_cfg.kv_budget_gb} holds no block of {per_block} bytes")
        if blocks < seq_blocks:
            raise ConfigError(
                f"cache: a pool of {blocks} blocks of {cache_cfg.block_size} tokens ({blocks * cache_cfg.block_size} "
                f"tokens) cannot hold one sequence of model.max_model_len {max_model_len} ({seq_blocks} blocks); raise "
                f"cache.num_blocks (or cache.kv_budget_gb, cache.gpu_memory_utilization) or lower model.max_model_len")
        check_pool_fits(blocks, per_block, device)
        return blocks
    if device.type == "cuda":
        blocks = free_bytes // per_block
        where = f"cache.gpu_memory_utilization {cache_cfg.gpu_memory_utilization} leaves {free_bytes / 1e9:.2f} GB for KV"
        remedy = "raise cache.gpu_memory_utilization"
    else:
        available = host_memory_available()
        blocks = min(int(available * HOST_KV_SHARE) // per_block, max_num_seqs * seq_blocks)
        where = f"the pool takes {HOST_KV_SHARE:.0%} of the {available / 1e9:.2f} GB of host memory available after the weights"
        remedy = f"set cache.kv_budget_gb (or cache.num_blocks) to a pool of at most {available / 1e9:.2f} GB"
        log.info("KV pool on the CPU: %s, at most scheduler.max_num_seqs (%d) sequences of max_model_len: %d blocks "
                 "(its memory taken as the rows first write its blocks)", where, max_num_seqs, blocks)
    if blocks < seq_blocks:
        raise ConfigError(
            f"cache: one sequence of model.max_model_len {max_model_len} needs {seq_blocks * per_block / 1e9:.2f} GB "
            f"of KV ({seq_blocks} blocks of {cache_cfg.block_size} tokens), but {where}; lower model.max_model_len "
            f"or {remedy}")
    return blocks


def memory_available(device: torch.device) -> tuple[int, str]:
    """(bytes available on `device` now, what they are, for a message)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    return host_memory_available(), "available on the host"


def check_pool_fits(num_blocks: int, per_block: int, device: torch.device) -> None:
    """Raise ConfigError if a pool of num_blocks would not fit in the memory available on `device` now."""
    need = num_blocks * per_block
    available, where = memory_available(device)
    if need > available:
        raise ConfigError(
            f"cache: a KV pool of {num_blocks} blocks ({per_block} bytes each) needs {need / 1e9:.2f} GB, but only "
            f"{available / 1e9:.2f} GB is {where}; lower cache.kv_budget_gb or cache.num_blocks")


def host_memory_available() -> int:
    """Bytes the kernel can still give without swapping: MemAvailable from /proc/meminfo, else
    os.sysconf's available pages (which leave out reclaimable page cache), and no more than the process's
    memory cgroups leave it (cgroup_memory_headroom)."""
    available = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(available, cgroup_memory_headroom())


def cgroup_memory_headroom() -> float:
    """What the memory cgroups of this process (a container's, a job scheduler's) still let it take before the
    kernel kills it: the least limit - usage + page cache over its cgroup and the ones above it,
    cgroup v2 or v1; infinity where none sets a limit (or they cannot be read). The host's MemAvailable does
    not see such a limit: a model or pool that fits the host is killed inside a smaller container."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return math.inf
    least = math.inf
    for fields in (line.split(":", 2) for line in lines):  # hierarchy id : controllers : path
        if len(fields) == 3 and fields[1] == "":
            least = min(least, _path_headroom(CGROUP_ROOT, fields[2], "v2"))
        elif len(fields) == 3 and "memory" in fields[1].split(","):
            least = min(least, _path_headroom(CGROUP_ROOT / "memory", fields[2], "v1"))
    return least


def _path_headroom(root: Path, path: str, version: str) -> float:
    """The least headroom of the cgroup at `path` under the hierarchy's `root` and of those above it."""
    directory, least = root / path.lstrip("/"), math.inf
    for level in (directory, *directory.parents):
        least = min(least, _cgroup_headroom(level, *CGROUP_FILES[version]))
        if level == root:
            break
    return least


def _cgroup_headroom(directory: Path, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> float:
    """One memory cgroup's limit - usage + page cache; infinity without a limit or its files."""
    try:
        limit = (directory / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= NO_LIMIT:
            return math.inf
        usage = int((directory / usage_file).read_text())
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
        return max(0, int(limit) - usage + sum(int(stat.get(key, 0)) for key in cache_keys))
    except (OSError, ValueError):
        return math.inf

"""The KV pool sized from the memory there is, and refused before anything is allocated when it cannot fit
(engine/kv_cache.py); a CPU pool's memory taken as its blocks are written; a model whose weights cannot fit
refused before its build (engine/models/loader.py). Available memory is monkeypatched: nothing here allocates
more than the tiny model, or touches more than a few pages of a larger pool, but one build of ~150 MB measured
in a process of its own."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import kv_cache
from engine.engine import LLMEngine
from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec, PagedKVCache, host_memory_available, num_blocks_for
from engine.model_runner import trial_layout, trial_step
from engine.models.decoder import FOLDED_NORMS

ROOT = Path(__file__).resolve().parents[1]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
PER_BLOCK = 10**8  # 100 MB a block; with block_size 16 and max_model_len 160, one sequence is 10 blocks = 1 GB
LEN = 160


@pytest.fixture
def host_memory(monkeypatch):
    def set_available(num_bytes: int) -> None:
        monkeypatch.setattr(kv_cache, "host_memory_available", lambda: num_bytes)
    return set_available


def cache(make_config, *overrides):
    return make_config("cache.block_size=16", *overrides).cache


def test_cpu_pool_takes_half_the_available_memory(make_config, host_memory):
    host_memory(10_150_000_000)  # half is 5.075 GB: 50 blocks of 100 MB; 64 sequences would take 640
    assert num_blocks_for(cache(make_config), PER_BLOCK, CPU, LEN, max_num_seqs=64) == 50


def test_cpu_pool_is_at_most_max_num_seqs_sequences(make_config, host_memory):
    host_memory(100 * 10**9)  # half is 500 blocks; 4 sequences of 10 blocks need 40
    assert num_blocks_for(cache(make_config), PER_BLOCK, CPU, LEN, max_num_seqs=4) == 40


def test_cpu_memory_for_less_than_one_sequence(make_config, host_memory):
    host_memory(1_500_000_000)  # half is 0.75 GB: 7 blocks, and one sequence needs 10 (1 GB)
    with pytest.raises(ConfigError) as err:
        num_blocks_for(cache(make_config), PER_BLOCK, CPU, LEN, max_num_seqs=4)
    message = str(err.value)
    for part in ("model.max_model_len 160 needs 1.00 GB", "10 blocks of 16 tokens", "50% of the 1.50 GB of host memory",
                 "cache.kv_budget_gb", "at most 1.50 GB"):
        assert part in message


@pytest.mark.parametrize("override, need", [("cache.num_blocks=100000000", "10000000.00 GB"), ("cache.kv_budget_gb=20", "20.00 GB")])
def test_an_explicit_pool_larger_than_host_memory(make_config, host_memory, override, need):
    host_memory(16 * 10**9)
    with pytest.raises(ConfigError) as err:
        num_blocks_for(cache(make_config, override), PER_BLOCK, CPU, LEN, max_num_seqs=4)
    message = str(err.value)
    for part in (f"needs {need}", "only 16.00 GB is available on the host", "cache.kv_budget_gb", "cache.num_blocks"):
        assert part in message


def test_an_explicit_pool_that_fits_is_taken_as_given(make_config, host_memory):
    host_memory(16 * 10**9)  # all of it may go to an explicit pool, not only half; max_num_seqs does not cap it
    assert num_blocks_for(cache(make_config, "cache.kv_budget_gb=15.95"), PER_BLOCK, CPU, LEN, max_num_seqs=1) == 159
    assert num_blocks_for(cache(make_config, "cache.num_blocks=160"), PER_BLOCK, CPU, LEN, max_num_seqs=1) == 160


def test_cuda_pools_against_device_memory(make_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * 10**9, 80 * 10**9))  # free, total
    assert num_blocks_for(cache(make_config, "cache.kv_budget_gb=4"), PER_BLOCK, CUDA, LEN, 1) == 40
    with pytest.raises(ConfigError, match=r"needs 8.00 GB, but only 5.00 GB is free on cuda; lower cache.kv_budget_gb"):
        num_blocks_for(cache(make_config, "cache.kv_budget_gb=8"), PER_BLOCK, CUDA, LEN, 1)
    # sized from the share of device memory left for KV (free_bytes): all of it, not capped by max_num_seqs
    assert num_blocks_for(cache(make_config), PER_BLOCK, CUDA, LEN, 1, free_bytes=2_550_000_000) == 25
    with pytest.raises(ConfigError, match=r"leaves 0.50 GB for KV; lower model.max_model_len or raise cache.gpu_memory_utilization"):
        num_blocks_for(cache(make_config), PER_BLOCK, CUDA, LEN, 1, free_bytes=5 * 10**8)


def test_host_memory_available_reads_meminfo_or_sysconf(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24580000 kB\nMemFree:          800000 kB\nMemAvailable:   12345678 kB\n")
    monkeypatch.setattr(kv_cache, "MEMINFO", meminfo)
    assert host_memory_available() == 12345678 * 1024
    monkeypatch.setattr(kv_cache, "MEMINFO", tmp_path / "missing")
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    assert host_memory_available() == 4096 * 1000


def cgroup(directory, limit, usage, cache_keys, cache, files):
    """A memory cgroup's files, its page cache split between its keys (inactive, then active: 2 to 1)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / files[0]).write_text(f"{limit}\n")
    (directory / files[1]).write_text(f"{usage}\n")
    inactive, active = cache_keys
    (directory / "memory.stat").write_text(f"anon 5\n{inactive} {cache - cache // 3}\n{active} {cache // 3}\nfile 9\n")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_host_memory_available_is_what_the_memory_cgroups_leave(tmp_path, monkeypatch, version):
    """A container's limit, which MemAvailable does not see: the least limit - usage + page cache over the
    process's cgroup and those above it (hand-computed), none where no level sets a limit."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   1000000 kB\n")  # 1.024 GB
    monkeypatch.setattr(kv_cache, "MEMINFO", meminfo)
    monkeypatch.setattr(kv_cache, "CGROUP_ROOT", tmp_path / "cg")
    monkeypatch.setattr(kv_cache, "PROC_CGROUP", tmp_path / "cgroup")
    limit_file, usage_file, cache_keys = kv_cache.CGROUP_FILES[version]
    root = tmp_path / "cg" if version == "v2" else tmp_path / "cg" / "memory"
    (tmp_path / "cgroup").write_text("0::/job/step\n" if version == "v2" else "5:cpu:/\n4:memory:/job/step\n")
    cgroup(root / "job" / "step", "max" if version == "v2" else 2**63 - 4096, 10**8, cache_keys, 0,
           (limit_file, usage_file))
    cgroup(root / "job", 8 * 10**8, 7 * 10**8, cache_keys, 3 * 10**7, (limit_file, usage_file))
    assert host_memory_available() == 8 * 10**8 - 7 * 10**8 + 3 * 10**7  # the level above, not the host
    cgroup(root / "job", 9 * 10**9, 10**9, cache_keys, 0, (limit_file, usage_file))
    assert host_memory_available() == 1000000 * 1024  # the host's, below the container's 8 GB
    (tmp_path / "cgroup").write_text("garbled\n")
    assert host_memory_available() == 1000000 * 1024


def test_the_engine_sizes_its_cpu_pool_from_host_memory(make_config, host_memory):
    # the tiny model in float32: K and V of 2 layers x 2 kv heads x 16 dims x 4 bytes = 512 bytes a token,
    # 8192 a block of 16; half of 2 * 100 * 8192 + 1 bytes holds 100 blocks (64 sequences of 32 would take 2048)
    host_memory(2 * 100 * 8192 + 1)
    engine = LLMEngine(make_config("model.device=cpu", "model.max_model_len=512"))
    assert engine.num_blocks == 100 and engine.kv_cache.bytes == 100 * 8192


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the memory pages under `tensor` are resident, as the kernel's mincore(2) reports them."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    num_pages = -(-(tensor.data_ptr() + tensor.nbytes - start) // page)
    flags = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(num_pages * page), flags) == 0, ctypes.get_errno()
    return sum(f & 1 for f in flags)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) through Linux's libc")
def test_a_cpu_pool_takes_host_memory_as_its_blocks_are_written():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64)  # 2 x 16 x 64 float32 = 8 KiB a block a layer
    pool = PagedKVCache(spec, num_blocks=32768, block_size=16, dtype=torch.float32, device=CPU)  # 256 MiB a layer
    caches, block_bytes, page = pool.key_caches + pool.value_caches, 8192, os.sysconf("SC_PAGE_SIZE")
    assert [resident_pages(c) for c in caches] == [0, 0, 0, 0]
    written = [3, 4, 1000]
    pool.key_caches[0][written] = 1.0
    pages = {byte // page for b in written for byte in range(b * block_bytes, (b + 1) * block_bytes, 512)}
    assert [resident_pages(c) for c in caches] == [len(pages), 0, 0, 0]
    keys = pool.key_caches[0]
    assert keys[[0, 5, 32767]].abs().sum() == 0 and keys[written].sum() == 3 * block_bytes / 4  # zeros elsewhere


def test_a_pool_beyond_memory_stops_the_job_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine.run", "model.device=cpu", "cache.num_blocks=100000000",
                             f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: cache: a KV pool of 100000000 blocks (8192 bytes each) needs 819.20 GB" in result.stderr
    assert "lower cache.kv_budget_gb or cache.num_blocks" in result.stderr


@pytest.mark.parametrize("num_tokens, num_seqs, block_size", [(37, 5, 4), (16384, 1024, 16), (16384, 512, 128),
                                                               (100, 100, 1), (300, 7, 16)])
def test_the_trial_steps_sequences_each_take_blocks_of_their_own(num_tokens, num_seqs, block_size):
    """The KV pool's trial step at the run's block size (model_runner.trial_layout): lengths that differ by at
    most one and sum to the budget, positions from 0 in each sequence, and each token's slot the one its
    table's block gives (block_tables[s, p // block_size] * block_size + p % block_size), no block in two
    sequences' tables and no slot written twice."""
    counts, tables, slots, positions = trial_layout(num_tokens, num_seqs, block_size)
    assert counts.sum() == num_tokens and counts.max() - counts.min() <= 1
    seq = np.repeat(np.arange(num_seqs), counts)
    assert (positions == np.concatenate([np.arange(n) for n in counts])).all()
    assert (slots == tables[seq, positions // block_size] * block_size + positions % block_size).all()
    assert len(set(slots.tolist())) == num_tokens
    used = [tables[s, : -(-counts[s] // block_size)] for s in range(num_seqs)]
    assert all((row >= 0).all() for row in used) and (tables >= -1).all()
    assert (tables >= 0).sum() == sum(len(row) for row in used)  # -1 past each sequence's blocks
    assert len(set(np.concatenate(used).tolist())) == sum(len(row) for row in used)


def test_the_trial_step_writes_the_same_keys_and_values_whatever_the_block_size(one_thread):
    """model_runner.trial_step (the KV pool's trial forward, on CUDA only in a run) on the tiny model on the
    CPU: 37 tokens in 5 sequences at block size 4 give every layer the keys and values that block size 1
    gives (slot = position in the batch), read back through each layout's own address map; a wrong table
    would change the attention, hence the last layer's keys. Slots no token maps stay zero."""
    from engine.config import engine_config
    from engine.models.loader import build_model

    torch.manual_seed(0)
    model, _ = build_model(engine_config("tiny").model, CPU, torch.float32)
    kv = {}
    for block_size in (1, 4):
        _, tables, slots, _ = trial_layout(37, 5, block_size)
        cache = PagedKVCache(model.kv_cache_spec, int(tables.max()) + 1, block_size, torch.float32, CPU)
        trial_step(model, cache, 37, 5, CPU)
        flat = [c.permute(0, 2, 1, 3).reshape(-1, c.shape[1], c.shape[3])  # [slots, heads, head_dim]
                for c in cache.key_caches + cache.value_caches]
        unused = np.setdiff1d(np.arange(flat[0].shape[0]), slots)
        assert all((f[torch.from_numpy(unused)] == 0).all() for f in flat)
        kv[block_size] = [f[torch.from_numpy(slots.astype(np.int64))] for f in flat]
    for narrow, wide in zip(kv[1], kv[4]):
        torch.testing.assert_close(wide, narrow, rtol=0, atol=0)
    assert kv[4][-1].abs().sum() > 0


def test_rope_tables_larger_than_host_memory_are_refused_before_the_build(make_config, host_memory):
    """The tiny model's tables take 2 x max_model_len x head_dim x 4 bytes: past the memory available the build
    stops with a message naming the field (a length of 10^12 once failed allocating them, with a traceback);
    at the most positions that fit, it builds."""
    from engine.models.loader import build_model, model_spec

    model_cfg = make_config().model
    _, arch, _ = model_spec(model_cfg, None)
    fits = 10**6 // (11 * arch.head_dim)  # positions whose tables (and their angles) fit in 1 MB
    host_memory(10**6)
    model_cfg.max_model_len = fits + 1
    with pytest.raises(ConfigError, match=rf"^model.max_model_len {fits + 1}: its RoPE tables alone need [0-9.]+ GB "
                                          rf"\(cos and sin of head_dim {arch.head_dim} in float32 a position, and "
                                          r"their angles\), but "
                                          r"only [0-9.]+ GB is available on the host; lower model.max_model_len$"):
        build_model(model_cfg, CPU, torch.float32)
    model_cfg.max_model_len = fits
    model, _ = build_model(model_cfg, CPU, torch.float32)
    assert model.model.rotary.cos.shape == (fits, arch.head_dim)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's peak is the oracle")
def test_the_rope_tables_peak_is_within_the_checks_estimate():
    """check_rope_tables_fit's 11 bytes a position and channel bound what computing the tables takes (their
    temporaries once took 2.4 times the tables' 8: the check passed and the build was killed)."""
    from engine.models.rope import Rope, RotaryEmbedding

    positions, head_dim = 1 << 20, 128
    with torch.device("meta"):
        rotary = RotaryEmbedding(head_dim, Rope(10000.0), positions)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    rotary.to_empty(device="cuda").reset_buffers()
    assert torch.cuda.max_memory_allocated() - before <= 11 * positions * head_dim


QWEN3_8B_PARAMS = 8_190_735_360  # its published size (test_models.py checks the preset's layout against it)


class StorageGiven(Exception):
    """Raised in place of a build's first allocation: the fit check let the model through."""


@pytest.fixture
def no_storage(monkeypatch):
    """A build that passes the fit check stops at its first allocation (a real preset's would take GBs)."""
    from engine.models import loader

    def refuse(module, device):
        raise StorageGiven
    monkeypatch.setattr(loader, "_give_storage", refuse)


@pytest.mark.parametrize("dtype, fits", [(torch.float32, False), (torch.bfloat16, True)])
def test_weights_beyond_the_memory_available_are_refused_before_the_build(make_config, host_memory, no_storage,
                                                                           dtype, fits):
    """Qwen3-8B on a 23 GB host: in float32 its 8.19e9 weights take 32.76 GB, and its largest part, the
    embedding (151,936 x 4,096), 2.49 GB more in float32 while it is built (it was killed by the kernel, exit
    137, with no message); in bfloat16 they fit, and the build begins."""
    from engine.models.loader import build_model

    host_memory(23 * 10**9)
    finished, embedding = QWEN3_8B_PARAMS * dtype.itemsize, 151_936 * 4_096 * 4
    if fits:
        with pytest.raises(StorageGiven):
            build_model(make_config("model=qwen3-8b").model, CPU, dtype)
        return
    with pytest.raises(ConfigError) as err:
        build_model(make_config("model=qwen3-8b").model, CPU, dtype)
    assert str(err.value) == (
        f"model=qwen3-8b in float32 (model.dtype=auto): building its weights needs {(finished + embedding) / 1e9:.2f} "
        f"GB ({finished / 1e9:.2f} GB, and {embedding / 1e9:.2f} GB more while they are built: a part in float32), "
        f"but only 23.00 GB is available on the host; choose a smaller model, or model.dtype=bfloat16 (half the bytes)")


def test_a_checkpoint_beyond_device_memory_is_named_by_its_path(qwen3_checkpoint, make_config, monkeypatch, no_storage):
    from engine.models import loader

    path, _ = qwen3_checkpoint
    monkeypatch.setattr(loader, "memory_available", lambda device: (10**4, f"free on {device}"))  # RoPE's 4 kB fit
    with pytest.raises(ConfigError, match=rf"^model.path={path} in bfloat16 \(model.dtype=auto\): building its weights "
                                          r"needs [0-9.]+ GB .* but only 0.00 GB is free on cuda; choose a smaller "
                                          r"model, or more GPUs \(model.tensor_parallel_size\)$"):
        loader.build_model(make_config(f"model.path={path}", "model.max_model_len=16").model, CUDA, torch.bfloat16)


def held_bytes(model) -> int:
    """The bytes a built model holds for its weights: the storage under each parameter and buffer, once, but
    the RoPE tables'."""
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = [tensor for name, tensor in named if not name.startswith("model.rotary.")]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


MOE = ("model.architecture=Qwen3MoeForCausalLM", "model.num_experts=4", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=32", "model.mlp_only_layers=[1]")


@pytest.mark.parametrize("overrides, dtype, world, fp8", [
    ((), torch.float32, 1, False),
    (("model.architecture=Qwen2ForCausalLM", "model.tie_word_embeddings=false"), torch.bfloat16, 1, False),
    (("model.tie_word_embeddings=false",), torch.float32, 2, False),
    (MOE, torch.bfloat16, 2, False),
    (("model.tie_word_embeddings=false",), torch.bfloat16, 1, True),
    (("model.architecture=Qwen2ForCausalLM",), torch.bfloat16, 2, True),
])
def test_the_weights_estimate_is_what_the_build_holds(make_config, monkeypatch, overrides, dtype, world, fp8):
    """loader.weight_bytes' finished weights against the storage a built model holds (each tensor-parallel
    rank's share, and projections kept in FP8: fp8_gemms made true on the CPU), less nothing but the folded
    norms it counts as the weights they were: the check refuses no model that fits, and misses no byte."""
    from engine.models import loader
    from engine.models.tensor_parallel import Collectives

    monkeypatch.setattr(loader, "fp8_gemms", lambda device, dtype: fp8)
    cfg = make_config(*overrides, *(["model.quantization=fp8"] if fp8 else [])).model
    cls, arch, _ = loader.model_spec(cfg, None)
    folded = len(FOLDED_NORMS) * arch.num_hidden_layers * arch.hidden_size * dtype.itemsize
    for rank in range(world):
        group = Collectives(rank, world, lambda t: None, lambda t: t) if world > 1 else None
        with torch.device("meta"):
            finished, _ = loader.weight_bytes(cls(arch, loader.max_model_len_of(cfg)[0]), dtype, fp8, group)
        held = held_bytes(loader.build_model(cfg, CPU, dtype, group)[0])
        assert held <= finished <= held + (0 if fp8 else folded), rank


PEAK_BUILD = """
import json, sys, torch
from engine.config import engine_config
from engine.models import loader

def rss(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

cfg = engine_config("tiny").model
for key, value in json.loads(sys.argv[1]).items():
    setattr(cfg, key, value)
cls, arch, _ = loader.model_spec(cfg, None)
with torch.device("meta"):
    finished, building = loader.weight_bytes(cls(arch, loader.max_model_len_of(cfg)[0]), torch.bfloat16, False)
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = rss("VmRSS:")
model, _ = loader.build_model(cfg, torch.device("cpu"), torch.bfloat16)
print(rss("VmHWM:") - before, finished + building)
"""
SHAPE = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


@pytest.mark.skipif(sys.platform != "linux", reason="the peak resident size from Linux's /proc/self/status")
@pytest.mark.parametrize("model", [
    {**SHAPE, "vocab_size": 32000, "intermediate_size": 1536, "tie_word_embeddings": False},
    {**SHAPE, "vocab_size": 1000, "intermediate_size": 8192, "quantization": "fp8"},
], ids=["head-drawn-last", "fp8-rounded-layers"])
def test_a_builds_peak_is_within_the_weights_estimate(model):
    """The resident memory of a bfloat16 build on the CPU peaks within weight_bytes' estimate, the weights and
    one part in float32 beside them: an untied model of ~80 MB whose head (65 MB in float32) is drawn last (its
    random draw once went through two float32 temporaries of its size: 35 MB more at the peak), and one whose
    layers (53 MB each in float32) are rounded to FP8 (the rounding once took three float32 copies of a 34 MB
    projection in Triton's interpreter: 80 MB more). glibc is made to return freed blocks at once (a fixed mmap
    threshold), so what the resident size counts is live."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", PEAK_BUILD, json.dumps(model)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peak, estimate = map(int, result.stdout.split())
    assert peak <= estimate + (16 << 20), (peak, estimate)  # the interpreter's own pages touched on the way

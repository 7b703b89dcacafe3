"""What the device can do at best: its copy bandwidth and matmul rate, measured once and cached.

The cache is JSON, {key: {"copy_bytes_per_s": ..., "matmul_flop_per_s": ...}}, in
$MINIPAGED_CACHE_DIR/device_rates.json (default ~/.cache/minipaged/), keyed by the device's name (on
the CPU: machine and torch's thread count), the dtype and the torch version. A file that cannot be read
as such is ignored and rewritten.
"""
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("minipaged")
CACHE_FILE = "device_rates.json"
RATE_KEYS = ("copy_bytes_per_s", "matmul_flop_per_s")
# (bytes copied, matmul size n for n x n @ n x n, timed repeats): on CUDA large enough to reach the peak
# rates, on the CPU small enough that measuring takes well under 2 s
SIZES = {"cuda": (2 * 2**30, 8192, 10), "cpu": (256 * 2**20, 512, 5)}


def device_rates(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(copy bytes per second, counting bytes read and written; matmul FLOP per second in `dtype`, for an
    FP8 dtype torch._scaled_mm's): from the cache, else measured now and cached."""
    key, path = device_key(device, dtype), cache_path()
    cache = read_cache(path)
    rates, source = cached_rates(cache.get(key)), f"cached in {path}"
    if rates is None:
        rates, source = measure(device, dtype), f"measured, cached in {path}"
        cache[key] = dict(zip(RATE_KEYS, rates))
        write_cache(path, cache)
    log.info("%s: copy %.1f GB/s, matmul %.3f TFLOP/s (%s)", key, rates[0] / 1e9, rates[1] / 1e12, source)
    return rates


def device_key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu {platform.machine()} {torch.get_num_threads()} threads"
    return f"{name} | {str(dtype).removeprefix('torch.')} | torch {torch.__version__}"


def cache_path() -> Path:
    return Path(os.environ.get("MINIPAGED_CACHE_DIR") or Path.home() / ".cache" / "minipaged") / CACHE_FILE


def read_cache(path: Path) -> dict:
    """The cache's entries; {} when there is no file or it is not a JSON object (it is rewritten then)."""
    try:
        cache = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring the device-rates cache %s: %s", path, err)
        return {}
    if not isinstance(cache, dict):
        log.warning("ignoring the device-rates cache %s: not a JSON object", path)
        return {}
    return cache


def cached_rates(entry) -> tuple[float, float] | None:
    """An entry's two rates, or None unless both are positive numbers."""
    if not isinstance(entry, dict):
        return None
    rates = tuple(entry.get(k) for k in RATE_KEYS)
    if all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in rates):
        return float(rates[0]), float(rates[1])
    return None


def write_cache(path: Path, cache: dict) -> None:
    """Write through a temporary file and a rename; a cache that cannot be written is only logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not write the device-rates cache %s: %s", path, err)


@torch.inference_mode()
def measure(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """Median rates over timed repeats after a warm-up: a device-to-device copy (bytes read + written)
    and an n x n x n matmul on random data (2 n^3 FLOPs), the fastest of matmuls(n, dtype, device)."""
    num_bytes, n, repeats = SIZES[device.type]
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, repeats)
    del src, dst
    matmul_s = min(median_seconds(fn, device, repeats) for fn in matmuls(n, dtype, device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * num_bytes / copy_s, 2 * n**3 / matmul_s


def matmuls(n: int, dtype: torch.dtype, device: torch.device) -> list:
    """The ways to multiply two n x n matrices in `dtype` (random data) that the rate takes the fastest of:
    torch.matmul; for an FP8 dtype, torch._scaled_mm into bfloat16 with a scale per row of each operand (what
    ops.fp8_matmul runs above a few rows) and with one per tensor (cuBLASLt), CUDA of compute capability
    8.9+ only (engine/models/quantization.py's fp8_gemms)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        out = torch.empty(n, n, dtype=dtype, device=device)
        return [lambda: torch.matmul(a, b, out=out)]
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    rows, one = torch.ones(n, 1, device=device), torch.ones((), device=device)
    return [lambda: torch._scaled_mm(a, b.t(), scale_a=rows, scale_b=rows.t(), out_dtype=torch.bfloat16),
            lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)]


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median time of fn() over `repeats` calls after one untimed call; CUDA events on CUDA."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)

"""Which eager calls of a job hold the host until the device has drained: python3 benchmarks/eager_waits.py
OVERRIDES... (engine.run's overrides, e.g. job=bench model=qwen3-0.6b job.workload=shared_prefix).

Runs engine.run with every eager `compute_logits`, `F.linear` and `Tensor.addmm_` (the projections and the sums
into the residual stream) on CUDA, not those a graph captures, timed on the host, with a CUDA event recorded
just before each and the caching allocator's counters read around it (the run is slower for it: its figures
are not the bench's). Prints each call over SLOW_MS (2) ms, or one that changed a counter, with its
shape, whether the device had finished all work before it by the time it returned, and the counters' changes.
A slow call that found the device drained and changed no counter waited for the device inside the library
(session 48: cuBLAS's first launch of a kernel at a row count the warm-up had not multiplied). On the CPU it
runs the job and prints nothing."""
import os
import runpy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine.models.decoder as decoder  # noqa: E402

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
SLOW_MS = float(os.environ.get("SLOW_MS", 2.0))


def watched(fn, name: str, shape_of):
    """fn, timed as above on its eager CUDA calls."""
    def call(*args, **kwargs):
        x = shape_of(*args)
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return fn(*args, **kwargs)
        before = torch.cuda.memory_stats()
        event = torch.cuda.Event()
        event.record()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        ms = 1e3 * (time.perf_counter() - start)
        drained = event.query()
        after = torch.cuda.memory_stats()
        changed = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS if after.get(k, 0) != before.get(k, 0)}
        if ms > SLOW_MS or changed:
            print(f"{name} {tuple(x.shape)}: {ms:.1f} ms, device drained {drained}, {changed}", flush=True)
        return result
    return call


def main(overrides: list[str]) -> None:
    decoder.DecoderForCausalLM.compute_logits = watched(decoder.DecoderForCausalLM.compute_logits, "compute_logits",
                                                        lambda self, hidden, out=None: hidden)
    F.linear = watched(F.linear, "linear", lambda x, *rest: x)
    torch.Tensor.addmm_ = watched(torch.Tensor.addmm_, "addmm_", lambda residual, *rest: residual)
    sys.argv = ["engine.run", *overrides]
    runpy.run_module("engine.run", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

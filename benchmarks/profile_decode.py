"""Where a decode step's time goes on the GPU: busy share and host overhead per step (issue 4).

Builds the engine on the Qwen3-0.6B shape, prefills N prompts, then profiles decode steps with
torch.profiler: GPU busy share = summed kernel time / wall time of those steps; host overhead per step
= wall time - kernel time, per step. Usage: python3 benchmarks/profile_decode.py [num_seqs] [context]
"""
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.config import register_configs  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402


def main(num_seqs: int = 256, context: int = 1024, steps: int = 50, temperature: float = 0.6) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=qwen3-0.6b", f"scheduler.max_num_seqs={num_seqs}",
                                           "scheduler.max_num_batched_tokens=16384", "job=bench"])
    engine = LLMEngine(cfg)
    generator = torch.Generator().manual_seed(0)
    for i in range(num_seqs):
        prompt = torch.randint(0, 10000, (context,), generator=generator).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=temperature, max_tokens=10 * steps, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6  # us -> s
    print(f"decode batch {num_seqs}, context ~{context}: {wall / steps * 1e3:.2f} ms/step wall, "
          f"{busy / steps * 1e3:.2f} ms/step GPU busy ({100 * busy / wall:.1f}%), "
          f"host overhead {(wall - busy) / steps * 1e3:.2f} ms/step, {num_seqs * steps / wall:.0f} tok/s")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))

"""Compiling Triton kernel variants one after another against through engine/kernel_compiles.py's CompilePool, on
any machine: a stand-in driver targets sm_90 (the H200's), so Triton compiles real cubins with its ptxas and
launches nothing. Six variants: RMSNorm at two widths, a bfloat16 prefill attention, decode attention at 1 and 4
splits (with its split merge). Each mode runs in a process of its own with an empty TRITON_CACHE_DIR.
Usage: python benchmarks/compile_pool.py [--workers 2] [--rounds 2]"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's ops, not benchmarks/ops.py


def compile_six(mode: str, workers: int) -> None:
    """In a child: the six variants, in this process (serial) or through a pool of `workers` (pool); prints the
    seconds from the first launch until every variant is on disk."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class SM90:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(SM90())
    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: run(self, *args, grid=grid, warmup=True, **kwargs)
    import ops.fused as fused
    import ops.paged_attention as attention
    from engine.kernel_compiles import CompilePool

    bf16, i32 = torch.bfloat16, torch.int32
    q, qd = torch.randn(8, 16, 128, dtype=bf16), torch.randn(2, 16, 128, dtype=bf16)
    cache, tables = torch.zeros(3, 8, 16, 128, dtype=bf16), torch.tensor([[0], [1]], dtype=i32)
    lens, cu = torch.tensor([5, 3], dtype=i32), torch.tensor([0, 5, 8], dtype=i32)
    calls = [lambda w=w: fused.rms_norm(torch.randn(4, w, dtype=bf16), torch.randn(w, dtype=bf16), 1e-6)
             for w in (1024, 3072)]
    calls.append(lambda: attention.paged_attention_prefill(q, cache, cache, tables, cu, lens, 0.1))
    calls += [lambda s=s: attention.paged_attention_decode(qd, cache, cache, tables, lens, 0.1, max_seq_len=16,
                                                           num_splits=s) for s in (1, 4)]
    pool = CompilePool(workers, start_now=True) if mode == "pool" else None
    while pool is not None and pool.ready < workers:
        time.sleep(0.02)
    start = time.perf_counter()
    if pool is not None:
        with pool.ahead():
            for call in calls:
                call()
        pool.close()
    else:
        for call in calls:
            call()
    print(f"{mode}: {time.perf_counter() - start:.2f} s, {len(os.listdir(os.environ['TRITON_CACHE_DIR']))} variants "
          f"on disk{f', {pool.sent} through {workers} workers' if pool else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=["serial", "pool"])
    args = parser.parse_args()
    if args.child:
        compile_six(args.child, args.workers)
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for _ in range(args.rounds):
        for mode in ("serial", "pool"):
            with tempfile.TemporaryDirectory() as cache:
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--workers", str(args.workers)],
                                     env={**env, "TRITON_CACHE_DIR": cache},
                                     capture_output=True, text=True, check=True)
                print(out.stdout.strip())


if __name__ == "__main__":
    main()

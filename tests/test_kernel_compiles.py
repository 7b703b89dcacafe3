"""engine/kernel_compiles.py: a dry pass launches no kernel and sends the variants that neither this process nor
Triton's disk cache holds to worker processes; the launches after it find them on disk.

Each test runs in a child process of its own: no Triton interpreter there (tests/conftest.py sets it for
this one), an empty TRITON_CACHE_DIR, and a stand-in driver whose target is an H100/H200 (sm_90), so that
Triton compiles real cubins on this machine (its ptxas) and a launch gets as far as its compilation. The
oracle of "found on disk" is Triton's own: a compilation that hits its cache never builds the kernel's IR
(ASTSource.make_ir); one that misses does, which each test also shows on a variant it never sent."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import os, sys, threading, time
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

class SM90:  # what JITFunction.run asks of a driver before it compiles
    def get_current_device(self): return 0
    def get_current_stream(self, device): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

driver.set_active(SM90())
_run = JITFunction.run
def compile_only(self, *args, grid, warmup, **kwargs):  # no device to launch on here
    return _run(self, *args, grid=grid, warmup=True, **kwargs)
JITFunction.run = compile_only

import ops.fused as F
import ops.paged_attention as A
from engine.kernel_compiles import CompilePool

BUILDS = []
_make_ir = ASTSource.make_ir
def counted_make_ir(*args, **kwargs):
    BUILDS.append(1)
    return _make_ir(*args, **kwargs)
ASTSource.make_ir = counted_make_ir

def builds(op):
    # the kernels op launches, compiled (here, or found on disk) and not launched: IR builds it took here
    before = len(BUILDS)
    op()
    return len(BUILDS) - before

def rms_norm(width):
    return lambda: F.rms_norm(torch.randn(4, width), torch.randn(width), 1e-6)

def prefill_attention():  # 2 sequences of 5 and 3 tokens, blocks of 16, bfloat16 (dtype constexprs)
    q = torch.randn(8, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 2, 16, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    return lambda: A.paged_attention_prefill(q, cache, cache, tables, torch.tensor([0, 5, 8], dtype=torch.int32),
                                             torch.tensor([5, 3], dtype=torch.int32), 0.125)

def until_ready(pool, n):
    deadline = time.monotonic() + 120
    while pool.ready < n:
        assert time.monotonic() < deadline, "workers not ready in 120 s"
        time.sleep(0.05)
"""


def run_child(body: str, tmp_path: Path) -> None:
    """Runs PRELUDE then body in a child process; its assertions are the test's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body) + "\nprint('passed')"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.split()[-1:] == ["passed"], result.stderr[-4000:]


@pytest.fixture(autouse=True)
def needs_a_cuda_backend():
    pytest.importorskip("triton.backends.nvidia.compiler")


def test_the_variants_a_dry_pass_meets_compile_in_workers_and_are_found_on_disk_after(tmp_path):
    run_child("""
        pool = CompilePool(2, start_now=True)
        until_ready(pool, 2)
        with pool.ahead():  # three variants, one of them twice: RMSNorm at row widths 64 and 200, attention
            for op in (rms_norm(64), rms_norm(64), rms_norm(200), prefill_attention()):
                op()
        assert (pool.sent, pool.failed, len(BUILDS)) == (3, 0, 0), (pool.sent, pool.failed, len(BUILDS))
        F._rms_norm_kernel.device_caches.clear()  # forgotten here: compiled anew from the disk cache
        A._prefill_kernel.device_caches.clear()
        assert builds(rms_norm(64)) == 0 and builds(rms_norm(200)) == 0 and builds(prefill_attention()) == 0
        assert builds(rms_norm(96)) == 1  # a variant no worker compiled
        pool.close()
    """, tmp_path)


def test_close_ends_the_workers_and_closes_their_pipes_ready_or_not(tmp_path):
    run_child("""
        import gc, warnings
        warnings.simplefilter("error", ResourceWarning)  # an unclosed pipe found by the collector raises
        for ready in (True, False):
            pool = CompilePool(2, start_now=True)
            if ready:
                until_ready(pool, 2)
            workers = list(pool._workers)
            pool.close()
            pool.close()  # twice is once
            assert all(w.returncode is not None and w.stdin.closed and w.stdout.closed for w in workers)
            assert not any(t.is_alive() for t in pool._threads)
            del pool, workers
            gc.collect()
    """, tmp_path)


def test_a_variant_already_on_disk_compiles_here_and_starts_no_worker(tmp_path):
    run_child("""
        assert builds(rms_norm(64)) == 1
        F._rms_norm_kernel.device_caches.clear()  # forgotten by this process, still on disk
        pool = CompilePool(2)
        with pool.ahead():
            built = builds(rms_norm(64))
        assert (built, pool.sent, pool.ready) == (0, 0, 0), (built, pool.sent, pool.ready)
        assert F._rms_norm_kernel.device_caches[0][0], "compiled here, in this process' cache"
        pool.close()
    """, tmp_path)


def test_launches_of_other_threads_and_after_the_block_compile_as_usual(tmp_path):
    run_child("""
        pool = CompilePool(1, start_now=True)
        until_ready(pool, 1)
        in_thread = []
        with pool.ahead():
            other = threading.Thread(target=lambda: in_thread.append(builds(rms_norm(64))))
            other.start()
            other.join()
        assert (in_thread, pool.sent) == ([1], 0), (in_thread, pool.sent)
        assert builds(rms_norm(200)) == 1 and pool.sent == 0
        pool.close()
    """, tmp_path)


def test_a_dead_worker_or_a_wait_that_runs_out_leaves_the_variants_to_their_launches(tmp_path):
    run_child("""
        pool = CompilePool(1, start_now=True)
        until_ready(pool, 1)
        pool._workers[0].kill()  # the only worker dies: what was sent to it fails, nothing waits for long
        start = time.monotonic()
        with pool.ahead():
            rms_norm(64)()
        assert (pool.sent, pool.failed, pool.ready) == (1, 1, 0), (pool.sent, pool.failed, pool.ready)
        assert time.monotonic() - start < 60
        assert builds(rms_norm(64)) == 1  # compiled here at its launch
        pool.close()

        slow = CompilePool(1, timeout_s=0.0, start_now=True)  # no compilation is done in no time
        until_ready(slow, 1)
        with slow.ahead():
            rms_norm(200)()
        assert slow.sent == 1 and all(w.poll() is not None for w in slow._workers), "stopped after the wait"
        with slow.ahead():  # a closed pool sends nothing: the variant compiles here
            built = builds(rms_norm(96))
        assert (built, slow.sent) == (1, 1), (built, slow.sent)
    """, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels on CUDA only")
def test_a_cuda_start_up_with_an_empty_cache_compiles_the_graphs_kernels_in_workers(tmp_path):
    """The engine with an empty Triton cache: its pool's workers compile what the KV pool's trial and the
    graphs' dry passes send, and the graphs' captures then build no kernel in the engine's process."""
    run_child("""
        from engine.config import engine_config
        from engine import cuda_graphs, kernel_compiles
        from engine.engine import LLMEngine

        driver.reset_active()  # the real CUDA driver here, and launches
        JITFunction.run = _run
        pools, graph_builds = [], []
        made = kernel_compiles.CompilePool.__init__
        kernel_compiles.CompilePool.__init__ = lambda self, *a, **k: (pools.append(self), made(self, *a, **k))[1]
        captured = cuda_graphs.DecodeGraphs.__init__
        def counted(self, *args, **kwargs):
            before = len(BUILDS)
            captured(self, *args, **kwargs)
            graph_builds.append(len(BUILDS) - before)
        cuda_graphs.DecodeGraphs.__init__ = counted
        # a small share: this child sits beside the suite's other workers (tests/conftest.py shares theirs)
        engine = LLMEngine(engine_config("tiny", max_num_seqs=24, max_model_len=256, gpu_memory_utilization=0.05))
        (pool,) = pools
        assert pool.sent > 0 and pool.failed == 0, (pool.sent, pool.failed)
        assert graph_builds == [0], graph_builds
    """, tmp_path)


def test_triton_compiles_as_before_once_every_dry_pass_has_ended_even_by_an_error(tmp_path):
    """Two threads' dry passes overlap: Triton's compile stays redirected while either is under way, the
    first one's error included, and is Triton's own again after the second ends."""
    run_child("""
        original = JITFunction._do_compile
        first, second = CompilePool(1), CompilePool(1)
        entered, leave = threading.Event(), threading.Event()

        def other():
            with second.ahead():
                entered.set()
                leave.wait(60)

        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(60)
        try:
            with first.ahead():
                assert JITFunction._do_compile is not original
                raise ValueError("inside the block")
        except ValueError:
            pass
        assert JITFunction._do_compile is not original  # the other thread's pass is still under way
        leave.set()
        thread.join()
        assert JITFunction._do_compile is original
    """, tmp_path)


def test_a_dry_pass_launches_nothing_even_where_it_compiles_here(tmp_path):
    """With Triton's own launching run (the stand-in driver cannot launch: a launch would raise), a dry pass
    whose workers have only just started compiles a missing variant in this process and launches it not, nor
    a variant compiled before; run_compiled_ahead's real call after its dry pass is a launch."""
    run_child("""
        from engine.kernel_compiles import run_compiled_ahead

        assert builds(rms_norm(64)) == 1
        JITFunction.run = _run  # launches from here on
        pool = CompilePool(1)  # no worker started: a variant missing from disk compiles here
        with pool.ahead():
            built = builds(rms_norm(200)) + builds(rms_norm(64))
        assert (built, pool.sent) == (1, 0), (built, pool.sent)
        try:
            run_compiled_ahead(pool, rms_norm(96))
        except Exception as err:  # the real call launched, which the stand-in driver cannot
            assert "launcher_cls" in str(err), err
        else:
            raise AssertionError("the call after the dry pass did not launch")
        pool.close()
    """, tmp_path)

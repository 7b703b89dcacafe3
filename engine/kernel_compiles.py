"""Triton compilations ahead of the launches, side by side in worker processes (CompilePool).

Triton compiles a kernel variant at its first launch, in the launching thread: a fresh machine's start-up
compiled 33 variants in 17.8 s (benchmarks/NOTES.md, session 24), one after another in the KV pool's trial
step, the samplers' first draws and the graph captures. A compilation holds the GIL for about two thirds of
its time, so threads barely overlap them; processes do. Within CompilePool.ahead() a thread makes a dry pass
of calls that are about to run for real: its Triton launches launch nothing and only compile, each variant
that is neither compiled in this process nor in Triton's disk cache in a worker, which compiles it into that
cache; leaving the block waits for them. The real calls then find every variant on disk
(run_compiled_ahead: a dry pass, then the call).

A dry pass launches no Triton kernel, so every output of one stays unwritten and the torch operations in
between run on whatever is there: it may run code whose torch operations take no index from a kernel's
output (a decoder's forward, dense or mixture of experts, and the samplers: their indices are the step's
inputs, or pass from kernel to kernel). A variant that no worker can take yet (they import torch, triton and
the kernels first, which the caller's own start-up overlaps), one a worker fails to compile, or one the dry
pass did not meet, compiles at its launch as before; a wait longer than timeout_s stops the workers and
leaves the rest to the launches.

A worker is `python -m engine.kernel_compiles`: it imports the kernels' modules, says it is ready, then
compiles the tasks it reads from stdin (pickles) and answers each on stdout. Not multiprocessing: its spawn
and forkserver workers import the caller's main module (a user's script without a main guard would run
again in each), and a fork of a process with CUDA and compiler threads may deadlock.
"""
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

log = logging.getLogger("minipaged")

WORKER_IMPORTS = ("ops.fused", "ops.paged_attention", "ops.cascade", "ops.sampling")  # torch, triton, the kernels
COMPILE_TIMEOUT_S = 300.0
# the parameters of the JITFunction methods a dry pass stands in for (Triton 3.6 to 3.9)
_TRITON_PARAMS = {"run": ["self", "args", "grid", "warmup", "kwargs"],
                  "_do_compile": ["self", "key", "signature", "device", "constexprs", "options", "attrs", "warmup"]}


def start_compile_pool(device) -> "CompilePool | None":
    """On CUDA a CompilePool of half the CPUs, at most 8 (the host keeps cores for the engine), whose workers start
    now if Triton's disk cache is empty (a fresh machine: they import while the model builds), else at the first
    variant missing from it; None on the CPU (no compilation there) or where this Triton's internals differ (each
    kernel then compiles at its launch)."""
    if device.type != "cuda":
        return None
    try:
        import triton

        cache = triton.knobs.cache.dir
        empty = not (os.path.isdir(cache) and os.listdir(cache))
        return CompilePool(max(1, min(8, (os.cpu_count() or 2) // 2)), start_now=empty)
    except (ImportError, AttributeError, RuntimeError, OSError) as err:
        log.warning("compile pool: not started (%s); kernels compile at their launches", err)
        return None


class CompilePool:
    """Worker processes that compile Triton kernel variants into Triton's disk cache (see the module's
    docstring), started at construction (start_now) or at the first variant sent. Invariants: outside
    ahead(), Triton's launches are untouched; inside, only the entering thread's are redirected; a variant
    goes to a worker at most once; a worker runs one compilation at a time."""

    def __init__(self, workers: int, timeout_s: float = COMPILE_TIMEOUT_S, start_now: bool = False):
        import triton.runtime.jit as jit

        for name, params in _TRITON_PARAMS.items():
            if list(inspect.signature(getattr(jit.JITFunction, name)).parameters) != params:
                raise RuntimeError(f"this triton's JITFunction.{name} has another signature")
        self.timeout_s = timeout_s
        # workers ready; variants sent to them, failed there; seconds waited for them
        self.ready, self.sent, self.failed, self.wait_s = 0, 0, 0, 0.0
        self._lock = threading.Lock()
        self._tasks: list[tuple[bytes, concurrent.futures.Future]] = []
        self._has_tasks = threading.Condition(self._lock)
        self._sent: dict[str, concurrent.futures.Future] = {}  # by Triton's cache key
        self._closed = False
        self.num_workers, self._workers, self._threads = workers, [], []
        if start_now:
            self._start_workers()

    @property
    def started(self) -> bool:
        """Whether the workers were started: Triton's disk cache was empty, or a dry pass met a variant it lacks."""
        return bool(self._workers)

    def _start_workers(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for _ in range(self.num_workers):
            worker = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env)
            thread = threading.Thread(target=self._serve, args=(worker,), daemon=True, name="compile-pool")
            self._workers.append(worker)
            self._threads.append(thread)
            thread.start()

    @contextlib.contextmanager
    def ahead(self):
        """A dry pass in this thread: its Triton launches launch nothing (their outputs stay unwritten) and only
        compile, a variant neither here nor on disk in a worker; on leaving, waits for the variants it sent (at
        most timeout_s). Not nested in a thread."""
        from triton.runtime.jit import JITFunction

        waiting: list[concurrent.futures.Future] = []
        with _PATCH_LOCK:
            if threading.get_ident() in _DRY_PASSES:
                raise RuntimeError("a dry pass is already under way in this thread")
            if not _DRY_PASSES:
                _TRITONS.update(run=JITFunction.run, do_compile=JITFunction._do_compile)
                JITFunction.run, JITFunction._do_compile = _compile_only, _compile_or_send
            _DRY_PASSES[threading.get_ident()] = self, waiting
        try:
            yield self
        finally:
            with _PATCH_LOCK:
                del _DRY_PASSES[threading.get_ident()]
                if not _DRY_PASSES:
                    JITFunction.run, JITFunction._do_compile = _TRITONS["run"], _TRITONS["do_compile"]
        self._wait(waiting)

    def _send(self, waiting: list, fn, signature, device, constexprs, options, attrs) -> bool:
        """Queues a variant that Triton's disk cache lacks for a worker (once, whichever thread meets it first)
        and adds it to waiting; False: compile it here."""
        from triton.compiler.compiler import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_key, get_cache_manager

        if self._closed:
            return False
        _, _, target, backend, _ = fn.device_caches[device]
        src = fn.ASTSource(fn, signature, constexprs, attrs)
        # the cache's key and file as triton.compile makes them
        parsed = backend.parse_options(dict(options.__dict__, **src.parse_options()))
        key = get_cache_key(src, backend, parsed, get_cache_invalidating_env_vars())
        key = hashlib.sha256(key.encode()).hexdigest()
        with self._lock:
            future = self._sent.get(key)
            if future is None:
                if get_cache_manager(key).get_group(f"{src.name[:150]}.json") is not None:
                    return False
                future = self._queue(src, fn, signature, constexprs, attrs, target, options)
                if future is None:
                    return False
                self._sent[key] = future
        waiting.append(future)
        return True

    def _queue(self, src, fn, signature, constexprs, attrs, target, options) -> concurrent.futures.Future | None:
        """A variant's task queued for the workers, started first if need be (the caller holds the lock); None
        where none can take it: the workers still import, cannot start, or the task does not pickle."""
        if not self._workers:
            try:
                self._start_workers()
            except OSError as err:
                log.warning("compile pool: no worker started (%s); kernels compile at their launches", err)
                self._closed = True
                return None
        if self.ready == 0:
            return None
        try:
            task = pickle.dumps((type(src), fn.fn.__module__, fn.fn.__qualname__, signature, constexprs, attrs,
                                 target, options.__dict__))
        except Exception as err:  # a constexpr that does not pickle
            log.debug("compile pool: %s compiles in this process (%s)", fn.fn.__qualname__, err)
            return None
        future = concurrent.futures.Future()
        self._tasks.append((task, future))
        self._has_tasks.notify()
        self.sent += 1
        return future

    def _serve(self, worker: subprocess.Popen) -> None:
        """A worker's thread: waits for it to be ready, then hands it tasks one at a time until close()."""
        try:
            if pickle.load(worker.stdout) != "ready":
                return
        except (EOFError, OSError, pickle.UnpicklingError):
            return
        with self._lock:
            self.ready += 1
        while True:
            with self._has_tasks:
                self._has_tasks.wait_for(lambda: self._tasks or self._closed)
                if self._closed:
                    return
                task, future = self._tasks.pop(0)
            try:
                pickle.dump(task, worker.stdin)
                worker.stdin.flush()
                error = pickle.load(worker.stdout)
            except (EOFError, OSError, pickle.UnpicklingError) as err:
                future.set_exception(RuntimeError(f"compile worker exited ({worker.poll()}): {err!r}"))
                with self._lock:
                    self.ready -= 1
                    if self.ready == 0:  # no worker left to take the queued ones
                        self._fail_queued("no compile worker left")
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(RuntimeError(error))

    def _wait(self, futures: list[concurrent.futures.Future]) -> None:
        """Waits for these variants (at most timeout_s); a failed one is left to its launch, and a wait that runs
        out stops the workers (close)."""
        start = time.perf_counter()
        done, late = concurrent.futures.wait(set(futures), timeout=self.timeout_s)
        for future in done:
            if future.exception() is not None:
                self.failed += 1
                log.warning("compile pool: a kernel failed to compile in a worker (%s); it compiles at its launch",
                            future.exception())
        self.wait_s += time.perf_counter() - start
        if late:
            log.warning("compile pool: %d kernel compilations still running after %.0f s; the workers are stopped "
                        "and those kernels compile at their launches", len(late), self.timeout_s)
            self.close()

    def _fail_queued(self, reason: str) -> None:
        """Ends the queued tasks' futures with reason (the caller holds the lock)."""
        for _, future in self._tasks:
            future.set_exception(RuntimeError(reason))
        self._tasks.clear()

    def close(self) -> None:
        """Stops the workers, a compilation under way included, and closes their pipes once the threads that
        read them have ended (a killed worker's pipe reads end at once); a later ahead() compiles in this
        process."""
        with self._has_tasks:
            self._closed = True
            self._fail_queued("compile pool closed")
            self._has_tasks.notify_all()
        for worker in self._workers:
            worker.kill()
            worker.wait()
        for thread in self._threads:
            thread.join(timeout=10)
        for worker in self._workers:
            with contextlib.suppress(OSError):  # bytes of a task left in the buffer cannot reach a killed worker
                worker.stdin.close()
            worker.stdout.close()


_PATCH_LOCK = threading.Lock()
_DRY_PASSES: dict[int, tuple[CompilePool, list]] = {}  # by thread: its pool and the variants it waits for
_TRITONS: dict = {}  # JITFunction's own run and _do_compile, while a dry pass is under way


def run_compiled_ahead(compiles: CompilePool | None, call, *args):
    """call(*args), after a dry pass of it where there is a pool: its kernels compiled side by side first."""
    if compiles is not None:
        with compiles.ahead():
            call(*args)
    return call(*args)


def _compile_only(fn, *args, grid, warmup, **kwargs):
    """JITFunction.run during dry passes: in a dry pass's thread it compiles and launches nothing (as warmup)."""
    return _TRITONS["run"](fn, *args, grid=grid, warmup=warmup or threading.get_ident() in _DRY_PASSES, **kwargs)


def _compile_or_send(fn, key, signature, device, constexprs, options, attrs, warmup):
    """JITFunction._do_compile during dry passes: a variant that the calling thread's pool sends to a worker
    is not compiled here (None); any other compiles here."""
    entry = _DRY_PASSES.get(threading.get_ident())
    if entry is not None and entry[0]._send(entry[1], fn, signature, device, constexprs, options, attrs):
        return None
    return _TRITONS["do_compile"](fn, key, signature, device, constexprs, options, attrs, warmup)


def compile_variant(task: bytes) -> None:
    """Compiles one variant (CompilePool._send's task) into Triton's disk cache."""
    import triton

    source_class, module, qualname, signature, constexprs, attrs, target, options = pickle.loads(task)
    fn = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    triton.compile(source_class(fn, signature, constexprs, attrs), target=target, options=options)


def serve() -> None:
    """A worker's loop (see the module's docstring): its answers go to the original stdout, anything else that
    the compilations print to stderr."""
    answers, tasks = os.fdopen(os.dup(1), "wb"), sys.stdin.buffer
    os.dup2(2, 1)
    for module in WORKER_IMPORTS:
        importlib.import_module(module)
    pickle.dump("ready", answers)
    answers.flush()
    while True:
        try:
            task = pickle.load(tasks)
        except EOFError:
            return
        try:
            compile_variant(task)
            error = None
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        pickle.dump(error, answers)
        answers.flush()


if __name__ == "__main__":
    serve()

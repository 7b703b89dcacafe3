"""Where a fresh start-up's Triton compilations go: runs `python -m engine.run ARGS` with every compilation
timed (Triton's JITFunction._do_compile, which a cache hit also passes through, quickly), and prints at exit
the kernels by their total seconds (name, variants, seconds) and the sum.
Usage (GPU): TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/triton_compiles.py job=bench job.num_prompts=64
(an empty cache directory: a fresh machine's compilations; the kernels' own cache otherwise)."""
import atexit
import collections
import runpy
import sys
import time
from pathlib import Path

import triton.runtime.jit as jit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's ops, not benchmarks/ops.py

SPENT = collections.defaultdict(lambda: [0, 0.0])  # kernel name: [compilations, seconds]
_compile = jit.JITFunction._do_compile


def _timed_compile(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return _compile(self, *args, **kwargs)
    finally:
        entry = SPENT[self.fn.__name__]
        entry[0] += 1
        entry[1] += time.perf_counter() - start


def report() -> None:
    total = sum(seconds for _, seconds in SPENT.values())
    print(f"triton compiles: {sum(n for n, _ in SPENT.values())} in {total:.2f} s", file=sys.stderr)
    for name, (calls, seconds) in sorted(SPENT.items(), key=lambda item: -item[1][1])[:40]:
        print(f"  {name:40} {calls:4d} {seconds:7.2f} s", file=sys.stderr)


if __name__ == "__main__":
    jit.JITFunction._do_compile = _timed_compile
    atexit.register(report)
    sys.argv = ["engine.run"] + sys.argv[1:]
    runpy.run_module("engine.run", run_name="__main__")

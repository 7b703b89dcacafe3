"""What every generating job does: hold its run directory, drive the engine with a progress bar, then write
steps.parquet and summary.parquet in the run directory."""
import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from tqdm import tqdm

from engine.engine import LLMEngine
from engine.sequence import Sequence
from jobs import JobError
from jobs.parquet import OutputError, write_atomic

log = logging.getLogger("minipaged")
LOCK_NAME = ".minipaged.lock"


def run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def run_dir_problem(directory: Path) -> str | None:
    """Why `directory` cannot be (made) a writable directory; None if it can."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        return "is a file, not a directory" if existing == directory else f"cannot be created: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == directory else f"cannot be created in {existing} (not writable)"
    return None


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml). on_run_start runs before Hydra creates hydra.run.dir and writes its
    record there (.hydra/, the log file: hydra/_internal/hydra.py calls it before run_job): stop with one
    line when the directory cannot be a writable directory (Hydra would fail with a traceback) or another
    run holds it, and else take its lock for the life of this process (run_lock then finds it held), so a
    refused run writes nothing there. A multirun has no hook that early: its jobs lock in run_lock."""

    def on_run_start(self, config, **kwargs) -> None:
        directory = Path(config.hydra.run.dir)
        problem = run_dir_problem(directory)
        try:
            if problem:
                raise JobError(f"hydra.run.dir {directory} {problem}")
            directory.mkdir(parents=True, exist_ok=True)
            _HELD[directory.resolve()] = _lock(directory)
        except (JobError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(1) from None


_HELD: dict[Path, object] = {}  # run directories this process holds the lock of, to its end: their open lock files


def _lock(directory: Path):
    """<directory>/.minipaged.lock, open and locked (flock) with this process's pid in it; JobError naming
    the holder's pid if another open file of it holds the lock."""
    path = directory / LOCK_NAME
    try:
        file = open(path, "a+")
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "?"
        file.close()
        raise JobError(f"{directory} is in use by another run (pid {holder}); wait for it to end or use "
                       f"another hydra.run.dir") from None
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


@contextlib.contextmanager
def run_lock(directory: Path) -> Iterator[None]:
    """Hold <directory>/.minipaged.lock (flock) while inside, unless this process holds it already (taken
    by RunDirCheck): a second run on the same directory stops at once. The kernel drops the lock when the
    holder dies, even by SIGKILL; the file itself stays."""
    if directory.resolve() in _HELD:
        yield
        return
    with _lock(directory):
        yield


class Progress:
    """A progress bar over finished requests, with the output tokens per second so far."""

    def __init__(self, total: int | None):
        self.bar = tqdm(total=total, unit="req", desc="generate", dynamic_ncols=True)
        self.output_tokens = 0

    def finished(self, output_tokens: int) -> None:
        self.output_tokens += output_tokens
        self.bar.update(1)
        self.bar.set_postfix(out_tok_s=f"{self.output_tokens / max(self.bar.format_dict['elapsed'], 1e-9):.0f}")

    def close(self) -> None:
        self.bar.close()


def drive(engine: LLMEngine, total: int, on_finish: Callable[[Sequence], None]) -> int:
    """Run the engine to completion; on_finish sees each sequence as it finishes. Returns output tokens."""
    engine.stats.restart_clock()  # time the generate loop, not the set-up before it
    progress = Progress(total)
    try:
        for seq in engine.run():
            on_finish(seq)
            progress.finished(len(seq.output_token_ids))
    finally:
        progress.close()
    return progress.output_tokens


def run_summary(engine: LLMEngine, cfg, num_requests: int, num_errors: int, prompt_tokens: int, output_tokens: int) -> dict:
    """One row of summary.parquet: the config that matters, then the run's figures (engine/stats.py)."""
    stats = engine.stats.summary(engine.num_blocks, engine.block_size, engine.max_model_len)
    wall = stats["wall_time_s"]
    return {
        "job": cfg.job.name, "model": cfg.model.name, "model_path": cfg.model.path or "",
        "dtype": str(engine.dtype).removeprefix("torch."), "device": engine.device.type,
        "device_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "block_size": engine.block_size, "num_blocks": engine.num_blocks,
        "kv_slots": engine.num_blocks * engine.block_size, "kv_budget_bytes": engine.kv_cache.bytes,
        "max_model_len": engine.max_model_len, "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "num_requests": num_requests, "num_errors": num_errors,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        **stats,
        "sampler_fallbacks": engine.sampler_fallbacks,
        "output_tok_per_s": output_tokens / wall if wall else 0.0,
        "total_tok_per_s": (prompt_tokens + output_tokens) / wall if wall else 0.0,
    }


def write_run_stats(engine: LLMEngine, cfg, directory: Path, summary: dict) -> None:
    write_stats(engine.stats.table(), cfg, directory, summary)


def write_stats(steps: pa.Table, cfg, directory: Path, summary: dict) -> None:
    write_atomic(steps, directory / "steps.parquet", cfg)
    write_atomic(pa.Table.from_pylist([summary]), directory / "summary.parquet", cfg)
    log.info("%d requests, %d output tokens in %.2f s: %.1f output tok/s; wrote %s",
             summary["num_requests"], summary["output_tokens"], summary["wall_time_s"],
             summary["output_tok_per_s"], directory)

"""What every generating job does: hold its run directory, show a progress bar, count its rows, then write
steps.parquet and summary.parquet in the run directory."""
import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from tqdm import tqdm

from engine.llm import EngineSettings
from jobs import JobError
from jobs.parquet import OutputError, remove_temporaries, write_atomic
from jobs.processor import Run

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


def run_dir_override(directory: Path) -> str:
    """hydra.run.dir=<directory> as a shell passes it on and Hydra's override grammar reads it back: quoted where
    the path holds what either would take apart (a sweep's run directory is named after its overrides: = and ,)."""
    text = str(directory)
    if re.fullmatch(r"[\w./-]+", text):
        return f"hydra.run.dir={text}"
    # Hydra's escapes inside a quoted value: a quote gets a backslash, and backslashes before a quote (or the
    # closing one) double; others stand as they are
    quoted = re.sub(r"(\\*)('|$)", lambda m: 2 * m[1] + ("\\'" if m[2] else ""), text)
    return shlex.quote(f"hydra.run.dir='{quoted}'")


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml). on_run_start runs before Hydra creates hydra.run.dir and writes its
    record there (.hydra/, the log file: hydra/_internal/hydra.py calls it before run_job): stop with one
    line when the directory cannot be a writable directory (Hydra would fail with a traceback) or another
    run holds it, and else take its lock for the life of this process (run_lock then finds it held), so a
    refused run writes nothing there. A multirun has no hook that early: its jobs lock in run_lock."""

    def on_run_start(self, config, **kwargs) -> None:
        directory = Path(config.hydra.run.dir)
        try:
            if not str(config.hydra.run.dir).strip():  # Path("") is the working directory
                raise JobError("hydra.run.dir is empty: name a directory, or leave it out (outputs/<job>/<time>)")
            problem = run_dir_problem(directory)
            if problem:
                raise JobError(f"hydra.run.dir {directory} {problem}")
            directory.mkdir(parents=True, exist_ok=True)
            _HELD[directory.resolve()] = _lock(directory)
        except OSError as err:  # a name too long, a path the kernel refuses (/proc): the checks' or mkdir's
            print(f"error: hydra.run.dir {directory} cannot be created ({err.strerror or err})", file=sys.stderr)
            raise SystemExit(1) from None
        except JobError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(1) from None


_HELD: dict[Path, object] = {}  # run directories this process holds the lock of, to its end: their open lock files


def _lock(directory: Path):
    """<directory>/.minipaged.lock, open and locked (flock) with this process's pid in it, and the temporary
    files that an earlier run killed mid-write left there removed; JobError naming the holder's pid if another
    open file of it holds the lock."""
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
    remove_temporaries(directory)
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


@contextlib.contextmanager
def signal_handlers(handlers: dict) -> Iterator[None]:
    """While inside, these {signal: handler} are installed, then the ones before are put back (None, a
    handler set outside Python: the default). Off the main thread a plain block: Python installs handlers,
    and runs them, in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def new_counts() -> dict:
    return {"num_requests": 0, "num_errors": 0, "prompt_tokens": 0, "output_tokens": 0}


def tally(counts: dict, rows: list[dict]) -> int:
    """Add the output rows of one request (one per sample, or one error row) to the counts of
    summary.parquet; returns its output tokens. prompt_tokens counts a prompt once, whatever its n."""
    output_tokens = sum(row["output_tokens"] for row in rows)
    counts["num_errors" if rows[0]["finish_reason"] == "error" else "num_requests"] += 1
    counts["prompt_tokens"] += rows[0].get("prompt_tokens") or 0
    counts["output_tokens"] += output_tokens
    return output_tokens


def summary_row(job: str, run: Run, counts: dict) -> dict:
    """One row of summary.parquet: the job, the engine's settings, the counts, the run's figures, then the
    throughput over its wall time."""
    settings = [f.name for f in dataclasses.fields(EngineSettings)]
    wall = run.summary["wall_time_s"]
    tokens = counts["prompt_tokens"] + counts["output_tokens"]
    return {"job": job, **{key: run.summary[key] for key in settings}, **counts,
            **{key: value for key, value in run.summary.items() if key not in settings},
            "output_tok_per_s": counts["output_tokens"] / wall if wall else 0.0,
            "total_tok_per_s": tokens / wall if wall else 0.0}


def write_stats(steps: pa.Table, cfg, directory: Path, summary: dict) -> None:
    write_atomic(steps, directory / "steps.parquet", cfg)
    write_atomic(pa.Table.from_pylist([summary]), directory / "summary.parquet", cfg)
    log.info("%d requests, %d output tokens in %.2f s: %.1f output tok/s; wrote %s",
             summary["num_requests"], summary["output_tokens"], summary["wall_time_s"],
             summary["output_tok_per_s"], directory)

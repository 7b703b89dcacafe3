"""Executors: where a job's requests run, chosen by `executor=NAME`, never by the job.

A job hands an executor a Processor (the shape of Ray Data LLM's processor): how each input row becomes a
Request (preprocess), how each RequestOutput becomes output rows (postprocess), and what an engine must
check or prepare before its first row (setup) and do after its last (finish). The executor owns the
engines, each an engine.LLM (the one door into the engine), and hands back a Run: steps.parquet's table and
the summary's columns that come from the engines. executor=local runs one engine in this process (below);
executor=ray one per Ray actor (jobs/ray_executor.py, imported only when asked for).

The Processor and the Run are jobs/processor.py's. `take` gets the output rows of one request at a time,
once per key, and returns its output tokens (for the progress bar).
"""
from collections.abc import Callable
from pathlib import Path

from jobs.common import Progress
from jobs.processor import Processor, Rows, Run, new_llm, run_of, startup_columns


def execute(cfg, processor: Processor, rows: Rows, num_rows: int, take: Callable[[list[dict]], int],
            run_dir: Path) -> Run:
    """Run the rows through the executor that cfg.executor names."""
    if cfg.executor.name == "ray":
        from jobs.ray_executor import run_on_ray

        return run_on_ray(cfg, processor, rows, num_rows, take)
    return run_local(cfg, processor, rows, num_rows, take, run_dir)


def run_local(cfg, processor: Processor, rows: Rows, num_rows: int, take: Callable[[list[dict]], int],
              run_dir: Path) -> Run:
    """executor=local: one engine in this process; rows are pulled as its stream has room for them."""
    llm = new_llm(cfg, processor, run_dir, processor.max_sequences(num_rows))
    try:  # closed on the way out of a failure too: a tensor-parallel engine's workers stop with it
        processor.setup(llm)
        startup = startup_columns(llm.startup_s)
        requests = (processor.preprocess(key, fields) for key, fields in rows)
        progress = Progress(num_rows)
        try:
            for out in llm.stream(requests, chat_template_kwargs=processor.chat_template_kwargs):
                progress.finished(take(processor.postprocess(out)))
        finally:
            progress.close()
        run = run_of(llm)
        run.summary.update(startup)
        processor.finish(llm)
    finally:
        llm.close()
    return run

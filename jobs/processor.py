"""What a job hands an executor (a Processor) and what it gets back (a Run); the executors themselves are
jobs/executors.py (local) and jobs/ray_executor.py.

A Processor has the shape of Ray Data LLM's processor: how each input row becomes a Request (preprocess),
how each RequestOutput becomes output rows (postprocess), and what an engine must check or prepare before
its first row (setup) and do after its last (finish). Rows are (key, fields) pairs, the key an int unique
in the job (an input row number, a request number); every output row of postprocess carries its request's
key in "row".
"""
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from engine.llm import LLM, Request, RequestOutput
from engine.startup import process_age_s
from jobs.config import engine_config_of

log = logging.getLogger("minipaged")

Rows = Iterable[tuple[int, Any]]


class Processor:
    """What a job supplies to an executor. It is pickled to every engine of executor=ray, so it holds
    only plain values (the job's settings), and setup() builds what an engine needs from its LLM."""

    output_schema: pa.Schema  # of the rows postprocess returns
    chat_template_kwargs: dict | None = None  # passed to the chat template of every conversation
    reasoning_parser: str | None = None  # the engines split outputs with it (engine/reasoning.py)

    def max_sequences(self, num_rows: int) -> int | None:
        """The most sequences num_rows rows can run (requests times samples), None where the rows decide
        (a per-row n): executor=local builds its engine for no more (LLMEngine's max_sequences)."""
        return None

    def setup(self, llm: LLM) -> None:
        """Once per engine, before its first request: checks (a chat template where needed) and state."""

    def preprocess(self, key: int, fields: Any) -> Request:
        raise NotImplementedError

    def postprocess(self, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def finish(self, llm: LLM) -> None:
        """Once per engine of executor=local, after its last request and its statistics."""


@dataclass
class Run:
    """What an executor hands back: steps.parquet's table, and the summary's columns that come from the
    engines (engine.llm.EngineSettings' fields, the run's figures, the sampler's fallbacks, and an
    executor's own timings)."""

    steps: pa.Table
    summary: dict


def new_llm(cfg, processor: Processor, run_dir=None, max_sequences: int | None = None) -> LLM:
    """The LLM an executor runs `processor` on, from the composed config."""
    return LLM.from_config(engine_config_of(cfg), run_dir, processor.reasoning_parser, max_sequences)


def startup_columns(engine_startup_s: dict) -> dict:
    """The summary's start-up columns, taken (and logged) as the run's loop begins: startup_s, the process's
    age then, split into startup_<phase>_s: before_engine (the interpreter, imports, the config and the
    job's set-up before the engine), the engine's phases (LLM.startup_s), and after_engine (the job's set-up
    after it). Only the engine's phases where the process's age is unknown (engine/startup.py)."""
    phases, age = dict(engine_startup_s), process_age_s()
    if age is None or phases["before_engine"] is None:
        phases.pop("before_engine")
        return {f"startup_{name}_s": seconds for name, seconds in phases.items()}
    phases["after_engine"] = age - sum(phases.values())
    log.info("start-up %.1f s before the first step: %s", age,
             ", ".join(f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in phases.items()))
    return {"startup_s": age, **{f"startup_{name}_s": seconds for name, seconds in phases.items()}}


def run_of(llm: LLM) -> Run:
    """The Run of one engine: its steps, its settings and the figures of its run."""
    stats = llm.stats()
    return Run(stats.table(), {**asdict(llm.settings()), **stats.figures, "sampler_fallbacks": stats.sampler_fallbacks})

"""What every generating job does: drive the engine with a progress bar, then write steps.parquet and
summary.parquet in the run directory."""
import logging
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import torch
from hydra.core.hydra_config import HydraConfig
from tqdm import tqdm

from engine.engine import LLMEngine
from engine.parquet import write_atomic
from engine.sequence import Sequence

log = logging.getLogger("minipaged")


def run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def drive(engine: LLMEngine, total: int, on_finish: Callable[[Sequence], None]) -> int:
    """Run the engine to completion; on_finish sees each sequence as it finishes. Returns output tokens."""
    output_tokens = 0
    engine.stats.restart_clock()  # time the generate loop, not the set-up before it
    with tqdm(total=total, unit="req", desc="generate", dynamic_ncols=True) as bar:
        for seq in engine.run():
            on_finish(seq)
            output_tokens += len(seq.output_token_ids)
            bar.update(1)
            bar.set_postfix(out_tok_s=f"{output_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
    return output_tokens


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
        "output_tok_per_s": output_tokens / wall if wall else 0.0,
        "total_tok_per_s": (prompt_tokens + output_tokens) / wall if wall else 0.0,
    }


def write_run_stats(engine: LLMEngine, cfg, directory: Path, summary: dict) -> None:
    write_atomic(engine.stats.table(), directory / "steps.parquet", cfg)
    write_atomic(pa.Table.from_pylist([summary]), directory / "summary.parquet", cfg)
    log.info("%d requests, %d output tokens in %.2f s: %.1f output tok/s; wrote %s",
             summary["num_requests"], summary["output_tokens"], summary["wall_time_s"],
             summary["output_tok_per_s"], directory)

"""Per-step and per-run statistics: the rows of steps.parquet and summary.parquet.

Per step (measured after scheduling, when the step's slots are allocated and its new tokens counted):
    phase                         = decode (every row decodes), prefill (no row decodes) or mixed
    num_decode_seqs               = sequences that decode one token; num_prefill_tokens = the step's other tokens
    prefix_cache_hit_tokens       = tokens that this step's admissions found in the prefix cache (not computed)
    admitted_tokens               = tokens (prompt + earlier outputs) of the sequences admitted in this step
    blocks_used                   = physical blocks held by live sequences, a block shared by several once
    blocks_free                   = blocks allocation can take: empty ones + cached_blocks (prefix-cache blocks
                                    no live sequence holds, evicted least-recently-used when needed)
    allocated_slots               = blocks_used * block_size
    internal_waste_tokens         = sum over live sequences of (-L % B): the unused tail of each last block
                                    (only full blocks are shared, so every partial block is one sequence's)
    stored_tokens                 = allocated_slots - internal_waste_tokens: tokens in the pool, each once
    logical_tokens                = sum over live sequences of L: what a cache without sharing stores
    paged_kv_utilization_pct      = stored tokens / allocated slots
    internal_waste_pct            = waste slots / allocated slots (= 100 - utilization)
    contiguous_reserved_slots     = live sequences * max_model_len: what a cache that reserves max_model_len
                                    contiguous slots per sequence would hold back for the same sequences
    contiguous_kv_utilization_pct = logical tokens / contiguous_reserved_slots
    block_table_bytes             = 4 bytes (int32) per block-table entry of the live sequences
A step with no live sequence has no defined utilization (0 in its row); run-level means skip such steps.

Per run (StatsRecorder.summary), from the steps:
    peak_/mean_paged_kv_utilization_pct, mean_internal_waste_pct, contiguous_kv_utilization_pct (mean over
    the steps, like the paged mean), peak_contiguous_kv_utilization_pct, peak_blocks_used, peak_block_table_bytes,
    max_/mean_running_seqs, preemptions, wall_time_s, prefill_/decode_/mixed_steps, and the counterfactual's
    capacity: contiguous_max_concurrent_seqs = (num_blocks * block_size) // max_model_len, the sequences a
    contiguous cache of the same KV memory could hold at once (compare with max_running_seqs);
    prefix_cache_hit_tokens (summed) and prefix_cache_hit_rate = prefix_cache_hit_tokens / admitted_tokens:
    the share of the prompt tokens (with the outputs a preempted sequence recomputes) served from the cache.
"""
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import pyarrow as pa

from engine.block_manager import KVBlockManager


def pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


@dataclass
class StepStats:
    step: int
    phase: str
    seqs: int
    tokens: int
    num_decode_seqs: int
    num_prefill_tokens: int
    prefix_cache_hit_tokens: int
    admitted_tokens: int
    running_seqs: int
    waiting_seqs: int
    blocks_used: int
    blocks_free: int
    cached_blocks: int
    stored_tokens: int
    logical_tokens: int
    allocated_slots: int
    internal_waste_tokens: int
    paged_kv_utilization_pct: float
    internal_waste_pct: float
    contiguous_reserved_slots: int
    contiguous_kv_utilization_pct: float
    block_table_bytes: int
    preemptions: int
    finished: int = 0
    step_time_s: float = 0.0


_ARROW_TYPES = {int: pa.int64(), float: pa.float64(), str: pa.string()}
STEPS_SCHEMA = pa.schema([(f.name, _ARROW_TYPES[f.type]) for f in fields(StepStats)])


def snapshot(step, batch, scheduler, manager: KVBlockManager, max_model_len: int) -> StepStats:
    lengths = np.fromiter((s.sequence_length for s in manager.sequences.values()), np.int64, len(manager.sequences))
    logical, waste = int(lengths.sum()), int((-lengths % manager.block_size).sum())  # one scan of the sequences
    allocated = manager.num_used_blocks * manager.block_size
    stored = allocated - waste
    reserved = len(manager.sequences) * max_model_len
    return StepStats(
        step=step, phase=batch.phase, seqs=len(batch.seqs), tokens=batch.num_tokens,
        num_decode_seqs=batch.num_decode_seqs, num_prefill_tokens=batch.num_prefill_tokens,
        prefix_cache_hit_tokens=batch.prefix_cache_hit_tokens, admitted_tokens=batch.admitted_tokens,
        running_seqs=len(scheduler.running), waiting_seqs=len(scheduler.waiting),
        blocks_used=manager.num_used_blocks, blocks_free=manager.num_free_blocks,
        cached_blocks=manager.num_cached_blocks, stored_tokens=stored, logical_tokens=logical,
        allocated_slots=allocated, internal_waste_tokens=waste,
        paged_kv_utilization_pct=pct(stored, allocated), internal_waste_pct=pct(waste, allocated),
        contiguous_reserved_slots=reserved, contiguous_kv_utilization_pct=pct(logical, reserved),
        block_table_bytes=4 * (logical + waste) // manager.block_size,  # ceil(L / B) int32 entries per table
        preemptions=batch.num_preempted,
    )


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def _peak(values) -> float:
    return float(max(values, default=0.0))


class StatsRecorder:
    def __init__(self):
        self.steps: list[StepStats] = []
        self.start = self._last = time.perf_counter()

    def restart_clock(self) -> None:
        """Start timing now (the generate loop begins): wall time and the first step's time count from here."""
        self.start = self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or the start)."""
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed

    def add(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def rows(self) -> list[dict]:
        return [asdict(s) for s in self.steps]

    def table(self) -> pa.Table:
        """steps.parquet: one row per step, with its schema even when there is no step."""
        return pa.Table.from_pylist(self.rows(), schema=STEPS_SCHEMA)

    def summary(self, num_blocks: int, block_size: int, max_model_len: int) -> dict:
        """Run-level figures from the steps (the config part of summary.parquet is added by the job)."""
        steps = self.steps
        live = [s for s in steps if s.allocated_slots > 0]  # steps with a defined utilization
        end = self._last if steps else time.perf_counter()
        hits, admitted = sum(s.prefix_cache_hit_tokens for s in steps), sum(s.admitted_tokens for s in steps)
        return {
            "wall_time_s": end - self.start,
            "num_steps": len(steps),
            "prefill_steps": sum(s.phase == "prefill" for s in steps),
            "decode_steps": sum(s.phase == "decode" for s in steps),
            "mixed_steps": sum(s.phase == "mixed" for s in steps),
            "prefix_cache_hit_tokens": hits,
            "prefix_cache_hit_rate": hits / admitted if admitted else 0.0,
            "peak_blocks_used": max((s.blocks_used for s in steps), default=0),
            "peak_paged_kv_utilization_pct": _peak(s.paged_kv_utilization_pct for s in live),
            "mean_paged_kv_utilization_pct": _mean(s.paged_kv_utilization_pct for s in live),
            "mean_internal_waste_pct": _mean(s.internal_waste_pct for s in live),
            "peak_internal_waste_tokens": max((s.internal_waste_tokens for s in steps), default=0),
            "max_running_seqs": max((s.running_seqs for s in steps), default=0),
            "mean_running_seqs": _mean(s.running_seqs for s in steps),
            "preemptions": sum(s.preemptions for s in steps),
            "peak_block_table_bytes": max((s.block_table_bytes for s in steps), default=0),
            "contiguous_kv_utilization_pct": _mean(s.contiguous_kv_utilization_pct for s in live),
            "peak_contiguous_kv_utilization_pct": _peak(s.contiguous_kv_utilization_pct for s in live),
            "contiguous_max_concurrent_seqs": num_blocks * block_size // max_model_len,
        }

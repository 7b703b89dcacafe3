"""Per-step and per-run statistics: the rows of steps.parquet and summary.parquet.

Per step (measured after scheduling, when the step's slots are allocated):
    paged_kv_utilization_pct      = stored tokens / allocated slots (blocks used * block_size)
    internal_waste_pct            = waste slots / allocated slots, waste = sum over live seqs of -L % B
    contiguous_kv_utilization_pct = stored tokens / (live seqs * max_model_len): a cache that reserves
                                    max_model_len contiguous slots per sequence, on the same trace
"""
import time
from dataclasses import asdict, dataclass

from engine.block_manager import KVBlockManager


def pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


@dataclass
class StepStats:
    step: int
    phase: str
    seqs: int
    tokens: int
    running_seqs: int
    waiting_seqs: int
    blocks_used: int
    blocks_free: int
    stored_tokens: int
    allocated_slots: int
    internal_waste_tokens: int
    paged_kv_utilization_pct: float
    internal_waste_pct: float
    contiguous_kv_utilization_pct: float
    block_table_bytes: int
    preemptions: int
    finished: int = 0
    step_time_s: float = 0.0


def snapshot(step, batch, scheduler, manager: KVBlockManager, max_model_len: int) -> StepStats:
    stored, waste = manager.stored_tokens(), manager.internal_fragmentation_tokens()
    allocated = manager.num_used_blocks * manager.block_size
    live = len(manager.sequences)
    return StepStats(
        step=step, phase="prefill" if batch.is_prefill else "decode", seqs=len(batch.seqs),
        tokens=batch.num_tokens, running_seqs=len(scheduler.running), waiting_seqs=len(scheduler.waiting),
        blocks_used=manager.num_used_blocks, blocks_free=manager.num_free_blocks, stored_tokens=stored,
        allocated_slots=allocated, internal_waste_tokens=waste,
        paged_kv_utilization_pct=pct(stored, allocated), internal_waste_pct=pct(waste, allocated),
        contiguous_kv_utilization_pct=pct(stored, live * max_model_len),
        block_table_bytes=4 * manager.num_used_blocks, preemptions=batch.num_preempted,
    )


class StatsRecorder:
    def __init__(self):
        self.steps: list[StepStats] = []
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

    def summary(self, num_blocks: int, block_size: int, max_model_len: int) -> dict:
        """Run-level figures from the steps (the config part of summary.parquet is added by the job)."""
        steps, n = self.steps, max(len(self.steps), 1)
        return {
            "wall_time_s": time.perf_counter() - self.start,
            "num_steps": len(steps),
            "prefill_steps": sum(s.phase == "prefill" for s in steps),
            "decode_steps": sum(s.phase == "decode" for s in steps),
            "peak_blocks_used": max((s.blocks_used for s in steps), default=0),
            "peak_paged_kv_utilization_pct": max((s.paged_kv_utilization_pct for s in steps), default=0.0),
            "mean_paged_kv_utilization_pct": sum(s.paged_kv_utilization_pct for s in steps) / n,
            "mean_internal_waste_pct": sum(s.internal_waste_pct for s in steps) / n,
            "max_running_seqs": max((s.running_seqs for s in steps), default=0),
            "mean_running_seqs": sum(s.running_seqs for s in steps) / n,
            "preemptions": sum(s.preemptions for s in steps),
            "peak_block_table_bytes": max((s.block_table_bytes for s in steps), default=0),
            "mean_contiguous_kv_utilization_pct": sum(s.contiguous_kv_utilization_pct for s in steps) / n,
            "contiguous_max_concurrent_seqs": num_blocks * block_size // max_model_len,
        }

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
    cascade_rows                  = decode rows that read a prefix shared with other rows once for the group
                                    (cascade attention: engine/prefix_groups.py); set after the step's launch
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


@dataclass(slots=True)  # one per step of a run: slots keep a long run's list small
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
    cascade_rows: int = 0
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
        """steps.parquet: one row per step, with its schema even when there is no step (built a column at a
        time: a long run's steps as dicts would be the largest thing the job ever holds)."""
        return pa.table({f.name: [getattr(s, f.name) for s in self.steps] for f in STEPS_SCHEMA}, schema=STEPS_SCHEMA)

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


# -- The workload's floor (job=bench) ----------------------------------------------------------------------


@dataclass(frozen=True)
class FloorModel:
    """The model's numbers that the floor needs (jobs/bench.py counts them on the built model)."""

    nonembed_params: int  # N: every parameter but the token embedding and the lm_head (norms included)
    lm_head_params: int  # vocab * hidden, also when tied to the embedding: the logits' matmul happens anyway
    weight_bytes_per_step: int  # (N + lm_head) * element size: what one decode step reads at least
    kv_bytes_per_token: int  # K and V of every layer for one token
    num_layers: int
    num_q_heads: int
    head_dim: int


def spread_prefix_hits(prompt_lens: list[int], hit_tokens: int) -> list[int]:
    """Cached prompt tokens per request when only the run's total is known: an equal share each, at most
    prompt_len - 1 (the last prompt token is always computed), shares a short prompt cannot take going to
    the longer ones; the shares add up to hit_tokens unless that exceeds the sum of the caps."""
    cached, left = [0] * len(prompt_lens), hit_tokens
    order = sorted(range(len(prompt_lens)), key=prompt_lens.__getitem__)
    for k, i in enumerate(order):
        cached[i] = min(prompt_lens[i] - 1, left // (len(order) - k))
        left -= cached[i]
    return cached


def _triangle(n: int) -> int:
    """1 + 2 + ... + n."""
    return n * (n + 1) // 2


def workload_floor_s(requests, model: FloorModel, copy_bytes_per_s: float, matmul_flop_per_s: float) -> dict:
    """The least time a device with these rates needs for a workload, whatever the schedule.

    requests: (P, C, O) per request: P prompt tokens, of which the first C < P came from the prefix cache,
    and O >= 1 output tokens. With N = nonembed_params, H = lm_head_params and A = 4 * num_layers *
    num_q_heads * head_dim (the FLOPs of QK^T and PV for one query and one key; 2 FLOPs a multiply-add):

    prefill FLOPs = sum over requests of [sum over computed positions p = C .. P-1 of (2N + A (p + 1))] + 2H
                    (causal attention: position p attends to p + 1 keys; logits, 2H, only for the last
                    prompt token, which gives the first output token)
    decode tokens = output tokens 2 .. O of each request; the one at position p (P <= p <= P + O - 2)
                    reads p + 1 stored K/V entries
    decode steps  = max O - 1 (every sequence in one batch: the longest output sets the number of steps)
    decode bytes  = steps * weight_bytes_per_step + sum over decode tokens of (p + 1) * kv_bytes_per_token
    decode FLOPs  = sum over decode tokens of (2 (N + H) + A (p + 1))
    floor_s       = prefill FLOPs / matmul rate + max(decode bytes / copy rate, decode FLOPs / matmul rate)

    Returns floor_s and its parts floor_prefill_s, floor_decode_bytes_s, floor_decode_flops_s."""
    attention = 4 * model.num_layers * model.num_q_heads * model.head_dim
    prefill_flops = decode_flops = kv_reads = steps = 0
    for prompt_len, cached, output_len in requests:
        prefill_flops += (2 * model.nonembed_params * (prompt_len - cached) + 2 * model.lm_head_params
                          + attention * (_triangle(prompt_len) - _triangle(cached)))
        contexts = _triangle(prompt_len + output_len - 1) - _triangle(prompt_len)  # sum of p + 1 over decode tokens
        decode_flops += 2 * (model.nonembed_params + model.lm_head_params) * (output_len - 1) + attention * contexts
        kv_reads += contexts
        steps = max(steps, output_len - 1)
    parts = {
        "floor_prefill_s": prefill_flops / matmul_flop_per_s,
        "floor_decode_bytes_s": (steps * model.weight_bytes_per_step + kv_reads * model.kv_bytes_per_token) / copy_bytes_per_s,
        "floor_decode_flops_s": decode_flops / matmul_flop_per_s,
    }
    return {"floor_s": parts["floor_prefill_s"] + max(parts["floor_decode_bytes_s"], parts["floor_decode_flops_s"]), **parts}

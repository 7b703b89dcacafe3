"""Per-step and per-run statistics: the rows of steps.parquet and summary.parquet.

Per step (measured after scheduling, when the step's slots are allocated and its new tokens counted; a decode
run of several device steps (scheduler.num_scheduler_steps) gives a row to each: run_stats):
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
    max_/mean_running_seqs, preemptions, wall_time_s, first_token_s (from the start until the first drawn token
    reached the host: a constraint's grammar compiled by then; NaN for figures rebuilt from steps alone, as
    executor=ray's), prefill_/decode_/mixed_steps, and the counterfactual's
    capacity: contiguous_max_concurrent_seqs = (num_blocks * block_size) // max_model_len, the sequences a
    contiguous cache of the same KV memory could hold at once (compare with max_running_seqs);
    prefix_cache_hit_tokens (summed) and prefix_cache_hit_rate = prefix_cache_hit_tokens / admitted_tokens:
    the share of the prompt tokens (with the outputs a preempted sequence recomputes) served from the cache.
"""
import bisect
import math
import time
from dataclasses import dataclass, fields, replace

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


def run_stats(stats: StepStats, counts: list[int]) -> list[StepStats]:
    """A decode run's snapshot (taken once its slots were allocated) as one row per device step, numbered from
    stats.step: step j's rows are those still drawing (counts: the tokens each row draws, one a step), its
    time an even share of the run's; the run's preemptions (made by its scheduling) count in its first step,
    its finished sequences in its last."""
    num_steps = max(counts)
    drawing = np.bincount(np.asarray(counts) - 1, minlength=num_steps)[::-1].cumsum()[::-1].tolist()
    share, last = stats.step_time_s / num_steps, num_steps - 1
    return [replace(stats, step=stats.step + j, seqs=rows, tokens=rows, num_decode_seqs=rows, step_time_s=share,
                    preemptions=stats.preemptions if j == 0 else 0, finished=stats.finished if j == last else 0)
            for j, rows in enumerate(drawing)]


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def _peak(values) -> float:
    return float(max(values, default=0.0))


def steps_table(steps: list[StepStats]) -> pa.Table:
    """steps.parquet: one row per step, with its schema even when there is no step (built a column at a
    time: a long run's steps as dicts would be the largest thing the job ever holds)."""
    return pa.table({f.name: [getattr(s, f.name) for s in steps] for f in STEPS_SCHEMA}, schema=STEPS_SCHEMA)


class StatsRecorder:
    def __init__(self):
        self.steps: list[StepStats] = []
        self.start = self._last = time.perf_counter()
        self.first_token_s: float | None = None  # seconds from the start until the host held a drawn token

    def restart_clock(self) -> None:
        """Start timing now (the generate loop begins): wall time, the first step's time and the time to the
        first token count from here."""
        self.start = self._last = time.perf_counter()
        self.first_token_s = None

    def token_resolved(self) -> None:
        """A step's drawn tokens reached the host: the first time since the start, that is first_token_s."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.start

    def lap(self) -> float:
        """Seconds since the previous lap (or the start)."""
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed

    def add(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def summary(self, num_blocks: int, block_size: int, max_model_len: int) -> dict:
        """Run-level figures from the steps (the config part of summary.parquet is added by the job)."""
        steps = self.steps
        live = [s for s in steps if s.allocated_slots > 0]  # steps with a defined utilization
        end = self._last if steps else time.perf_counter()
        hits, admitted = sum(s.prefix_cache_hit_tokens for s in steps), sum(s.admitted_tokens for s in steps)
        return {
            "wall_time_s": end - self.start,
            "first_token_s": math.nan if self.first_token_s is None else self.first_token_s,
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
    """The model's numbers that the floor needs (floor_model counts them on the built model)."""

    nonembed_params: int  # N: every parameter but the token embedding and the lm_head (norms included)
    lm_head_params: int  # vocab * hidden, also when tied to the embedding: the logits' matmul happens anyway
    weight_bytes_per_step: int  # the bytes of those N + lm_head parameters, each by its dtype: one forward pass reads them
    kv_bytes_per_token: int  # K and V of every layer for one token, in the cache's dtype
    num_layers: int
    num_q_heads: int
    head_dim: int
    expert_bytes: int = 0  # one expert of every sparse layer (a mixture of experts; 0: dense)
    num_experts: int = 0  # E of each sparse layer
    experts_per_token: int = 0  # k: weight_bytes_per_step holds k experts of each sparse layer
    fp8_params: int = 0  # of N, those stored in FP8: they multiply at the device's FP8 rate


def floor_model(model, kv_bytes_per_token: int) -> FloorModel:
    """The FloorModel of a built DecoderForCausalLM: its weights as the model counts them
    (weight_footprint), its shape, and the KV cache's bytes per token."""
    weights, arch = model.weight_footprint(), model.arch
    return FloorModel(nonembed_params=weights.nonembed_params, lm_head_params=weights.lm_head_params,
                      weight_bytes_per_step=weights.bytes_per_step, kv_bytes_per_token=kv_bytes_per_token,
                      num_layers=arch.num_hidden_layers, num_q_heads=arch.num_attention_heads, head_dim=arch.head_dim,
                      expert_bytes=weights.expert_bytes, num_experts=weights.num_experts,
                      experts_per_token=weights.experts_per_token, fp8_params=weights.fp8_params)


def expected_experts(tokens, num_experts: int, experts_per_token: int):
    """The expected number of distinct experts `tokens` tokens route to when each picks experts_per_token of
    num_experts uniformly at random: E (1 - (1 - k / E)^B), an expert being missed by a token with
    probability 1 - k / E. k for one token, E in the limit; concave in B. tokens: an int or an array."""
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** np.asarray(tokens, dtype=np.float64))


def weight_reads_bytes(outputs: list[int], model: FloorModel) -> float:
    """The weight bytes of the floor's forward passes: max O passes, pass j (1-based) carrying the B_j rows
    whose O >= j, each reading every dense weight and, of each sparse layer, the experts its rows route to
    (expected_experts(B_j) under uniform routing; a dense model: max O x weight_bytes_per_step).
    Any schedule's passes carry token counts b_1, b_2, ... that B majorizes (any m of its passes hold at most
    sum over rows of min(O, m) tokens, which B's first m hold), so by Karamata's inequality for the concave
    expected_experts the sum over B is the least expected count of any schedule. Prompt tokens, which a
    prefill pass adds, can only touch more experts: not counted."""
    if not outputs:
        return 0.0
    passes = max(outputs)
    if not model.num_experts:
        return float(passes * model.weight_bytes_per_step)
    rows_at = np.cumsum(np.bincount(outputs, minlength=passes + 1)[::-1])[::-1][1:]  # B_j for j = 1..max O
    extra = expected_experts(rows_at, model.num_experts, model.experts_per_token) - model.experts_per_token
    return float(passes * model.weight_bytes_per_step + model.expert_bytes * extra.sum())


def _triangle(n):
    """1 + 2 + ... + n."""
    return n * (n + 1) // 2


def prompt_sharing(prompts: list, decode_tokens: list[int]) -> tuple[int, int, int, int]:
    """How much of the prompts' work rows that share a prefix can share: (T, S, R, U) over the trie of the
    prompts (a node per distinct prefix: identical tokens at the same positions after identical tokens),
    with T the nodes (prompt positions that must be computed once), S the sum over the nodes of their
    positions + 1 (the keys each attends to), R the sum over the nodes of the most decode tokens among the
    rows holding that prefix (a decode step of any of them reads the node's K/V; steps of the rows together
    read it once), U the distinct prompts. prompts: token ids per row; decode_tokens: per row.

    In lexicographic order a row's longest prefix shared with any row before it is the one shared with the
    row just before it; so T and S come from those neighbour LCPs. For R, rows are taken by decreasing decode
    tokens: the nodes a row adds to the trie of the rows taken before are owned by it, the most among their
    holders. Its longest prefix shared with those rows is with their nearest ones in lexicographic order,
    and an LCP of two rows is the least of the neighbour LCPs between them (a range minimum)."""
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    lengths = np.array([len(arrays[i]) for i in order], dtype=np.int64)
    lcp = np.zeros(len(order), dtype=np.int64)  # lcp[k]: the longest prefix shared with the row before in order
    for k in range(1, len(order)):
        a, b = arrays[order[k - 1]], arrays[order[k]]
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        lcp[k] = differ[0] if len(differ) else n
    repeated = (lcp == lengths) & (lengths == np.roll(lengths, 1))
    repeated[:1] = False
    table = _range_min_table(lcp)
    rank = dict(zip(order, range(len(order))))
    taken: list[int] = []  # the ranks of the rows taken so far, in order
    reads = 0
    for row in sorted(range(len(prompts)), key=lambda i: -decode_tokens[i]):
        k = rank[row]
        at = bisect.bisect(taken, k)
        shared = _range_min(table, taken[at - 1] + 1, k) if at else 0
        if at < len(taken):
            shared = max(shared, _range_min(table, k + 1, taken[at]))
        reads += decode_tokens[row] * (int(lengths[k]) - shared)
        taken.insert(at, k)
    return (int((lengths - lcp).sum()), int((_triangle(lengths) - _triangle(lcp)).sum()), reads,
            int((~repeated).sum()))


def _range_min_table(values: np.ndarray) -> list[np.ndarray]:
    """A sparse table of values: table[j][i] = min(values[i : i + 2^j])."""
    table = [values]
    while 2 ** len(table) <= len(values):
        half = 2 ** (len(table) - 1)
        table.append(np.minimum(table[-1][:-half], table[-1][half:]))
    return table


def _range_min(table: list[np.ndarray], lo: int, hi: int) -> int:
    """min(values[lo : hi + 1]) for lo <= hi, from _range_min_table(values)."""
    level = (hi - lo + 1).bit_length() - 1
    return int(min(table[level][lo], table[level][hi - 2 ** level + 1]))


def workload_floor_s(rows, model: FloorModel, copy_bytes_per_s: float, matmul_flop_per_s: float,
                     fp8_flop_per_s: float | None = None) -> dict:
    """The least time a device with these rates needs for a workload, whatever the schedule.

    rows: (prompt token ids, O) per sequence that ran: every sample of every request is a row (the n samples
    of a prompt are n rows with that prompt), O >= 1 its output tokens, D = O - 1 of them computed by decode
    steps. Rows that share a prefix of tokens (a prefix-cache hit, the samples of a prompt) share its work
    (prompt_sharing: T positions, S keys, R prompt K/V reads, U distinct prompts). With N = nonembed_params,
    H = lm_head_params and A = 4 * num_layers * num_q_heads * head_dim (QK^T and PV for one query and one key,
    2 FLOPs a multiply-add):

    FLOPs  = 2N T + A S + 2H U                                   (prefill: each distinct prompt position once,
             + sum over rows of [2 (N + H) D + A ((P + D)(P + D + 1) - P (P + 1)) / 2]     causal attention;
                                                                  logits for each distinct prompt's last token;
                                                                  decode: the position p token attends p + 1 keys)
    bytes  = max O * weight_bytes_per_step                       (a row's O tokens need O forward passes in turn,
                                                                  each reading the weights at least once;
             + expert_bytes * sum over passes j of                 a mixture of experts: pass j's B_j rows
               (expected_experts(B_j) - k)                          route to more than one token's k experts,
                                                                  weight_reads_bytes)
             + (R + sum over rows of D (D + 1) / 2) * kv_bytes_per_token      (K/V read: a prompt's by the steps
                                                                  of the rows sharing it, once a step; a row's own
                                                                  outputs by its own later steps)
             + (T + sum over rows of D) * kv_bytes_per_token     (K/V written once per position)
    floor_s = max(FLOPs / matmul rate, bytes / copy rate)
    Of the FLOPs, 2 F per position that a pass computes (T + sum of D) are the FP8 weights' (F = fp8_params):
    with fp8_flop_per_s they take FLOPs_fp8 / FP8 rate, the rest / matmul rate (attention stays in the model's
    dtype).

    A device can overlap its arithmetic with its memory traffic, so the floor is the larger of the two, not
    their sum; no schedule can do with less of either, so pct_of_floor = 100 x floor_s / wall time <= 100.
    Returns floor_s, floor_flops_s, floor_bytes_s, and floor_prompt_tokens (T), floor_kv_read_tokens."""
    prompts, outputs = [p for p, _ in rows], [o for _, o in rows]
    decode = [o - 1 for o in outputs]
    nodes, keys, prompt_reads, distinct = prompt_sharing(prompts, decode)
    attention = 4 * model.num_layers * model.num_q_heads * model.head_dim
    flops = 2 * model.nonembed_params * nodes + attention * keys + 2 * model.lm_head_params * distinct
    for prompt, d in zip(prompts, decode):
        flops += 2 * (model.nonembed_params + model.lm_head_params) * d + attention * (
            _triangle(len(prompt) + d) - _triangle(len(prompt)))
    kv_reads = prompt_reads + sum(_triangle(d) for d in decode)
    kv_bytes = (kv_reads + nodes + sum(decode)) * model.kv_bytes_per_token
    weight_bytes = weight_reads_bytes(outputs, model)
    fp8_flops = 2 * model.fp8_params * (nodes + sum(decode))
    flops_s = (flops - fp8_flops) / matmul_flop_per_s + fp8_flops / (fp8_flop_per_s or matmul_flop_per_s)
    parts = {"floor_flops_s": flops_s, "floor_bytes_s": (weight_bytes + kv_bytes) / copy_bytes_per_s}
    return {"floor_s": max(parts.values()), **parts, "floor_prompt_tokens": nodes, "floor_kv_read_tokens": kv_reads}

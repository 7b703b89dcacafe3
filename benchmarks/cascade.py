"""GPU benchmark of cascade (shared-prefix) decode attention: python3 benchmarks/cascade.py

Qwen3-0.6B heads (16 q, 8 kv, head_dim 128), bf16, block_size 16. Every row has a 2048-token prefix
shared with the other rows of its group (1 or 8 groups) and its own suffix (16, 128 or 512 tokens, or
uniform in 16-512). For batch 64 and 256 it times, as CUDA-graph replays (do_bench medians), plain
paged_attention_decode and ops.cascade_attention_decode, and prints for each the K/V bytes it must
read (plain: every row's whole context; cascade: each group's prefix once plus the suffixes), the
float32 partials the cascade writes and reads back, the time, and that K/V read's share of the
4.26 TB/s device copy; the two outputs must agree (relative error < 1e-2, else exit 1).
A last line times the cascade op on a batch without groups (what a step without sharing would pay
if it did not take the plain path). --sweep also times, at batch 512 (shared_prefix's full steps), prefix
tile configs x forced prefix chunk counts, then decode kernel configs for the suffix pass.

--parts times the op's three kernels alone at 256 and 512 rows sharing one prefix: the prefix pass, the
merge, and the suffix pass (the decode kernel from each row's context start) at several decode tiles, with
the suffix K/V's share of the copy speed; then the prefix pass at several tiles x forced chunk counts.

--break-even (python3 benchmarks/cascade.py --break-even) times, instead, what the engine's decode graphs
run: plain decode against the cascade op with its groups padded to the engine's static size (empty
groups, engine/cuda_graphs.copy_groups), on batches of 256 rows: one group of r rows sharing a prefix of
p tokens (r in 2..256, p in 16..2048) and 256 - r rows with contexts of their own of the same length,
every row with its own suffix of 64-192 tokens. It prints the speed-up table and the smallest
(rows, prefix) thresholds for engine/prefix_groups.py (CASCADE_MIN_ROWS, CASCADE_MIN_PREFIX_TOKENS)
above which cascade wins everywhere in the grid.
Without CUDA it prints a message and exits 0.
"""
import argparse
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402
from benchmarks.ops import bench  # noqa: E402
from benchmarks.profile_decode import COPY_BYTES_PER_S  # noqa: E402
from engine.attention import CascadeMetadata  # noqa: E402
from engine.cuda_graphs import copy_groups  # noqa: E402
from engine.prefix_groups import CascadePolicy  # noqa: E402
from ops import cascade, paged_attention  # noqa: E402

HQ, HKV, D, BS, PREFIX = 16, 8, 128, 16, 2048
SWEEP_SUFFIX = [(64, 4, 3), (32, 4, 3), (32, 4, 4), (32, 2, 3), (64, 4, 2), (16, 2, 4), (128, 4, 2)]
PARTS_SUFFIX = [(64, 4, 3), (64, 4, 1), (64, 2, 2), (32, 4, 1), (32, 2, 1), (32, 4, 2), (32, 1, 2), (16, 1, 1),
                (16, 2, 2), (16, 4, 3)]
PARTS_PREFIX = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 8, 4), (128, 32, 4, 4), (64, 64, 4, 3),
                (64, 32, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3), (256, 64, 16, 3), (256, 128, 16, 2), (256, 64, 8, 3),
                (256, 32, 8, 3)]
PARTS_CHUNKS = (1, 2, 3, 5, 8)
SWEEP_TILES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)]
DT = torch.bfloat16
ESZ = 2
MAX_MODEL_LEN = 4096  # conf/model/qwen3-0.6b.yaml: the engine's graphs see block tables this wide
BREAK_EVEN_BATCH = 256
BREAK_EVEN_ROWS = (2, 4, 8, 16, 32, 64, 128, 256)
BREAK_EVEN_PREFIXES = (16, 64, 128, 256, 512, 1024, 2048)
WIN = 0.97  # cascade wins where it takes at most this share of plain decode's time


def make_batch(group_sizes, prefix, suffixes, generator, dev="cuda"):
    """Paged K/V and metadata: contiguous runs of group_sizes rows, the rows of a run sharing their first
    prefix tokens (prefix // BS blocks; a run of one row shares with nobody), each row followed by its own
    suffix. cu_group_rows / group_prefix_lens describe the runs of >= 2 rows, which come first. Physical
    blocks are shuffled."""
    batch, shared_blocks = sum(group_sizes), prefix // BS
    own_blocks = [-(-int(s) // BS) for s in suffixes]
    num_blocks = len(group_sizes) * shared_blocks + sum(own_blocks)
    perm = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(batch, shared_blocks + max(own_blocks), dtype=torch.int32)
    next_block = len(group_sizes) * shared_blocks
    for b, g in enumerate(np.repeat(np.arange(len(group_sizes)), group_sizes).tolist()):
        tables[b, :shared_blocks] = perm[g * shared_blocks:(g + 1) * shared_blocks]
        tables[b, shared_blocks:shared_blocks + own_blocks[b]] = perm[next_block:next_block + own_blocks[b]]
        next_block += own_blocks[b]
    cache_shape = (num_blocks, HKV, BS, D)
    shared = [n for n in group_sizes if n >= 2]
    return dict(
        q=torch.randn(batch, HQ, D, dtype=DT, device=dev),
        key_cache=torch.randn(cache_shape, dtype=DT, device=dev),
        value_cache=torch.randn(cache_shape, dtype=DT, device=dev),
        block_tables=tables.to(dev),
        seq_lens=(prefix + torch.as_tensor(suffixes)).to(torch.int32).to(dev),
        cu_group_rows=torch.tensor(np.cumsum([0] + shared), dtype=torch.int32, device=dev),
        group_prefix_lens=torch.full((len(shared),), prefix, dtype=torch.int32, device=dev),
    )


def time_pair(x, num_chunks=None):
    """(plain us, cascade us, relative error of cascade against plain), as CUDA-graph replays."""
    plain_args = (x["q"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"], 1 / math.sqrt(D))
    groups = (x["cu_group_rows"], x["group_prefix_lens"])

    def plain():
        return ops.paged_attention_decode(*plain_args)

    def cascaded():
        return cascade.cascade_attention_decode(*plain_args, *groups, num_chunks=num_chunks)

    err = ((cascaded().float() - plain().float()).norm() / plain().float().norm()).item()
    return bench(plain, graph=True) * 1e3, bench(cascaded, graph=True) * 1e3, err


def op_partitions(x) -> tuple[int, int]:
    """(prefix chunks, suffix splits) that ops.cascade_attention_decode picks for the batch x."""
    q = x["q"]
    block_q = paged_attention.query_tile(paged_attention.prefill_cfg(q, x["key_cache"]), HQ // HKV, None, True)[1]
    max_ctx = x["block_tables"].shape[1] * BS
    return (cascade.prefix_num_chunks(q.shape[0], HKV, block_q, max_ctx, q.device),
            paged_attention.decode_num_splits(q.shape[0], HKV, max_ctx, q.device, balance=False))


def run_case(batch, num_groups, suffix_label, suffixes, generator, num_chunks=None):
    x = make_batch([batch // num_groups] * num_groups, PREFIX, suffixes, generator)
    t_plain, t_cascade, err = time_pair(x, num_chunks)
    per_token = 2 * HKV * D * ESZ  # K and V of one token
    total_tokens = int(x["seq_lens"].sum())
    suffix_tokens = total_tokens - batch * PREFIX
    plain_bytes = total_tokens * per_token + 2 * batch * HQ * D * ESZ
    cascade_bytes = (num_groups * PREFIX + suffix_tokens) * per_token + 2 * batch * HQ * D * ESZ
    chunks, splits = op_partitions(x)
    chunks = num_chunks or chunks
    partial_bytes = 2 * batch * HQ * (chunks + splits) * D * 4  # written, then read by the merge
    pct = lambda nbytes, us: 100 * nbytes / (us * 1e-6) / COPY_BYTES_PER_S  # noqa: E731
    print(f"| {batch} | {num_groups} | {suffix_label} | {plain_bytes / 1e6:.0f} | {t_plain:.1f} | "
          f"{pct(plain_bytes, t_plain):.0f}% | {cascade_bytes / 1e6:.1f} | {partial_bytes / 1e6:.1f} | "
          f"{chunks}/{splits} | {t_cascade:.1f} | {pct(cascade_bytes, t_cascade):.0f}% | "
          f"{t_plain / t_cascade:.1f}x | {err:.1e} |", flush=True)
    del x
    torch.cuda.empty_cache()
    return err


@contextmanager
def gpu_config(table: dict, key: str = "gpu", **cfg):
    """table[key] (a kernel's tunables in ops/paged_attention.py) is cfg inside the block."""
    default, table[key] = table[key], cfg
    try:
        yield
    finally:
        table[key] = default


def engine_layout(x):
    """x as the engine's cascade graphs see it: block tables MAX_MODEL_LEN wide (the split and chunk
    counts come from that width), the groups padded with empty ones to the static size."""
    dev = x["q"].device
    entries = CascadePolicy.for_mode("on", dev).max_entries
    static = CascadeMetadata(torch.empty(entries + 1, dtype=torch.int32, device=dev),
                             torch.empty(entries, dtype=torch.int32, device=dev))
    copy_groups(static, CascadeMetadata(x["cu_group_rows"], x["group_prefix_lens"]))
    tables = x["block_tables"]
    wide = torch.nn.functional.pad(tables, (0, MAX_MODEL_LEN // BS - tables.shape[1]), value=-1)
    return {**x, "block_tables": wide, "cu_group_rows": static.cu_group_rows,
            "group_prefix_lens": static.group_prefix_lens}


def time_parts(batch, suffixes, generator):
    """The cascade op's three kernels timed alone (CUDA-graph replays) on one group of batch rows: the
    prefix pass, the merge, the suffix pass (the decode kernel from each row's ctx_start) at each PARTS_SUFFIX
    tile with its K/V bytes against the copy speed, then the prefix pass at each PARTS_PREFIX tile x
    PARTS_CHUNKS chunk count."""
    x = make_batch([batch], PREFIX, suffixes, generator)
    q, kc, vc, bt, seq_lens = x["q"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"]
    cfg = paged_attention.prefill_cfg(q, kc)
    chunks, splits = op_partitions(x)
    partials = paged_attention.decode_partials(q, chunks + splits)
    ctx_start, out, scale = torch.zeros(batch, dtype=torch.int32, device=q.device), torch.empty_like(q), D ** -0.5

    def prefix(tile, num_chunks, tile_partials):
        tile_m, tile_q = paged_attention.query_tile(tile, HQ // HKV, None, True)
        cascade._launch_prefix(q, kc, vc, bt, scale, x["cu_group_rows"], x["group_prefix_lens"], ctx_start,
                               tile_partials, num_chunks, tile_m, tile_q, tile)

    def suffix(row_order=None):
        paged_attention.launch_decode(q, kc, vc, bt, seq_lens, scale, splits, partials=partials,
                                      ctx_start=ctx_start, first_slot=chunks, row_order=row_order)

    prefix(cfg, chunks, partials)  # sets ctx_start
    suffix_bytes = int((seq_lens - ctx_start).sum()) * 2 * HKV * D * ESZ
    prefix_us = bench(lambda: prefix(cfg, chunks, partials), graph=True) * 1e3
    merge_us = bench(lambda: paged_attention.launch_reduce(partials, out, chunks + splits, ctx_start, chunks),
                     graph=True) * 1e3
    print(f"batch {batch}, suffixes {int(suffixes.min())}-{int(suffixes.max())}: {chunks} prefix chunks, "
          f"{splits} suffix splits; prefix pass {prefix_us:.1f} us; merge {merge_us:.1f} us")
    order = torch.argsort(seq_lens - ctx_start, descending=True, stable=True).to(torch.int32)
    us = bench(lambda: suffix(order), graph=True) * 1e3
    print(f"  suffix pass, default tile, longest first: {us:.1f} us, "
          f"{100 * suffix_bytes / (us * 1e-6) / COPY_BYTES_PER_S:.0f}% of copy speed", flush=True)
    for block_n, warps, stages in PARTS_SUFFIX:
        with gpu_config(paged_attention.DECODE_CFG, "gpu_short", BLOCK_N=block_n, num_warps=warps,
                        num_stages=stages):
            us = bench(suffix, graph=True) * 1e3
        print(f"  suffix pass, decode tile {block_n}, {warps} warps, {stages} stages: {us:.1f} us, "
              f"{100 * suffix_bytes / (us * 1e-6) / COPY_BYTES_PER_S:.0f}% of copy speed", flush=True)
    flops = 4 * batch * HQ * PREFIX * D
    for block_m, block_n, warps, stages in PARTS_PREFIX:
        tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        times = []
        for n in PARTS_CHUNKS:
            tile_partials = paged_attention.decode_partials(q, n + splits)
            times.append(bench(lambda: prefix(tile, n, tile_partials), graph=True) * 1e3)  # noqa: B023 (timed here)
        print(f"  prefix pass, tile {block_m} x {block_n}, {warps} warps, {stages} stages, {PARTS_CHUNKS} chunks: "
              + " / ".join(f"{t:.1f}" for t in times) + f" us (best {flops / min(times) / 1e6:.0f} TFLOP/s)",
              flush=True)


def break_even(generator) -> float:
    """Times plain and cascade decode for one group of r rows sharing p tokens in a batch of
    BREAK_EVEN_BATCH rows, prints the speed-ups and the thresholds; returns the worst relative error."""
    speedup, worst = {}, 0.0
    for p in BREAK_EVEN_PREFIXES:
        for r in BREAK_EVEN_ROWS:
            suffixes = torch.randint(64, 193, (BREAK_EVEN_BATCH,), generator=generator)
            x = engine_layout(make_batch([r] + [1] * (BREAK_EVEN_BATCH - r), p, suffixes, generator))
            t_plain, t_cascade, err = time_pair(x)
            speedup[r, p], worst = t_plain / t_cascade, max(worst, err)
            del x
            torch.cuda.empty_cache()
    print(f"plain / cascade decode time (CUDA-graph replays), batch {BREAK_EVEN_BATCH}: one group of r rows sharing "
          f"p tokens, the other rows as long but unshared, suffixes 64-192; * = cascade wins (<= {WIN:.0%} of plain)")
    print("| rows \\ prefix | " + " | ".join(map(str, BREAK_EVEN_PREFIXES)) + " |")
    print("|---" * (len(BREAK_EVEN_PREFIXES) + 1) + "|")
    for r in BREAK_EVEN_ROWS:
        cells = [f"{speedup[r, p]:.2f}{'*' if speedup[r, p] >= 1 / WIN else ''}" for p in BREAK_EVEN_PREFIXES]
        print(f"| {r} | " + " | ".join(cells) + " |")
    corners = win_corners(speedup)
    print("cascade wins at every grid point with rows >= R and prefix >= P for (R, P) = "
          + (", ".join(map(str, corners)) or "none"))
    if corners:
        r, p = max(corners, key=lambda c: sum(r2 >= c[0] and p2 >= c[1] for r2, p2 in speedup))
        print(f"widest such region: CASCADE_MIN_ROWS = {r}, CASCADE_MIN_PREFIX_TOKENS = {p} (engine/prefix_groups.py)")
    return worst


def win_corners(speedup) -> list[tuple[int, int]]:
    """For each row count R, the smallest prefix P such that cascade wins at every grid point with
    rows >= R and prefix >= P (none where no such P exists)."""
    corners = []
    for r in BREAK_EVEN_ROWS:
        winning = [p for p in BREAK_EVEN_PREFIXES
                   if all(s >= 1 / WIN for (r2, p2), s in speedup.items() if r2 >= r and p2 >= p)]
        if winning and (not corners or winning[0] < corners[-1][1]):  # a larger R with the same P adds nothing
            corners.append((r, winning[0]))
    return corners


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time forced prefix chunk counts")
    ap.add_argument("--parts", action="store_true",
                    help="only the op's three kernels alone, with suffix-pass tiles, at 256 and 512 rows")
    ap.add_argument("--break-even", action="store_true",
                    help="only the engine's break-even grid of group rows x prefix length (CASCADE_MIN_*)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cascade.py needs a CUDA GPU; nothing to time here.")
        return 0
    t0 = time.time()
    generator = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; bf16, Hq {HQ}, Hkv {HKV}, D {D}, block {BS}")
    if args.parts:
        for batch, lo, hi in ((512, 16, 256), (512, 16, 512), (256, 64, 512)):
            time_parts(batch, torch.randint(lo, hi + 1, (batch,), generator=generator), generator)
        return 0
    if args.break_even:
        worst = break_even(generator)
        print(f"worst rel err cascade vs plain: {worst:.1e}; total {time.time() - t0:.0f} s")
        return 0 if worst < 1e-2 else 1
    print(f"shared prefix {PREFIX}; CUDA-graph replays; % = K/V bytes read / time / {COPY_BYTES_PER_S / 1e12:.2f} TB/s")
    hdr = ("| batch | groups | suffix | plain MB | plain us | plain % | cascade K/V MB | partials MB | "
           "chunks/splits | cascade us | cascade % | speed-up | rel err |")
    print(hdr + "\n" + "|---" * (hdr.count("|") - 1) + "|")
    worst = 0.0
    for batch in (64, 256):
        for num_groups in (1, 8):
            for label in ("16", "128", "512", "16-512"):
                lo, _, hi = label.partition("-")
                suffixes = torch.randint(int(lo), int(hi or lo) + 1, (batch,), generator=generator)
                worst = max(worst, run_case(batch, num_groups, label, suffixes, generator))
    if args.sweep:
        print("\nbatch 512, 1 group, suffix 16-512: prefix tile (BLOCK_M, BLOCK_N, warps, stages) x chunks:")
        suffixes = torch.randint(16, 513, (512,), generator=generator)
        for block_m, block_n, warps, stages in SWEEP_TILES:
            print(f"tile {block_m} x {block_n}, {warps} warps, {stages} stages")
            with gpu_config(paged_attention.PREFILL_CFG, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                            num_stages=stages):
                for chunks in (1, 2, 3, 5, 8):
                    run_case(512, 1, "16-512", suffixes, generator, num_chunks=chunks)
        print("\nthe same batch, default prefix tile: suffix pass (decode kernel) BLOCK_N x warps x stages:")
        for block_n, warps, stages in SWEEP_SUFFIX:
            print(f"decode tile {block_n}, {warps} warps, {stages} stages")
            with gpu_config(paged_attention.DECODE_CFG, "gpu_short", BLOCK_N=block_n, num_warps=warps,
                            num_stages=stages):
                run_case(512, 1, "16-512", suffixes, generator)
    # no groups: the cascade op on a batch with nothing shared (the engine should call plain decode)
    x = make_batch([256], PREFIX, torch.full((256,), 16), generator)
    plain_args = (x["q"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"], 1 / math.sqrt(D))
    no_groups = (torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(0, dtype=torch.int32, device="cuda"))
    t_plain = bench(lambda: ops.paged_attention_decode(*plain_args), graph=True)
    t_none = bench(lambda: ops.cascade_attention_decode(*plain_args, *no_groups), graph=True)
    print(f"\nbatch 256, context {PREFIX + 16}, no groups: plain {t_plain * 1e3:.1f} us, "
          f"cascade op {t_none * 1e3:.1f} us")
    print(f"worst rel err cascade vs plain: {worst:.1e}; total {time.time() - t0:.0f} s")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark of cascade (shared-prefix) decode attention: python3 benchmarks/cascade.py

Qwen3-0.6B heads (16 q, 8 kv, head_dim 128), bf16, block_size 16. Every row has a 2048-token prefix
shared with the other rows of its group (1 or 8 groups) and its own suffix (16, 128 or 512 tokens, or
uniform in 16-512). For batch 64 and 256 it times, as CUDA-graph replays (do_bench medians), plain
paged_attention_decode and ops.cascade_attention_decode (with its plan made beforehand, as the engine
does), and prints for each the K/V bytes it must read (plain: every row's whole context; cascade: each
group's prefix once plus the suffixes), the float32 partials the cascade writes and reads back, the time,
and that K/V read's share of the 4.26 TB/s device copy; the two outputs must agree (relative error < 1e-2,
else exit 1). A last line times the cascade op on a batch without groups (what a step without sharing
would pay if it did not take the plain path).

--groups times what the engine's decode graphs run: plain decode (rows longest first) against the cascade
op with its groups padded to the engine's static size (empty groups, engine/cuda_graphs.copy_groups), on
batches of 64-512 rows, all or half of them in groups of 2-16 rows sharing 128-1,536 tokens, each row with
its own 1-64 or 1-512 tokens, and prints one CSV line a point: the data
that engine/prefix_groups.py's cost model is fitted to; --fit CSV (on any machine) fits StepCost to it.
--many times the op's parts (the prefix pass at its tile and at the MANY_PREFIX_TILES, the suffix pass, the
merge) on batches of many small groups, such as the n samples of prompts, and of one large group (with torch's
cuDNN attention over a contiguous prefix beside it).
Without CUDA it prints a message and exits 0.
"""
import argparse
import itertools
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
from engine.prefix_groups import MAX_CASCADE_GROUPS, CascadePolicy, StepCost  # noqa: E402
from ops import cascade, paged_attention  # noqa: E402

HQ, HKV, D, BS, PREFIX = 16, 8, 128, 16, 2048
DT = torch.bfloat16
ESZ = 2
MAX_MODEL_LEN = 4096  # conf/model/qwen3-0.6b.yaml: the engine's graphs see block tables this wide
FIT_FIELDS = ("batch", "rows", "prefix", "own_max", "shared_share", "own_tokens", "group_prefix_tokens",
              "repeated_tokens", "items", "plain_us", "cascade_us")
GROUPS_BATCHES = (64, 128, 256, 512)
GROUPS_ROWS = (2, 4, 8, 16)
GROUPS_PREFIXES = (128, 512, 1024, 1536)
GROUPS_OWN = (64, 512)
GROUPS_SHARES = (1.0, 0.5)


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
    x = dict(
        q=torch.randn(batch, HQ, D, dtype=DT, device=dev),
        key_cache=torch.randn(cache_shape, dtype=DT, device=dev),
        value_cache=torch.randn(cache_shape, dtype=DT, device=dev),
        block_tables=tables.to(dev),
        seq_lens=(prefix + torch.as_tensor(suffixes)).to(torch.int32).to(dev),
        cu_group_rows=torch.tensor(np.cumsum([0] + shared), dtype=torch.int32, device=dev),
        group_prefix_lens=torch.full((len(shared),), prefix, dtype=torch.int32, device=dev),
    )
    return with_plan(x)


def with_plan(x):
    """x with the op's plan of its groups (the prefix pass's work list, as the engine hands it the op)."""
    work = cascade.PrefixPass.of(x["q"], x["key_cache"]).plan(x["cu_group_rows"].cpu().numpy(),
                                                              x["group_prefix_lens"].cpu().numpy())
    return {**x, "plan": torch.from_numpy(work).to(x["q"].device)}


def time_pair(x, longest_first=False):
    """(plain us, cascade us, relative error of cascade against plain), as CUDA-graph replays. longest_first:
    plain decode starts its rows longest first, as the engine runs it."""
    plain_args = (x["q"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"], 1 / math.sqrt(D))
    groups = (x["cu_group_rows"], x["group_prefix_lens"])
    order = torch.argsort(-x["seq_lens"], stable=True).to(torch.int32) if longest_first else None

    def plain():
        return ops.paged_attention_decode(*plain_args, row_order=order)

    def cascaded():
        return cascade.cascade_attention_decode(*plain_args, *groups, plan=x["plan"])

    err = ((cascaded().float() - plain().float()).norm() / plain().float().norm()).item()
    return bench(plain, graph=True) * 1e3, bench(cascaded, graph=True) * 1e3, err


def suffix_splits(x) -> int:
    """The suffix splits that ops.cascade_attention_decode picks for the batch x."""
    return paged_attention.decode_num_splits(x["q"].shape[0], HKV, x["block_tables"].shape[1] * BS, x["q"].device,
                                             balance=False)


def run_case(batch, num_groups, suffix_label, suffixes, generator):
    x = make_batch([batch // num_groups] * num_groups, PREFIX, suffixes, generator)
    t_plain, t_cascade, err = time_pair(x)
    per_token = 2 * HKV * D * ESZ  # K and V of one token
    total_tokens = int(x["seq_lens"].sum())
    suffix_tokens = total_tokens - batch * PREFIX
    plain_bytes = total_tokens * per_token + 2 * batch * HQ * D * ESZ
    cascade_bytes = (num_groups * PREFIX + suffix_tokens) * per_token + 2 * batch * HQ * D * ESZ
    items, splits = int(x["plan"][0, 0]), suffix_splits(x)
    slots = int(x["plan"][1:, 5].max())  # a row's prefix slots
    partial_bytes = 2 * batch * HQ * (slots + splits) * D * 4  # written, then read by the merge
    pct = lambda nbytes, us: 100 * nbytes / (us * 1e-6) / COPY_BYTES_PER_S  # noqa: E731
    print(f"| {batch} | {num_groups} | {suffix_label} | {plain_bytes / 1e6:.0f} | {t_plain:.1f} | "
          f"{pct(plain_bytes, t_plain):.0f}% | {cascade_bytes / 1e6:.1f} | {partial_bytes / 1e6:.1f} | "
          f"{items}/{slots}/{splits} | {t_cascade:.1f} | {pct(cascade_bytes, t_cascade):.0f}% | "
          f"{t_plain / t_cascade:.1f}x | {err:.1e} |", flush=True)
    del x
    torch.cuda.empty_cache()
    return err


@contextmanager
def gpu_config(table: dict, key: str = "gpu", **cfg):
    """table[key] (a kernel's tunables, e.g. ops/cascade.py's PREFIX_CFG) is cfg inside the block."""
    default, table[key] = table[key], cfg
    try:
        yield
    finally:
        table[key] = default


def engine_layout(x):
    """x as the engine's cascade graphs see it: block tables MAX_MODEL_LEN wide (the split count comes from
    that width), the groups padded with empty ones to the static size."""
    dev = x["q"].device
    entries = CascadePolicy.for_mode("on", dev).max_entries
    static = CascadeMetadata(torch.empty(entries + 1, dtype=torch.int32, device=dev),
                             torch.empty(entries, dtype=torch.int32, device=dev), torch.empty_like(x["plan"]))
    copy_groups(static, CascadeMetadata(x["cu_group_rows"], x["group_prefix_lens"], x["plan"]))
    tables = x["block_tables"]
    wide = torch.nn.functional.pad(tables, (0, MAX_MODEL_LEN // BS - tables.shape[1]), value=-1)
    return {**x, "block_tables": wide, "cu_group_rows": static.cu_group_rows,
            "group_prefix_lens": static.group_prefix_lens, "plan": static.plan}


MANY_CASES = ((512, 16, 1024, 512), (512, 16, 1024, 64), (256, 8, 512, 256), (64, 16, 128, 64), (64, 4, 1536, 64),
              (1024, 16, 1024, 512), (1024, 1024, 2048, 256), (512, 512, 2048, 256), (256, 256, 2048, 256))
# (BLOCK_M, BLOCK_N, warps, stages, programs per SM)
MANY_PREFIX_TILES = ((64, 64, 4, 2, 2), (64, 64, 4, 3, 2), (64, 128, 4, 2, 2), (64, 64, 4, 2, 3), (64, 64, 4, 2, 4),
                     (32, 64, 4, 2, 3), (32, 128, 4, 2, 2), (128, 64, 4, 2, 2), (128, 128, 8, 3, 1), (128, 64, 8, 2, 2))


def sdpa_reference(q, prefix: int):
    """torch's cuDNN attention of q's rows against `prefix` keys held contiguously (each kv head's for its
    query heads): a call as long as the prefix pass of one group with the fastest kernel at hand."""
    queries = q.unsqueeze(0).transpose(1, 2)  # [1, Hq, rows, D]
    keys = torch.randn(1, HKV, prefix, D, dtype=q.dtype, device=q.device).repeat_interleave(HQ // HKV, 1)
    values = torch.randn_like(keys)

    def attend():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(queries, keys, values)
    return attend


def time_many_parts(generator) -> None:
    """The cascade op's parts on batches of many small groups and of one large one (MANY_CASES: rows, group
    rows, prefix, own tokens up to), in the engine's layout: the prefix pass at its tile and at each of
    MANY_PREFIX_TILES (planned for that tile's programs), the suffix pass, the merge; for one group, torch's
    SDPA (cuDNN) over a contiguous copy of its prefix, as a reference of what the prefix pass's arithmetic
    allows."""
    for batch, r, p, own in MANY_CASES:
        suffixes = torch.randint(1, own + 1, (batch,), generator=generator)
        x = engine_layout(make_batch([r] * (batch // r), p, suffixes, generator))
        q, kc, vc, bt, seq_lens = x["q"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"]
        splits, scale = suffix_splits(x), D ** -0.5
        partials = paged_attention.decode_partials(q, cascade.PREFIX_SLOTS + splits)
        row_prefix, out = torch.zeros(2, batch, dtype=torch.int32, device=q.device), torch.empty_like(q)
        groups = (x["cu_group_rows"].cpu().numpy(), x["group_prefix_lens"].cpu().numpy())

        def prefix():
            """The prefix pass at the current PREFIX_CFG, planned for it."""
            shape, cfg = cascade.PrefixPass.of(q, kc), cascade.prefix_cfg(q, kc)
            plan = torch.from_numpy(shape.plan(*groups)).to(q.device)
            return lambda: cascade._launch_prefix(q, kc, vc, bt, scale, plan, row_prefix, partials, shape.programs,
                                                  cfg)

        t_plain, t_op, _ = time_pair(x, longest_first=True)
        prefix()()  # sets row_prefix
        parts = {f"prefix, {cascade.PREFIX_CFG['gpu']}, {int(x['plan'][0, 0])} items": prefix()}
        for block_m, block_n, warps, stages, per_sm in MANY_PREFIX_TILES:
            with gpu_config(cascade.PREFIX_CFG, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                            num_stages=stages, programs_per_sm=per_sm):
                parts[f"prefix {block_m}x{block_n}/{warps}/{stages}, {per_sm} a SM"] = prefix()
        if r == batch:
            parts["torch SDPA (cuDNN), the prefix contiguous"] = sdpa_reference(q, p)
        parts["suffix"] = lambda: paged_attention.launch_decode(
            q, kc, vc, bt, seq_lens, scale, splits, partials=partials, ctx_start=row_prefix[0],
            first_slot=cascade.PREFIX_SLOTS, short_contexts=True)
        parts["merge"] = lambda: paged_attention.launch_reduce(partials, out, cascade.PREFIX_SLOTS + splits,
                                                               row_prefix[1], cascade.PREFIX_SLOTS)
        prefix_mb = batch // r * p * 2 * HKV * D * ESZ / 1e6
        suffix_mb = int(suffixes.sum()) * 2 * HKV * D * ESZ / 1e6
        print(f"\nbatch {batch}, groups of {r} sharing {p}, own 1-{own}: plain {t_plain:.1f} us, op {t_op:.1f} us; "
              f"{splits} splits; K/V MB prefix {prefix_mb:.0f}, own {suffix_mb:.0f} "
              f"(ideal {(prefix_mb + suffix_mb) / COPY_BYTES_PER_S * 1e12:.1f} us)")
        for name, fn in parts.items():
            print(f"  {name}: {bench(fn, graph=True) * 1e3:.1f} us", flush=True)
        del x
        torch.cuda.empty_cache()


def groups_grid(generator) -> float:
    """The data of engine/prefix_groups.py's cost model: plain decode (rows longest first, as the engine runs
    it) against the cascade op in the engine's layout, on batches of B rows where a share of the rows sit in
    groups of r rows sharing p tokens and the rest have contexts of their own as long, each row followed by
    its own 1..s tokens. One CSV line a point; returns the worst relative error."""
    worst = 0.0
    print("fit," + ",".join(FIT_FIELDS))
    for batch, r, p, own, share in itertools.product(GROUPS_BATCHES, GROUPS_ROWS, GROUPS_PREFIXES, GROUPS_OWN,
                                                     GROUPS_SHARES):
        groups = int(batch * share) // r
        if groups > MAX_CASCADE_GROUPS or groups == 0:
            continue
        suffixes = torch.randint(1, own + 1, (batch,), generator=generator)
        x = engine_layout(make_batch([r] * groups + [1] * (batch - r * groups), p, suffixes, generator))
        t_plain, t_cascade, err = time_pair(x, longest_first=True)
        worst = max(worst, err)
        own_tokens = int(suffixes.sum()) + (batch - r * groups) * p  # what no other row shares
        print(f"fit,{batch},{r},{p},{own},{share},{own_tokens},{groups * p},{(r - 1) * groups * p},"
              f"{int(x['plan'][0, 0])},{t_plain:.2f},{t_cascade:.2f}", flush=True)
        del x
        torch.cuda.empty_cache()
    return worst


def fit_step_cost(path: str) -> StepCost:
    """engine/prefix_groups.StepCost fitted (least squares, each path on its own) to the `fit` lines of a
    --groups run saved in path; prints it with each path's worst and median relative error, and how often
    the fitted pair picks the faster path of the grid's points (and the time lost where it does not)."""
    lines = [line.strip().split(",")[1:] for line in Path(path).read_text().splitlines()
             if line.startswith("fit,")]
    rows = [dict(zip(FIT_FIELDS, map(float, line))) for line in lines if line[0] != "batch"]
    groups = np.array([r["group_prefix_tokens"] / r["prefix"] for r in rows])
    batch = np.array([r["batch"] for r in rows])
    own = np.array([r["own_tokens"] for r in rows])
    prefix = np.array([r["group_prefix_tokens"] for r in rows])
    repeated = np.array([r["repeated_tokens"] for r in rows])
    plain_us, cascade_us = np.array([r["plain_us"] for r in rows]), np.array([r["cascade_us"] for r in rows])
    items = np.array([r["items"] for r in rows])
    ones = np.ones_like(batch)
    x_plain = np.stack([ones, batch, own + prefix, repeated], axis=1)
    x_cascade = np.stack([ones, items, own, prefix, groups], axis=1)
    c_plain = np.linalg.lstsq(x_plain, plain_us, rcond=None)[0]
    c_cascade = np.linalg.lstsq(x_cascade, cascade_us, rcond=None)[0]
    cost = StepCost(tuple(round(float(c), 6) for c in c_plain), tuple(round(float(c), 6) for c in c_cascade),
                    2 * HKV * D * ESZ)
    for name, x, c, t in (("plain", x_plain, c_plain, plain_us), ("cascade", x_cascade, c_cascade, cascade_us)):
        err = np.abs(x @ c - t) / t
        print(f"{name}: worst relative error {err.max():.1%}, median {np.median(err):.1%} over {len(t)} points")
    picks = np.array([cost.cascade_pays(int(r["batch"]), int(r["own_tokens"] + r["rows"] * r["group_prefix_tokens"]),
                                        np.full(int(g), int(r["rows"])), np.full(int(g), int(r["prefix"])),
                                        cost.kv_bytes_per_token, int(n)) for r, g, n in zip(rows, groups, items)])
    best = np.minimum(plain_us, cascade_us)
    taken = np.where(picks, cascade_us, plain_us)
    print(f"the fit picks the faster path at {(taken == best).sum()} of {len(best)} points; it loses "
          f"{(taken - best).sum() / best.sum():.1%} of the grid's best time, the better fixed path "
          f"{min(plain_us.sum(), cascade_us.sum()) / best.sum() - 1:.1%}")
    print(cost)
    return cost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", action="store_true",
                    help="only the grid of many groups (engine/prefix_groups.py's cost model), as CSV")
    ap.add_argument("--many", action="store_true", help="only the op's parts on batches of many small groups")
    ap.add_argument("--fit", metavar="CSV", help="fit engine/prefix_groups.StepCost to a saved --groups run (no GPU)")
    args = ap.parse_args()
    if args.fit:
        fit_step_cost(args.fit)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/cascade.py needs a CUDA GPU; nothing to time here.")
        return 0
    t0 = time.time()
    generator = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; bf16, Hq {HQ}, Hkv {HKV}, D {D}, block {BS}")
    if args.many:
        time_many_parts(generator)
        return 0
    if args.groups:
        worst = groups_grid(generator)
        print(f"worst rel err cascade vs plain: {worst:.1e}; total {time.time() - t0:.0f} s")
        return 0 if worst < 1e-2 else 1
    print(f"shared prefix {PREFIX}; CUDA-graph replays; % = K/V bytes read / time / {COPY_BYTES_PER_S / 1e12:.2f} TB/s")
    hdr = ("| batch | groups | suffix | plain MB | plain us | plain % | cascade K/V MB | partials MB | "
           "items/chunks/splits | cascade us | cascade % | speed-up | rel err |")
    print(hdr + "\n" + "|---" * (hdr.count("|") - 1) + "|")
    worst = 0.0
    for batch in (64, 256):
        for num_groups in (1, 8):
            for label in ("16", "128", "512", "16-512"):
                lo, _, hi = label.partition("-")
                suffixes = torch.randint(int(lo), int(hi or lo) + 1, (batch,), generator=generator)
                worst = max(worst, run_case(batch, num_groups, label, suffixes, generator))
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

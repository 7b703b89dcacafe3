"""GPU benchmark of cascade (shared-prefix) decode attention (issue 12): python3 benchmarks/cascade.py

Qwen3-0.6B heads (16 q, 8 kv, head_dim 128), bf16, block_size 16. Every row has a 2048-token prefix
shared with the other rows of its group (1 or 8 groups) and its own suffix (16, 128 or 512 tokens, or
uniform in 16-512). For batch 64 and 256 it times, as CUDA-graph replays (do_bench medians), plain
paged_attention_decode and ops.cascade_attention_decode, and prints for each the K/V bytes it must
read (plain: every row's whole context; cascade: each group's prefix once plus the suffixes), the
float32 partials the cascade writes and reads back, the time, and that K/V read's share of the
4.26 TB/s device copy; the two outputs must agree (relative error < 1e-2, else exit 1).
A last line times the cascade op on a batch without groups (what a step without sharing would pay
if it did not take the plain path). --sweep also times forced prefix chunk counts.
Without CUDA it prints a message and exits 0.
"""
import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402
from benchmarks.ops import bench  # noqa: E402
from benchmarks.profile_decode import COPY_BYTES_PER_S  # noqa: E402
from ops import cascade, paged_attention  # noqa: E402

HQ, HKV, D, BS, PREFIX = 16, 8, 128, 16, 2048
DT = torch.bfloat16
ESZ = 2


def make_batch(batch, num_groups, suffixes, generator, dev="cuda"):
    """Paged K/V and metadata: rows in num_groups contiguous groups sharing PREFIX tokens (their first
    PREFIX // BS blocks), each row followed by its own suffix. Physical blocks are shuffled."""
    rows_per_group = batch // num_groups
    shared_blocks = PREFIX // BS
    own_blocks = [-(-int(s) // BS) for s in suffixes]
    num_blocks = num_groups * shared_blocks + sum(own_blocks)
    perm = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    width = shared_blocks + max(own_blocks)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    next_block = num_groups * shared_blocks
    for b in range(batch):
        g = b // rows_per_group
        tables[b, :shared_blocks] = perm[g * shared_blocks:(g + 1) * shared_blocks]
        tables[b, shared_blocks:shared_blocks + own_blocks[b]] = perm[next_block:next_block + own_blocks[b]]
        next_block += own_blocks[b]
    cache_shape = (num_blocks, HKV, BS, D)
    return dict(
        q=torch.randn(batch, HQ, D, dtype=DT, device=dev),
        key_cache=torch.randn(cache_shape, dtype=DT, device=dev),
        value_cache=torch.randn(cache_shape, dtype=DT, device=dev),
        block_tables=tables.to(dev),
        seq_lens=(PREFIX + torch.as_tensor(suffixes)).to(torch.int32).to(dev),
        cu_group_rows=torch.arange(0, batch + 1, rows_per_group, dtype=torch.int32, device=dev),
        group_prefix_lens=torch.full((num_groups,), PREFIX, dtype=torch.int32, device=dev),
    )


def run_case(batch, num_groups, suffix_label, suffixes, generator, num_chunks=None):
    x = make_batch(batch, num_groups, suffixes, generator)
    scale = 1 / math.sqrt(D)
    plain_args = (x["q"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"], scale)
    groups = (x["cu_group_rows"], x["group_prefix_lens"])

    def plain():
        return ops.paged_attention_decode(*plain_args)

    def cascaded():
        return cascade.cascade_attention_decode(*plain_args, *groups, num_chunks=num_chunks)

    err = ((cascaded().float() - plain().float()).norm() / plain().float().norm()).item()
    per_token = 2 * HKV * D * ESZ  # K and V of one token
    total_tokens = int(x["seq_lens"].sum())
    suffix_tokens = total_tokens - batch * PREFIX
    plain_bytes = total_tokens * per_token + 2 * batch * HQ * D * ESZ
    cascade_bytes = (num_groups * PREFIX + suffix_tokens) * per_token + 2 * batch * HQ * D * ESZ
    block_q = paged_attention.query_tile(paged_attention.prefill_cfg(x["q"], x["key_cache"]), HQ // HKV, None, True)[1]
    max_ctx = x["block_tables"].shape[1] * BS
    chunks = num_chunks or cascade.prefix_num_chunks(batch, HKV, block_q, max_ctx, x["q"].device)
    splits = paged_attention.decode_num_splits(batch, HKV, max_ctx, x["q"].device)
    partial_bytes = 2 * batch * HQ * (chunks + splits) * D * 4  # written, then read by the merge
    t_plain, t_cascade = bench(plain, graph=True), bench(cascaded, graph=True)
    pct = lambda nbytes, ms: 100 * nbytes / (ms * 1e-3) / COPY_BYTES_PER_S  # noqa: E731
    print(f"| {batch} | {num_groups} | {suffix_label} | {plain_bytes / 1e6:.0f} | {t_plain * 1e3:.1f} | "
          f"{pct(plain_bytes, t_plain):.0f}% | {cascade_bytes / 1e6:.1f} | {partial_bytes / 1e6:.1f} | "
          f"{chunks}/{splits} | {t_cascade * 1e3:.1f} | {pct(cascade_bytes, t_cascade):.0f}% | "
          f"{t_plain / t_cascade:.1f}x | {err:.1e} |", flush=True)
    del x
    torch.cuda.empty_cache()
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time forced prefix chunk counts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cascade.py needs a CUDA GPU; nothing to time here.")
        return 0
    t0 = time.time()
    generator = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; bf16, Hq {HQ}, Hkv {HKV}, D {D}, block {BS}, shared prefix "
          f"{PREFIX}; CUDA-graph replays; % = K/V bytes read / time / {COPY_BYTES_PER_S / 1e12:.2f} TB/s")
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
        print("\nforced prefix chunk counts, batch 256, 1 group, suffix 16:")
        for chunks in (1, 2, 4, 8, 16, 32):
            run_case(256, 1, "16", torch.full((256,), 16), generator, num_chunks=chunks)
    # no groups: the cascade op on a batch with nothing shared (the engine should call plain decode)
    x = make_batch(256, 1, torch.full((256,), 16), generator)
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

"""GPU benchmark of the paged-KV ops. Run on a CUDA machine: python3 benchmarks/ops.py

Prints, in one run:
- the two ceilings: a large device-to-device copy (bytes read + written) and a bf16 8192^3 matmul;
- decode: batch {1,32,256} x context {512,2048,8192,32768} x block_size {16,32,128}, Qwen3-0.6B
  heads (16 q, 8 kv, head_dim 128), bf16: time, GB/s (K and V read, plus q and out), % of the copy,
  and torch SDPA over the same K/V stored contiguously (the price of paging);
- prefill: 1 x {512, 2048, 8192} tokens and 16 x 1024 (causal, no cached prefix): TFLOP/s (causal
  FLOPs: 4 * Hq * D * sum over queries of the keys they see), % of the matmul, and torch SDPA (causal,
  contiguous) for comparison.
Timing: triton.testing.do_bench medians (L2 flushed between repetitions, warm-up first); decode is
timed as CUDA-graph replays (as the engine runs it), the rest eagerly.
Options: --sweep also times tile/warp/stage variants and forced split counts on a few shapes;
--quick runs a reduced grid; --mixed [--range LO-HI] only times decode over contexts of mixed lengths,
with the heuristic's split count and forced ones, each in batch order and longest first;
--prefill-sweep only times the prefill kernel's tiles (PREFILL_SWEEP) on a few shapes, one of them
chunks after a cached prefix as in shared_prefix. Full log: $OUT/bench_ops.log when OUT is set.
"""
import argparse
import math
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops import paged_attention  # noqa: E402

HQ, HKV, D = 16, 8, 128
DT = torch.bfloat16
ESZ = 2
POOL_LIMIT = 40e9  # bytes of K+V pool per decode combo; above it the combo is skipped
LOG = []
MIXED_SPLITS = (1, 2, 4, 8)


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def bench(fn, graph=False):
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
        except Exception as e:  # noqa: BLE001
            log(f"  (graph capture failed: {type(e).__name__}: {e}; timing eagerly)")
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings():
    n = 1 << 31  # 2 Gi bf16 elements = 4 GiB
    a = torch.randn(n, dtype=DT, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    copy_gbs = 2 * n * ESZ / ms / 1e6
    del a, b
    x = torch.randn(8192, 8192, dtype=DT, device="cuda")
    y = torch.randn(8192, 8192, dtype=DT, device="cuda")
    ms_mm = bench(lambda: x @ y)
    mm_tflops = 2 * 8192**3 / ms_mm / 1e9
    del x, y
    torch.cuda.empty_cache()
    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    log(f"copy: {copy_gbs:.0f} GB/s (read+write, 4 GiB); bf16 matmul 8192^3: {mm_tflops:.0f} TFLOP/s")
    return copy_gbs, mm_tflops


def make_pool(num_tokens_total, block_size, flat_k, flat_v):
    nb = num_tokens_total // block_size
    kc = flat_k[: nb * HKV * block_size * D].view(nb, HKV, block_size, D)
    vc = flat_v[: nb * HKV * block_size * D].view(nb, HKV, block_size, D)
    return kc, vc


def decode_case(B, ctx, bs, flat_k, flat_v, num_splits=None):
    kc, vc = make_pool(B * ctx, bs, flat_k, flat_v)
    M = ctx // bs
    bt = torch.randperm(B * M, device="cuda", dtype=torch.int64).to(torch.int32).view(B, M)
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    return lambda: paged_attention.paged_attention_decode(q, kc, vc, bt, seq_lens, scale, num_splits=num_splits)


def decode_bytes(B, ctx):
    return 2 * B * HKV * ctx * D * ESZ + 2 * B * HQ * D * ESZ


def run_decode(copy_gbs, batches, contexts, block_sizes):
    max_tokens = max(B * c for B in batches for c in contexts if 2 * B * c * HKV * D * ESZ <= POOL_LIMIT)
    flat_k = torch.randn(max_tokens * HKV * D, dtype=DT, device="cuda")
    flat_v = torch.randn(max_tokens * HKV * D, dtype=DT, device="cuda")
    rows = []
    log("\n## decode (bf16, Hq=16, Hkv=8, D=128; CUDA-graph replays; % = of the copy above)")
    hdr = "| batch | context | block | splits | time us | GB/s | % copy | SDPA us | SDPA GB/s | paged/SDPA |"
    log(hdr)
    log("|" + "---|" * (hdr.count("|") - 1))
    for B in batches:
        for ctx in contexts:
            kv_bytes = 2 * B * ctx * HKV * D * ESZ
            if kv_bytes > POOL_LIMIT:
                log(f"| {B} | {ctx} | all | - | skipped: K+V pool {kv_bytes / 1e9:.0f} GB > {POOL_LIMIT / 1e9:.0f} GB | | | | | |")
                continue
            nbytes = decode_bytes(B, ctx)
            # SDPA over contiguous K/V [B, Hkv, ctx, D] (GQA): once per (batch, context)
            sdpa_ms = None
            try:
                k = torch.randn(B, HKV, ctx, D, dtype=DT, device="cuda")
                v = torch.randn(B, HKV, ctx, D, dtype=DT, device="cuda")
                q4 = torch.randn(B, HQ, 1, D, dtype=DT, device="cuda")
                sdpa = torch.nn.functional.scaled_dot_product_attention
                from torch.nn.attention import SDPBackend, sdpa_kernel

                # no math fallback: it would materialise the GQA-expanded K/V
                fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                with sdpa_kernel(fast):
                    sdpa_ms = bench(lambda: sdpa(q4, k, v, enable_gqa=True), graph=True)
                del k, v, q4
            except Exception as e:  # noqa: BLE001
                log(f"  SDPA failed at B={B} ctx={ctx}: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()
            for bs in block_sizes:
                fn = decode_case(B, ctx, bs, flat_k, flat_v)
                splits = paged_attention.decode_num_splits(B, HKV, ctx, torch.device("cuda"))
                ms = bench(fn, graph=True)
                gbs = nbytes / ms / 1e6
                s_us = f"{sdpa_ms * 1e3:.1f}" if sdpa_ms else "n/a"
                s_gbs = f"{nbytes / sdpa_ms / 1e6:.0f}" if sdpa_ms else "n/a"
                ratio = f"{ms / sdpa_ms:.2f}" if sdpa_ms else "n/a"
                log(f"| {B} | {ctx} | {bs} | {splits} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {s_us} | {s_gbs} | {ratio} |")
                rows.append((B, ctx, bs, ms, gbs))
    del flat_k, flat_v
    torch.cuda.empty_cache()
    return rows


def run_decode_mixed(copy_gbs, batches, lo=100, hi=2000, bs=16):
    """Contexts of mixed lengths, uniform in [lo, hi] (nano's decodes: 100-2000; long's: 512-4096), with
    the split count of the heuristic (from shapes, as for equal lengths) and with forced ones."""
    log(f"\n## decode, contexts uniform in [{lo}, {hi}] (bf16, block {bs}; CUDA-graph replays; % = of the copy)")
    log("| batch | splits (heuristic) | time us | % copy | longest first us | % copy | "
        + " | ".join(f"{n} splits us (batch order / longest first)" for n in MIXED_SPLITS) + " |")
    log("|---" * (6 + len(MIXED_SPLITS)) + "|")
    gen = torch.Generator().manual_seed(0)
    for B in batches:
        lens = torch.randint(lo, hi + 1, (B,), generator=gen)
        M = -(-hi // bs)
        kc = torch.randn(B * M, HKV, bs, D, dtype=DT, device="cuda")
        vc = torch.randn(B * M, HKV, bs, D, dtype=DT, device="cuda")
        bt = torch.randperm(B * M, device="cuda").to(torch.int32).view(B, M)
        q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
        seq_lens = lens.to(torch.int32).cuda()
        args = (q, kc, vc, bt, seq_lens, 1 / math.sqrt(D))
        ms = bench(lambda: paged_attention.paged_attention_decode(*args), graph=True)
        order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
        ordered = bench(lambda: paged_attention.paged_attention_decode(*args, row_order=order), graph=True)
        forced = [[bench(lambda: paged_attention.paged_attention_decode(*args, num_splits=n, row_order=o), graph=True)
                   for o in (None, order)] for n in MIXED_SPLITS]
        splits = paged_attention.decode_num_splits(B, HKV, M * bs, torch.device("cuda"))
        pct = [100 * 2 * int(lens.sum()) * HKV * D * ESZ / t / 1e6 / copy_gbs for t in (ms, ordered)]
        log(f"| {B} | {splits} | {ms * 1e3:.1f} | {pct[0]:.0f}% | {ordered * 1e3:.1f} | {pct[1]:.0f}% | "
            + " | ".join(f"{a * 1e3:.1f} / {b * 1e3:.1f}" for a, b in forced) + " |")
        del kc, vc
        torch.cuda.empty_cache()


def prefill_case(nseq, L, bs, cached=0):
    """nseq chunks of L new tokens, each after `cached` tokens already in the cache."""
    T, ctx = nseq * L, cached + L
    M = -(-ctx // bs)
    kc = torch.randn(nseq * M, HKV, bs, D, dtype=DT, device="cuda")
    vc = torch.randn(nseq * M, HKV, bs, D, dtype=DT, device="cuda")
    bt = torch.randperm(nseq * M, device="cuda").to(torch.int32).view(nseq, M)
    q = torch.randn(T, HQ, D, dtype=DT, device="cuda")
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((nseq,), ctx, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    return lambda: paged_attention.paged_attention_prefill(q, kc, vc, bt, cu, seq_lens, scale)


def prefill_flops(nseq, L, cached=0):
    return 4 * HQ * D * nseq * (L * cached + L * (L + 1) / 2)


def run_prefill(mm_tflops, shapes, bs=16):
    log(f"\n## prefill (bf16, causal, no cached prefix, block_size {bs}; % = of the matmul above)")
    hdr = "| seqs x tokens | time us (graph) | TFLOP/s | % matmul | eager us | SDPA us (eager) | SDPA TFLOP/s |"
    log(hdr)
    log("|" + "---|" * (hdr.count("|") - 1))
    for nseq, L in shapes:
        fn = prefill_case(nseq, L, bs)
        ms = bench(fn, graph=True)
        eager_ms = bench(fn)
        tf = prefill_flops(nseq, L) / ms / 1e9
        q = torch.randn(nseq, HQ, L, D, dtype=DT, device="cuda")
        k = torch.randn(nseq, HKV, L, D, dtype=DT, device="cuda")
        v = torch.randn(nseq, HKV, L, D, dtype=DT, device="cuda")
        try:
            sms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            s = f"{sms * 1e3:.0f} | {prefill_flops(nseq, L) / sms / 1e9:.0f}"
        except Exception as e:  # noqa: BLE001
            s = f"n/a ({type(e).__name__}) | n/a"
        log(f"| {nseq} x {L} | {ms * 1e3:.0f} | {tf:.0f} | {100 * tf / mm_tflops:.0f}% | {eager_ms * 1e3:.0f} | {s} |")
        torch.cuda.empty_cache()


def sweep(copy_gbs, mm_tflops):
    log("\n## sweep: decode tile configs (GB/s, % copy)")
    flat_tokens = 256 * 2048
    flat_k = torch.randn(flat_tokens * HKV * D, dtype=DT, device="cuda")
    flat_v = torch.randn(flat_tokens * HKV * D, dtype=DT, device="cuda")
    orig = dict(paged_attention.DECODE_CFG["gpu"])
    shapes = [(256, 2048, 16), (256, 2048, 128), (1, 32768, 16), (32, 2048, 16)]
    for cfg in [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3)]:
        paged_attention.DECODE_CFG["gpu"] = dict(BLOCK_N=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
        res = []
        for B, ctx, bs in shapes:
            try:
                ms = bench(decode_case(B, ctx, bs, flat_k, flat_v), graph=True)
                res.append(f"B{B}/ctx{ctx}/bs{bs}: {ms * 1e3:.1f}us {100 * decode_bytes(B, ctx) / ms / 1e6 / copy_gbs:.0f}%")
            except Exception as e:  # noqa: BLE001
                res.append(f"B{B}/ctx{ctx}/bs{bs}: failed {type(e).__name__}")
        log(f"BLOCK_N={cfg[0]} warps={cfg[1]} stages={cfg[2]}: " + "; ".join(res))
    paged_attention.DECODE_CFG["gpu"] = orig
    log("\n## sweep: decode forced split counts")
    for B, ctx in [(1, 32768), (1, 2048), (32, 2048), (32, 8192)]:
        res = []
        for ns in [1, 2, 4, 8, 16, 32, 64, 128]:
            if B * ctx > flat_tokens:
                continue
            ms = bench(decode_case(B, ctx, 16, flat_k, flat_v, num_splits=ns), graph=True)
            res.append(f"{ns}: {ms * 1e3:.1f}us {100 * decode_bytes(B, ctx) / ms / 1e6 / copy_gbs:.0f}%")
        log(f"B{B}/ctx{ctx}/bs16 (heuristic {paged_attention.decode_num_splits(B, HKV, ctx, torch.device('cuda'))}): " + "; ".join(res))
    del flat_k, flat_v
    torch.cuda.empty_cache()
    prefill_sweep(mm_tflops)


PREFILL_SWEEP = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
                 (128, 64, 8, 4), (64, 128, 4, 2), (256, 64, 16, 3), (256, 128, 16, 2), (256, 64, 8, 3), (256, 32, 8, 3)]
PREFILL_SWEEP_SHAPES = [(1, 8192, 0), (16, 1024, 0), (64, 128, 2048)]  # (chunks, new tokens, cached tokens)


def prefill_sweep(mm_tflops):
    log("\n## sweep: prefill tile configs, bs 16 (TFLOP/s, % matmul); chunks x new tokens (+ cached)")
    orig = dict(paged_attention.PREFILL_CFG["gpu"])
    for cfg in PREFILL_SWEEP:
        paged_attention.PREFILL_CFG["gpu"] = dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
        res = []
        for nseq, L, cached in PREFILL_SWEEP_SHAPES:
            try:
                ms = bench(prefill_case(nseq, L, 16, cached))
                tf = prefill_flops(nseq, L, cached) / ms / 1e9
                res.append(f"{nseq}x{L}+{cached}: {tf:.0f} TF/s {100 * tf / mm_tflops:.0f}%")
            except Exception as e:  # noqa: BLE001
                res.append(f"{nseq}x{L}+{cached}: failed {type(e).__name__}: {str(e)[:80]}")
        log(f"BLOCK_M={cfg[0]} BLOCK_N={cfg[1]} warps={cfg[2]} stages={cfg[3]}: " + "; ".join(res))
    paged_attention.PREFILL_CFG["gpu"] = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mixed", action="store_true", help="only the mixed-length decode table")
    ap.add_argument("--range", default="100-2000", help="--mixed's context lengths, LO-HI")
    ap.add_argument("--prefill-sweep", action="store_true", help="only the prefill tile sweep")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "benchmarks/ops.py needs a CUDA GPU"
    t0 = time.time()
    copy_gbs, mm_tflops = ceilings()
    if args.sweep:
        sweep(copy_gbs, mm_tflops)
    if args.prefill_sweep:
        prefill_sweep(mm_tflops)
    elif args.mixed:
        lo, hi = map(int, args.range.split("-"))
        run_decode_mixed(copy_gbs, [4, 16, 32, 48, 64, 96, 128, 160, 192, 256], lo, hi)
    elif args.quick:
        run_decode(copy_gbs, [1, 256], [2048, 32768], [16, 128])
        run_prefill(mm_tflops, [(1, 8192)])
    else:
        run_decode(copy_gbs, [1, 32, 256], [512, 2048, 8192, 32768], [16, 32, 128])
        run_prefill(mm_tflops, [(1, 512), (1, 2048), (1, 8192), (16, 1024)])
    log(f"\n(total {time.time() - t0:.0f} s)")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_ops.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()

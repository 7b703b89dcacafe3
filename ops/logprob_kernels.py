"""Triton kernel of the raw log-probabilities (contract and PyTorch reference: sampling_reference.logprobs).

    logprobs(logits[N,V], targets[N] i64, k) -> f32 [N, 2 + 2k]
        per row: log_softmax(logits)[target], its rank as int32 bits (1 + the tokens of a larger logit),
        the k largest log-probabilities (descending; ties: the smaller id first), their ids as int32 bits.
        k <= MAX_K.

One read of the logits, in their own dtype (no float32 copy of [N, V]). Two launches:
 1. _split_kernel, programs per (row, vocabulary range): per lane an online max and sum of
    exp(l - max) (one exp2 per logit), the count of logits above the target's, and the range's k best
    (logit, id) in a buffer of MAX_K slots. A tile is looked at only when its max beats the buffer's worst (the k-th best so far);
    then its best logits are inserted one at a time, evicting the worst. Tokens come in id order
    and ties are inserted smaller id first and never displace an equal logit, so the buffer holds
    the range's k best by (logit descending, id ascending).
 2. _finish_kernel, per row: the log-normaliser from the ranges' (max, sum), the target's logit
    minus it, its rank (1 + the ranges' counts), and the k best of the ranges' buffers, by the same order.
No argument depends on the batch size or on k (one compilation per logits dtype).
"""
import torch
import triton
import triton.language as tl

from ops import sampling_reference

MAX_K = 32  # buffer slots per (row, range): the largest k
_INT32_MAX = tl.constexpr(2**31 - 1)
_LOG2E = tl.constexpr(sampling_reference.LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(do_not_specialize=["k"])
def _split_kernel(logits_ptr, targets_ptr, part_f_ptr, part_i_ptr, k, V, chunk, s_lb, s_lv,
                  NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr):
    """part_f[row, split] = (max m, sum of exp(l - m), KP best logits), part_i = (the count of logits above
    the target's, the KP best ids); slots k.. and slots never filled hold (-inf, -1)."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row = logits_ptr + b * s_lb
    target = tl.load(row + tl.load(targets_ptr + b) * s_lv).to(tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    offs = tl.arange(0, BLOCK)
    slots = tl.arange(0, KP)
    top = tl.where(slots < k, float("-inf"), float("inf"))  # slots past k never hold the worst
    top_i = tl.full([KP], -1, tl.int32)
    worst = tl.min(top, 0)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    above = tl.zeros([BLOCK], dtype=tl.int32)
    for v0 in range(start, end, BLOCK):
        v = v0 + offs
        x = tl.load(row + v * s_lv, mask=v < end, other=float("-inf")).to(tl.float32)
        above += (x > target).to(tl.int32)
        # one exp2: rescale to a new lane max, or add below it (0 for -inf logits)
        high = tl.maximum(x, m)
        e = tl.exp2((tl.minimum(x, m) - tl.where(high > float("-inf"), high, 0.0)) * _LOG2E)
        s = tl.where(x > m, s * e + 1.0, s + e)
        m = high
        best = tl.max(x, 0)
        while best > worst:
            i = tl.min(tl.where(x == best, v, _INT32_MAX), 0)
            # evict the worst slot, the one of largest id among equal logits
            evicted = tl.max(tl.where(top == worst, top_i, -1), 0)
            slot = tl.min(tl.where((top == worst) & (top_i == evicted), slots, KP), 0)
            top = tl.where(slots == slot, best, top)
            top_i = tl.where(slots == slot, i, top_i)
            worst = tl.min(top, 0)
            x = tl.where(v == i, float("-inf"), x)
            best = tl.max(x, 0)
    row_max = tl.max(m, 0)
    part = b * NUM_SPLITS + split
    tl.store(part_f_ptr + part * (2 + KP), row_max)
    # lanes without a finite logit hold s = 0; a finite reference keeps -inf - -inf out
    tl.store(part_f_ptr + part * (2 + KP) + 1,
             tl.sum(s * tl.exp2((m - tl.where(row_max > float("-inf"), row_max, 0.0)) * _LOG2E), 0))
    tl.store(part_f_ptr + part * (2 + KP) + 2 + slots, tl.where(slots < k, top, float("-inf")))
    tl.store(part_i_ptr + part * (1 + KP), tl.sum(above, 0))
    tl.store(part_i_ptr + part * (1 + KP) + 1 + slots, top_i)


@triton.jit(do_not_specialize=["k"])
def _finish_kernel(logits_ptr, targets_ptr, part_f_ptr, part_i_ptr, out_ptr, out_i_ptr, k, s_lb, s_lv,
                   NUM_SPLITS: tl.constexpr, KP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    part = b * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_f_ptr + part * (2 + KP))
    s = tl.load(part_f_ptr + part * (2 + KP) + 1)
    top = tl.max(m, 0)
    z = tl.sum(s * tl.exp2((m - tl.where(top > float("-inf"), top, 0.0)) * _LOG2E), 0)
    lse = top + tl.log2(z) * _LN2
    width = 2 + 2 * k
    target = tl.load(targets_ptr + b)
    tl.store(out_ptr + b * width, tl.load(logits_ptr + b * s_lb + target * s_lv).to(tl.float32) - lse)
    tl.store(out_i_ptr + b * width + 1, 1 + tl.sum(tl.load(part_i_ptr + part * (1 + KP)), 0))
    c = tl.arange(0, NUM_SPLITS * KP)
    vals = tl.load(part_f_ptr + (b * NUM_SPLITS + c // KP) * (2 + KP) + 2 + c % KP)
    ids = tl.load(part_i_ptr + (b * NUM_SPLITS + c // KP) * (1 + KP) + 1 + c % KP)
    for j in range(k):
        best = tl.max(vals, 0)
        i = tl.min(tl.where(vals == best, ids, _INT32_MAX), 0)
        taken = tl.min(tl.where((vals == best) & (ids == i), c, NUM_SPLITS * KP), 0)
        tl.store(out_ptr + b * width + 2 + j, best - lse)
        tl.store(out_i_ptr + b * width + 2 + k + j, i)
        vals = tl.where(c == taken, float("-inf"), vals)
        ids = tl.where(c == taken, _INT32_MAX, ids)


# Tunables. Keys: "gpu" / "interp"; constants, not functions of the batch size (no recompiles);
# num_splits a power of two.
CFG = {
    "gpu": dict(num_splits=16, block=1024, num_warps=4),
    "interp": dict(num_splits=2, block=64, num_warps=1),
}


def logprobs(logits, targets, k, cfg=None):
    """cfg: override CFG (tests)."""
    if not 0 <= k <= MAX_K:
        raise ValueError(f"logprobs: k must be in [0, {MAX_K}], got {k}")
    N, V = logits.shape
    out = torch.empty((N, 2 + 2 * k), dtype=torch.float32, device=logits.device)
    if N == 0:
        return out
    cfg = cfg or CFG["gpu" if logits.is_cuda else "interp"]
    splits, block = cfg["num_splits"], min(cfg["block"], triton.next_power_of_2(V))
    part_f = torch.empty((N, splits, 2 + MAX_K), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((N, splits, 1 + MAX_K), dtype=torch.int32, device=logits.device)
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block
    targets = targets.contiguous()
    _split_kernel[(N, splits)](logits, targets, part_f, part_i, k, V, chunk, *logits.stride(),
                               NUM_SPLITS=splits, BLOCK=block, KP=MAX_K, num_warps=cfg["num_warps"])
    _finish_kernel[(N,)](logits, targets, part_f, part_i, out, out.view(torch.int32), k,
                         *logits.stride(), NUM_SPLITS=splits, KP=MAX_K, num_warps=1)
    return out

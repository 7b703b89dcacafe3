"""Triton sampling kernels (contracts and PyTorch references: ops/sampling_reference.py).

    gumbel_sample(logits[B,V], temperature[B] f32, seed[B] i64, step[B] i64, num_splits=None) -> i64 [B]
    top_k_top_p_sample(logits[B,V], temperature[B] f32, top_k[B] i64, top_p[B] f32, seed[B], step[B],
                       min_p[B] f32 | None) -> i64 [B]
    apply_token_bitmask(logits[B,V], bitmask[R,W] i32, rows[R] i64 | None) -> logits, in place

Logits of any float dtype are widened to float32 as they are read. The noise is computed in the
kernels (uint32 arithmetic, bit-identical to sampling_reference.uniform_noise for seed and step in
[0, 2^32)); on CUDA the scores use IEEE division and libdevice's logf, as torch's CUDA kernels do,
so that ties resolve alike. Nothing sorts the vocabulary, nothing synchronises with the host, grids
come from shapes only and no argument depends on the batch size (no recompiles as it changes).

gumbel_sample: programs per (row, vocabulary range) loop over vocabulary tiles. The exact scores cost
two precise logs and a division per token, so the sweep ranks approximate ones (fast hardware logs,
a product by 1 / T; within NOISE_ERR of the exact) keeping per lane its best token and its runner-up,
then scores the best token exactly: when every other token's approximate score lies beyond its error
bound below that, the range's (max, argmax) is exact. Otherwise (a near tie, inf or NaN logits, a row
at temperature 0: the plain argmax) the range is swept again with exact scores, first index on ties.
With one range per row the program writes the token id; otherwise each range writes (max, argmax)
and a second kernel reduces the ranges of a row.

top_k_top_p_sample: the best score over the kept set K, exactly, in rounds. K is an upper set of
logit values, so if w is the best score over an upper set S that contains K, either w is in K (then
it is the answer) or no token with a logit <= l_w is in K (then S = {l > l_w}, and again). A row
costs one light pass over its logits when K lies among its top few hundred logits (any top_k up to
~200, and top-p when those hold the mass), and otherwise one noise pass plus about one count pass.
Four launches:
 1. _stats_kernel, programs per (row, split): the row's max logit, the normaliser Z (online, per
    lane) and the candidates R: each lane keeps its two largest logits, G is the largest logit a
    lane did not keep, and the kept ones above G are stored (every token above G is in R; ~450 of
    them at V = 151,936). A split whose candidates overflow CAP raises its G above the lost ones.
 2. _decide_kernel, per row: temperature 0 takes the argmax. If a token at G (the lost logit) is
    not kept, neither is any token below it, so K lies in R: the rounds run on R in registers
    (noise for R only) and the row is done. Otherwise the row is marked.
 3. _gumbel_kernel with CHAIN, programs per (row, split) of marked rows: the noise pass, keeping
    per lane a chain: the best score c1, the best score c2 among the lane's logits above l_c1, and
    a bound on the scores above the last; reduced per split the same way.
 4. _finish_kernel, per marked row: the rounds from the best score. A candidate above G is settled
    on R in registers; below G, a count pass over the row tests it, and the next candidate comes
    from the chains when they determine it, else from a noise pass over the row (rare).
The test of a candidate is one function (_kept): top-k, top-p and min-p (the candidate's weight
e_w = exp2((l_w - max) * c) against min_p).
Every loop is bounded. A round either stops or moves l_w up to the logit of a finite score above it, so the
rounds end; a round that cannot (non-finite logits), more than max_rounds rounds (TOP_K_TOP_P_CFG), or rows
whose rounds on the candidates did not settle take an exact fallback instead: K's floor found by bisection
over the float32 values (_kept_floor, 32 count passes), then the best score above it, the token the rounds
would give. The rows that take it are counted on the device (top_k_top_p_sample's `fallbacks`).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ops import sampling_reference

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - only the interpreter path is usable then
    libdevice = None

_INT32_MAX = tl.constexpr(2**31 - 1)
_LOG2E = tl.constexpr(sampling_reference.LOG2E)
# tiles per iteration of the memory-bound loops (statistics, counts): their loads are issued together,
# since one program per row (or per split at small batches) is bound by the latency of its loads
_UNROLL = tl.constexpr(4)
_NOISE_SHIFT = tl.constexpr(32 - sampling_reference.NOISE_BITS)
_HALF_BIN = tl.constexpr(0.5 / 2**sampling_reference.NOISE_BITS)
_LN2 = tl.constexpr(0.6931471805599453)
# bound of |_approx_noise(u) - the exact noise| over every u; a product by 1 / T is within 2^-21 of
# the quotient relative to it, so an approximate score a is within _score_error(a) of the exact one
NOISE_ERR = 2.0**-10
_NOISE_ERR = tl.constexpr(NOISE_ERR)
_NOISE_MAX = tl.constexpr(17.0)  # -log(-log u) < 17 for the largest u, 1 - 2^-24
_FALLBACK = tl.constexpr(2)  # _decide_kernel's flag of a row whose rounds did not settle
_MINUS_INF_KEY = tl.constexpr(-0x7F800000)  # _order_key(-inf)


# --------------------------------------------------------------------------------------------
# noise and scores
# --------------------------------------------------------------------------------------------
@triton.jit
def _mix32(x):
    """sampling_reference.mix32 on uint32 values: the same bits as its int64 arithmetic (which keeps
    the low 32 bits of each product)."""
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, step_ptr, b):
    seed = tl.load(seed_ptr + b).to(tl.uint32)
    step = tl.load(step_ptr + b).to(tl.uint32)
    return _mix32(_mix32(seed) ^ step)


@triton.jit
def _uniform_from_bits(bits):
    """sampling_reference.uniform_from_bits for uint32 bits < 2^23: they are the mantissa of
    f = 1 + bits / 2^23 (no integer-to-float conversion, a slow instruction); f - 1 and the half bin
    added to it are exact."""
    f = (bits | 0x3F800000).to(tl.float32, bitcast=True)
    return (f - 1.0) + _HALF_BIN


@triton.jit
def _uniform(key, v):
    """sampling_reference.uniform_noise for token ids v (int32 >= 0) of a row whose key is _row_key."""
    return _uniform_from_bits(_mix32(key ^ v.to(tl.uint32)) >> _NOISE_SHIFT)


@triton.jit
def _scores(x, v, key, temp, CUDA_MATH: tl.constexpr):
    """x / temp + the Gumbel noise of token ids v (float32, as sampling_reference.gumbel_scores)."""
    scaled = tl.math.div_rn(x, temp + tl.zeros_like(x))  # IEEE division, as torch
    u = _uniform(key, v)
    if CUDA_MATH:
        noise = libdevice.log(-libdevice.log(u))
    else:
        noise = tl.log(-tl.log(u))
    return scaled - noise


@triton.jit
def _fast_log2(x, CUDA_MATH: tl.constexpr):
    """log2 x: on CUDA the hardware approximation (one instruction), elsewhere the interpreter's."""
    if CUDA_MATH:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _approx_noise(u, CUDA_MATH: tl.constexpr):
    """-log(-log u) to within NOISE_ERR (checked for every u by the tests), with the fast logs. Near
    u = 1 the fast log of u has no relative accuracy, so there -log u comes from its series in
    w = 1 - u (exact: u is a multiple of 2^-24)."""
    w = 1.0 - u
    minus_log_u = tl.where(w < 1.0 / 256, w * (1.0 + w * (0.5 + w * (1.0 / 3.0))),
                           -_fast_log2(u, CUDA_MATH) * _LN2)
    return -_fast_log2(minus_log_u, CUDA_MATH) * _LN2


@triton.jit
def _best(score, logit, ids):
    """The best entry of vectors (score, logit, id): the highest score, the smallest id among equal
    scores. Returns its (score, logit, id); score -inf when every entry is -inf."""
    s = tl.max(score, 0)
    i = tl.min(tl.where(score == s, ids, _INT32_MAX), 0)
    return s, tl.max(tl.where(ids == i, logit, float("-inf")), 0), i


# --------------------------------------------------------------------------------------------
# the Gumbel pass: plain (gumbel_sample) or keeping chains (top_k_top_p_sample)
# --------------------------------------------------------------------------------------------
@triton.jit
def _scan(row, s_lv, start, end, floor, key, temp,
          BLOCK: tl.constexpr, FLOOR: tl.constexpr, CHAIN: tl.constexpr, CUDA_MATH: tl.constexpr):
    """A BLOCK-lane sweep of tokens [start, end) (with FLOOR: those whose logit is above floor).
    Per lane: c1 = (s1, l1, i1), its best (score, logit, id); with CHAIN also c2 = (s2, l2, i2),
    its best among the logits above l1 (s2 = l2 = -inf: unknown or none), and tb, a bound on every
    score above the last of them. Tokens arrive in id order, so a new token beats a kept one only by
    a higher score. -inf logits score -inf, NaN ones compare false: neither is ever kept."""
    offs = tl.arange(0, BLOCK)
    greedy = temp == 0.0
    temp_safe = tl.where(greedy, 1.0, temp)
    s1 = tl.full([BLOCK], float("-inf"), tl.float32)
    l1, s2, l2, tb = s1, s1, s1, s1
    i1 = tl.zeros([BLOCK], dtype=tl.int32)
    i2 = i1
    for v0 in range(start, end, BLOCK):
        v = v0 + offs
        x = tl.load(row + v * s_lv, mask=v < end, other=float("-inf")).to(tl.float32)
        if FLOOR:
            x = tl.where(x > floor, x, float("-inf"))
        score = tl.where(greedy, x, _scores(x, v, key, temp_safe, CUDA_MATH))
        new1 = score > s1
        if CHAIN:
            t2 = tl.where(s2 > float("-inf"), s2, tb)  # a bound on the best score above l1
            above1 = (~new1) & (x > l1)
            new2 = above1 & (score > t2)
            c1_to_c2 = new1 & (l1 > x)
            c2_lost = new1 & (l1 <= x) & (l2 <= x)
            tb = tl.where(new1, tl.where(l1 > x, t2, tb),
                          tl.where(new2, tl.where(l2 > x, s2, tb),
                                   tl.where(above1 & (x > l2), tl.maximum(tb, score), tb)))
            s2 = tl.where(c1_to_c2, s1, tl.where(c2_lost, float("-inf"), tl.where(new2, score, s2)))
            l2 = tl.where(c1_to_c2, l1, tl.where(c2_lost, float("-inf"), tl.where(new2, x, l2)))
            i2 = tl.where(c1_to_c2, i1, tl.where(new2, v, i2))
        s1 = tl.where(new1, score, s1)
        l1 = tl.where(new1, x, l1)
        i1 = tl.where(new1, v, i1)
    return s1, l1, i1, s2, l2, i2, tb


@triton.jit
def _chain_query(s1, l1, i1, s2, l2, i2, tb, theta):
    """Over chains (per lane or per split): the best (score, logit, id) among logits above theta
    that the chains determine, and a bound on the scores above theta that they do not; the result
    is the best over {l > theta} when its score is above the bound or the bound is -inf."""
    first = l1 > theta
    second = (~first) & (s2 > float("-inf")) & (l2 > theta)
    s, l, i = _best(tl.where(first, s1, tl.where(second, s2, float("-inf"))),
                    tl.where(first, l1, l2), tl.where(first, i1, i2))
    return s, l, i, tl.max(tl.where(first | second, float("-inf"), tb), 0)


@triton.jit
def _score_error(a):
    """A bound of |exact score - a| for an approximate score a (module constants above); a + _score_error(a)
    increases with a."""
    return _NOISE_ERR + (tl.abs(a) + _NOISE_MAX) * 2.0**-20


@triton.jit
def _fast_best(row, s_lv, start, end, key, temp, BLOCK: tl.constexpr, CUDA_MATH: tl.constexpr):
    """The best (score, id) of tokens [start, end) of a row at temperature > 0, and whether it is settled.
    A sweep of approximate scores (x * (1 / T) + _approx_noise) keeps per lane its best a1 (id, logit)
    and the best a2 of its other tokens; then the exact score s of the best lane's token. Every other
    token's exact score is at most r + _score_error(r), r the runner-up of the approximate scores: when
    that is below s, s is the best exact score and no other token ties it (settled). Otherwise (a near
    tie, infinite or NaN logits, temperature 0: rare) the caller runs the exact sweep."""
    offs = tl.arange(0, BLOCK)
    inv_temp = 1.0 / temp
    a1 = tl.full([BLOCK], float("-inf"), tl.float32)
    a2, x1 = a1, a1
    i1 = tl.zeros([BLOCK], dtype=tl.int32)
    for v0 in range(start, tl.where(temp > 0.0, end, start), BLOCK):
        v = v0 + offs
        x = tl.load(row + v * s_lv, mask=v < end, other=float("-inf")).to(tl.float32)
        a = x * inv_temp + _approx_noise(_uniform(key, v), CUDA_MATH)
        new = a > a1
        a2 = tl.maximum(a2, tl.where(new, a1, a))
        a1 = tl.where(new, a, a1)
        x1 = tl.where(new, x, x1)
        i1 = tl.where(new, v, i1)
    _, x, i = _best(a1, x1, i1)
    runner_up = tl.maximum(tl.max(a2, 0), tl.max(tl.where(i1 == i, float("-inf"), a1), 0))
    s = _scores(x, i, key, temp, CUDA_MATH)
    return s, i, runner_up + _score_error(runner_up) < s


@triton.jit
def _gumbel_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, flag_ptr, out_ptr, part_f_ptr, part_i_ptr,
    V, chunk, s_lb, s_lv,
    NUM_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr, CHAIN: tl.constexpr, CUDA_MATH: tl.constexpr,
):
    """Plain: (max, argmax) per (row, range), or the token when NUM_SPLITS == 1. CHAIN: only rows
    whose flag is set; per (row, range) its chain c1, c2, tb (part_f: s1 l1 s2 l2 tb, part_i: i1 i2)."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if CHAIN:
        run = tl.load(flag_ptr + b) != 0
    else:
        run = split >= 0
    if run:
        start = split * chunk
        end = tl.minimum(start + chunk, V)
        row = logits_ptr + b * s_lb
        key = _row_key(seed_ptr, step_ptr, b)
        temp = tl.load(temp_ptr + b)
        part = b * NUM_SPLITS + split
        if CHAIN:
            s1, l1, i1, s2, l2, i2, tb = _scan(row, s_lv, start, end, 0.0, key, temp,
                                               BLOCK_V, False, True, CUDA_MATH)
            c1_s, c1_l, c1_i = _best(s1, l1, i1)
            c2_s, c2_l, c2_i, c2_bound = _chain_query(s1, l1, i1, s2, l2, i2, tb, c1_l)
            known = (c2_s > c2_bound) & (c2_s > float("-inf"))
            c3_s, _, _, c3_bound = _chain_query(s1, l1, i1, s2, l2, i2, tb, c2_l)
            tl.store(part_f_ptr + part * 5, c1_s)
            tl.store(part_f_ptr + part * 5 + 1, c1_l)
            tl.store(part_f_ptr + part * 5 + 2, tl.where(known, c2_s, float("-inf")))
            tl.store(part_f_ptr + part * 5 + 3, tl.where(known, c2_l, float("-inf")))
            tl.store(part_f_ptr + part * 5 + 4, tl.where(known, tl.maximum(c3_s, c3_bound),
                                                         tl.maximum(c2_s, c2_bound)))
            tl.store(part_i_ptr + part * 2, c1_i)
            tl.store(part_i_ptr + part * 2 + 1, c2_i)
        else:
            m, idx, settled = _fast_best(row, s_lv, start, end, key, temp, BLOCK_V, CUDA_MATH)
            if not settled:
                s1, _, i1, _, _, _, _ = _scan(row, s_lv, start, end, 0.0, key, temp,
                                              BLOCK_V, False, False, CUDA_MATH)
                m = tl.max(s1, 0)
                idx = tl.min(tl.where(s1 == m, i1, V), 0)  # first index among the lanes' maxima
            if NUM_SPLITS == 1:
                tl.store(out_ptr + b, idx.to(tl.int64))
            else:
                tl.store(part_f_ptr + part, m)
                tl.store(part_i_ptr + part, idx)


@triton.jit
def _gumbel_reduce_kernel(part_max_ptr, part_idx_ptr, out_ptr, V,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < NUM_SPLITS
    m = tl.load(part_max_ptr + b * NUM_SPLITS + offs, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + b * NUM_SPLITS + offs, mask=mask, other=V)
    best = tl.max(m, 0)
    # ranges are ordered by token id, so the smallest index among the maxima is the first one
    tl.store(out_ptr + b, tl.min(tl.where(m == best, idx, V), 0).to(tl.int64))


# --------------------------------------------------------------------------------------------
# top_k_top_p_sample: statistics and candidates, the rounds, decide, finish
# --------------------------------------------------------------------------------------------
@triton.jit
def _stats_kernel(
    logits_ptr, temp_ptr, stats_f_ptr, stats_i_ptr, cand_l_ptr, cand_i_ptr,
    V, s_lb, s_lv,
    NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
):
    """Per (row, split), over tiles split, split + NUM_SPLITS, ... (a spread of the vocabulary):
    stats_f = (max logit m, sum of exp2((l - m) * c), G), stats_i = (first argmax, candidates
    stored); cand_l / cand_i: the stored candidates (logit, id), every token of the split above G."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(temp_ptr + b)
    c = _LOG2E / tl.where(temp > 0.0, temp, 1.0)
    row = logits_ptr + b * s_lb
    offs = tl.arange(0, BLOCK)
    v1 = tl.full([BLOCK], float("-inf"), tl.float32)
    v2, v3 = v1, v1  # per lane: the two largest logits (ids i1, i2) and the third
    z = tl.zeros([BLOCK], dtype=tl.float32)  # per lane: sum of exp2((l - v1) * c)
    i1 = tl.zeros([BLOCK], dtype=tl.int32)
    i2 = i1
    for t0 in range(split, tl.cdiv(V, BLOCK), NUM_SPLITS * _UNROLL):
        for u in tl.static_range(_UNROLL):
            v = (t0 + u * NUM_SPLITS) * BLOCK + offs
            x = tl.load(row + v * s_lv, mask=v < V, other=float("-inf")).to(tl.float32)
            gt1 = x > v1
            gt2 = x > v2
            # one exp2: rescale to a new lane max, or add below it (0 for -inf logits)
            high = tl.maximum(x, v1)
            e = tl.exp2((tl.minimum(x, v1) - tl.where(high > float("-inf"), high, 0.0)) * c)
            z = tl.where(gt1, z * e + 1.0, z + e)
            v3 = tl.where(gt2, v2, tl.where(x > v3, x, v3))
            v2 = tl.where(gt1, v1, tl.where(gt2, x, v2))
            i2 = tl.where(gt1, i1, tl.where(gt2, v, i2))
            v1 = tl.where(gt1, x, v1)
            i1 = tl.where(gt1, v, i1)
    m = tl.max(v1, 0)
    part = b * NUM_SPLITS + split
    tl.store(stats_f_ptr + part * 3, m)
    # lanes without a finite logit hold z = 0; a finite reference keeps -inf - -inf out
    tl.store(stats_f_ptr + part * 3 + 1, tl.sum(z * tl.exp2((v1 - tl.where(m > float("-inf"), m, 0.0)) * c), 0))
    tl.store(stats_i_ptr + part * 2, tl.min(tl.where(v1 == m, i1, V), 0))
    # compaction: the lanes' first logits above G, then their second ones, up to CAP
    g = tl.max(v3, 0)
    keep1 = v1 > g
    keep2 = v2 > g
    n1 = tl.sum(keep1.to(tl.int32), 0)
    pos1 = tl.cumsum(keep1.to(tl.int32), 0) - 1
    pos2 = n1 + tl.cumsum(keep2.to(tl.int32), 0) - 1
    store1 = keep1 & (pos1 < CAP)
    store2 = keep2 & (pos2 < CAP)
    tl.store(cand_l_ptr + part * CAP + pos1, v1, mask=store1)
    tl.store(cand_i_ptr + part * CAP + pos1, i1, mask=store1)
    tl.store(cand_l_ptr + part * CAP + pos2, v2, mask=store2)
    tl.store(cand_i_ptr + part * CAP + pos2, i2, mask=store2)
    lost = tl.maximum(tl.max(tl.where(keep1 & ~store1, v1, float("-inf")), 0),
                      tl.max(tl.where(keep2 & ~store2, v2, float("-inf")), 0))
    tl.store(stats_f_ptr + part * 3 + 2, tl.maximum(g, lost))
    tl.store(stats_i_ptr + part * 2 + 1, tl.minimum(n1 + tl.sum(keep2.to(tl.int32), 0), CAP))


@triton.jit
def _row_stats(stats_f_ptr, stats_i_ptr, b, c, V, NUM_SPLITS: tl.constexpr):
    """(max logit M, Z = sum of exp2((l - M) * c), G, the first argmax) of row b."""
    part = b * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(stats_f_ptr + part * 3)
    z = tl.load(stats_f_ptr + part * 3 + 1)
    top = tl.max(m, 0)
    z = tl.sum(z * tl.exp2((m - tl.where(top > float("-inf"), top, 0.0)) * c), 0)  # as in _stats_kernel
    first = tl.min(tl.where(m == top, tl.load(stats_i_ptr + part * 2), V), 0)
    return top, z, tl.max(tl.load(stats_f_ptr + part * 3 + 2), 0), first


@triton.jit
def _scored_candidates(cand_l_ptr, cand_i_ptr, stats_i_ptr, b, top, c, key, temp, theta,
                       NUM_SPLITS: tl.constexpr, CAP: tl.constexpr, CUDA_MATH: tl.constexpr):
    """The stored candidates of row b as vectors: logit (empty slots -inf), id, weight
    exp2((l - top) * c), and score (-inf at or below theta)."""
    r = tl.arange(0, NUM_SPLITS * CAP)
    stored = r % CAP < tl.load(stats_i_ptr + (b * NUM_SPLITS + r // CAP) * 2 + 1)
    vals = tl.load(cand_l_ptr + b * NUM_SPLITS * CAP + r, mask=stored, other=float("-inf"))
    ids = tl.load(cand_i_ptr + b * NUM_SPLITS * CAP + r, mask=stored, other=0)
    scores = tl.where(vals > theta, _scores(vals, ids, key, temp, CUDA_MATH), float("-inf"))
    return vals, ids, tl.exp2((vals - top) * c), scores


@triton.jit
def _kept(count, mass, l_w, top, c, k, p, min_p, z):
    """Whether a token of logit l_w, with `count` logits and `mass` of exp2 weight strictly above its
    own, is in K (row max `top`, c = log2(e) / T)."""
    return (count == 0) | ((count < k) & ((p >= 1.0) | (mass <= p * z)) & (tl.exp2((l_w - top) * c) >= min_p))


@triton.jit
def _rounds(vals, ids, e, scores, l_w, i_w, top, c, k, p, min_p, z, MAX_ROUNDS: tl.constexpr):
    """The rounds on candidate vectors (logit, id, weight, score) that hold every token above l_w,
    from w, the best score over an upper set that contains K. Returns (the id of the best in K,
    settled). Each round that does not stop moves l_w up to a candidate's logit (the best score among
    the candidates above l_w), so the rounds end within the number of candidates; a round that finds
    no finite score above l_w (non-finite logits) or MAX_ROUNDS rounds leave the row unsettled, for
    the exact fallback (_kept_floor)."""
    done = tl.zeros([], dtype=tl.int1)
    moved = ~done
    rounds = 0
    while (not done) & moved & (rounds < MAX_ROUNDS):
        rounds += 1
        above = vals > l_w
        if _kept(tl.sum(above.to(tl.int32), 0), tl.sum(tl.where(above, e, 0.0), 0), l_w, top, c, k, p, min_p, z):
            done = True
        else:
            s, l, i = _best(tl.where(above, scores, float("-inf")), vals, ids)
            moved = (s > float("-inf")) & (l > l_w)
            l_w, i_w = l, i
    return i_w, done


@triton.jit
def _decide_kernel(
    stats_f_ptr, stats_i_ptr, cand_l_ptr, cand_i_ptr, temp_ptr, k_ptr, p_ptr, min_p_ptr, seed_ptr, step_ptr,
    out_ptr, flag_ptr, V,
    NUM_SPLITS: tl.constexpr, CAP: tl.constexpr, MAX_ROUNDS: tl.constexpr, CUDA_MATH: tl.constexpr,
):
    """Per row: out = the token when the statistics settle it (greedy rows, all -inf rows, K inside
    the candidates), with flag 0; else flag 1 (the noise pass and _finish_kernel draw it), or
    _FALLBACK when the rounds on the candidates did not settle (_finish_kernel's fallback draws it)."""
    b = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + b)
    k = tl.load(k_ptr + b)
    p = tl.load(p_ptr + b)
    min_p = tl.load(min_p_ptr + b)
    c = _LOG2E / tl.where(temp > 0.0, temp, 1.0)
    top, z, g, token = _row_stats(stats_f_ptr, stats_i_ptr, b, c, V, NUM_SPLITS)
    flag = ((temp > 0.0) & (top > float("-inf"))).to(tl.int32)
    if (flag != 0) & ((k < V) | (p < 1.0) | (min_p > 0.0)):
        vals, ids, e, scores = _scored_candidates(cand_l_ptr, cand_i_ptr, stats_i_ptr, b, top, c,
                                                  _row_key(seed_ptr, step_ptr, b), temp, g,
                                                  NUM_SPLITS, CAP, CUDA_MATH)
        above = vals > g
        if not _kept(tl.sum(above.to(tl.int32), 0), tl.sum(tl.where(above, e, 0.0), 0), g, top, c, k, p, min_p, z):
            # a token at G is not kept, nor any below it: K lies among the candidates above G
            _, l_w, i_w = _best(scores, vals, ids)
            token, settled = _rounds(vals, ids, e, scores, l_w, i_w, top, c, k, p, min_p, z, MAX_ROUNDS)
            flag = tl.where(settled, 0, _FALLBACK)
    tl.store(out_ptr + b, token.to(tl.int64))
    tl.store(flag_ptr + b, flag)


@triton.jit
def _count_above(row, s_lv, V, theta, top, c, BLOCK: tl.constexpr):
    """(count, mass) of the logits of a row above theta."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, V, BLOCK * _UNROLL):
        for u in tl.static_range(_UNROLL):
            v = v0 + u * BLOCK + offs
            x = tl.load(row + v * s_lv, mask=v < V, other=float("-inf")).to(tl.float32)
            above = x > theta
            count += above.to(tl.int32)
            mass += tl.where(above, tl.exp2((x - top) * c), 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0)


@triton.jit
def _best_above(row, s_lv, V, theta, key, temp, BLOCK: tl.constexpr, CUDA_MATH: tl.constexpr):
    """The best (score, logit, id) of a row over its logits above theta: a noise pass."""
    s1, l1, i1, _, _, _, _ = _scan(row, s_lv, 0, V, theta, key, temp, BLOCK, True, False, CUDA_MATH)
    return _best(s1, l1, i1)


@triton.jit
def _order_key(x):
    """int32 keys of float32 values in their order (-0.0 and 0.0 alike): sampling_reference._ordered_bits."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


@triton.jit
def _key_value(key):
    """The float32 value of an int64 _order_key (0: +0.0)."""
    return tl.where(key < 0, -key - 2147483648, key).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _kept_floor(row, s_lv, V, top, c, k, p, min_p, z, BLOCK: tl.constexpr):
    """theta, the largest float32 at which a token would not be kept (-inf when every finite logit
    would be): K is the set of tokens with logits above theta. Whether a token of logit x would be kept
    (_kept on the count and mass of the logits above x: a count pass) can only turn from no to yes as x
    grows: the count, and the float32 sums of fewer non-negative weights, can only shrink. So bisection
    over the order-preserving keys of float32 finds theta in 32 halvings of the keys between -inf (taken
    as not kept) and the row's max (kept: nothing is above it). The exact fallback of the rounds."""
    lo = tl.full([], _MINUS_INF_KEY, tl.int64)
    hi = _order_key(top).to(tl.int64)
    for _ in range(32):
        mid = (lo + hi) >> 1
        x = _key_value(mid)
        count, mass = _count_above(row, s_lv, V, x, top, c, BLOCK)
        kept = _kept(count, mass, x, top, c, k, p, min_p, z)
        hi = tl.where(kept, mid, hi)
        lo = tl.where(kept, lo, mid)
    return _key_value(lo)


@triton.jit
def _finish_kernel(
    logits_ptr, temp_ptr, k_ptr, p_ptr, min_p_ptr, seed_ptr, step_ptr, flag_ptr,
    stats_f_ptr, stats_i_ptr, cand_l_ptr, cand_i_ptr, chain_f_ptr, chain_i_ptr, out_ptr, fallback_ptr,
    V, s_lb, s_lv,
    NUM_SPLITS: tl.constexpr, CAP: tl.constexpr, CHAIN_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr,
    MAX_ROUNDS: tl.constexpr, CUDA_MATH: tl.constexpr,
):
    """Per row marked by _decide_kernel: the rounds from the best score (module docstring, step 4).
    Each round either stops or moves l_w up to the logit of the best score above it; a round that
    cannot (no finite score above l_w: non-finite logits), MAX_ROUNDS rounds, or a row that
    _decide_kernel could not settle, take the exact fallback instead: K's floor by bisection
    (_kept_floor), then the best score above it; each such row adds 1 to *fallback_ptr."""
    b = tl.program_id(0).to(tl.int64)
    flag = tl.load(flag_ptr + b)
    if flag != 0:
        temp = tl.load(temp_ptr + b)
        k = tl.load(k_ptr + b)
        p = tl.load(p_ptr + b)
        min_p = tl.load(min_p_ptr + b)
        c = _LOG2E / temp
        key = _row_key(seed_ptr, step_ptr, b)
        row = logits_ptr + b * s_lb
        top, z, g, _ = _row_stats(stats_f_ptr, stats_i_ptr, b, c, V, NUM_SPLITS)
        part = b * CHAIN_SPLITS + tl.arange(0, CHAIN_SPLITS)
        s1 = tl.load(chain_f_ptr + part * 5)
        l1 = tl.load(chain_f_ptr + part * 5 + 1)
        s2 = tl.load(chain_f_ptr + part * 5 + 2)
        l2 = tl.load(chain_f_ptr + part * 5 + 3)
        tb = tl.load(chain_f_ptr + part * 5 + 4)
        i1 = tl.load(chain_i_ptr + part * 2)
        i2 = tl.load(chain_i_ptr + part * 2 + 1)
        _, l_w, i_w, _ = _chain_query(s1, l1, i1, s2, l2, i2, tb, float("-inf"))
        done = (k >= V) & (p >= 1.0) & (min_p <= 0.0)  # nothing to cut: the best score overall
        moved = flag != _FALLBACK
        rounds = 0
        while (not done) & moved & (rounds < MAX_ROUNDS):
            rounds += 1
            if l_w > g:  # every token above l_w is a candidate
                vals, ids, e, scores = _scored_candidates(cand_l_ptr, cand_i_ptr, stats_i_ptr, b, top, c,
                                                          key, temp, g, NUM_SPLITS, CAP, CUDA_MATH)
                i_w, done = _rounds(vals, ids, e, scores, l_w, i_w, top, c, k, p, min_p, z, MAX_ROUNDS)
                moved = done
            else:
                count, mass = _count_above(row, s_lv, V, l_w, top, c, BLOCK_V)
                if _kept(count, mass, l_w, top, c, k, p, min_p, z):
                    done = True
                else:  # count >= 1: the next candidate exists
                    s, l, i, bound = _chain_query(s1, l1, i1, s2, l2, i2, tb, l_w)
                    if (s <= bound) & (bound > float("-inf")):  # the chains do not tell: scan
                        s, l, i = _best_above(row, s_lv, V, l_w, key, temp, BLOCK_V, CUDA_MATH)
                    moved = (s > float("-inf")) & (l > l_w)
                    l_w, i_w = l, i
        if not done:
            theta = _kept_floor(row, s_lv, V, top, c, k, p, min_p, z, BLOCK_V)
            _, _, i_w = _best_above(row, s_lv, V, theta, key, temp, BLOCK_V, CUDA_MATH)
            tl.atomic_add(fallback_ptr, 1)
        tl.store(out_ptr + b, i_w.to(tl.int64))


# Tunables. Keys: "gpu" / "interp". Split counts are constants, not functions of the batch size:
# they are compile-time constants of the kernels, and a count that followed the batch recompiled them
# whenever the batch shrank past a threshold (seconds each, inside the timed run). In top_k_top_p,
# every per-row result depends on the config only, never on the batch: sums run in a fixed order.
GUMBEL_CFG = {
    "gpu": dict(BLOCK_V=2048, num_warps=8, num_splits=16),
    "interp": dict(BLOCK_V=1024, num_warps=4, num_splits=2),
}
TOP_K_TOP_P_CFG = {
    # stats: NUM_SPLITS x BLOCK lanes keeping 2 logits each, CAP candidates per split. Simulated at
    # V = 151,936 (logits in random order): tokens above G median ~450, 10th percentile ~280; 0.2
    # splits per row overflow CAP = 128 (and raise their G). More lanes need a larger CAP.
    # max_rounds: rounds before the exact fallback (a draw takes ~log2 of the kept set's size at most,
    # in expectation: the next candidate is the best score above the last one's logit)
    "gpu": dict(stats=dict(num_splits=16, block=256, cap=128, num_warps=2),
                chain=dict(num_splits=16, block=2048, num_warps=8),
                finish=dict(block=2048, num_warps=8, max_rounds=32)),
    "interp": dict(stats=dict(num_splits=4, block=32, cap=32, num_warps=1),
                   chain=dict(num_splits=2, block=128, num_warps=1),
                   finish=dict(block=256, num_warps=1, max_rounds=32)),
}


def gumbel_sample(logits, temperature, seed, step, num_splits: Optional[int] = None):
    """num_splits: force the number of vocabulary ranges per row (tests, benchmarks); None picks
    it from shapes."""
    B, V = logits.shape
    temperature, seed, step = temperature.contiguous(), seed.contiguous(), step.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    cfg = GUMBEL_CFG["gpu" if logits.is_cuda else "interp"]
    block_v = min(cfg["BLOCK_V"], triton.next_power_of_2(V))
    num_splits = max(1, min(int(num_splits or cfg["num_splits"]), triton.cdiv(V, block_v)))
    chunk = triton.cdiv(triton.cdiv(V, num_splits), block_v) * block_v
    if num_splits > 1:
        part_max = torch.empty((B, num_splits), dtype=torch.float32, device=logits.device)
        part_idx = torch.empty((B, num_splits), dtype=torch.int32, device=logits.device)
    else:
        part_max, part_idx = out, out  # unused
    _gumbel_kernel[(B, num_splits)](
        logits, temperature, seed, step, out, out, part_max, part_idx,
        V, chunk, *logits.stride(),
        NUM_SPLITS=num_splits, BLOCK_V=block_v, CHAIN=False, CUDA_MATH=_cuda_math(logits),
        num_warps=cfg["num_warps"],
    )
    if num_splits > 1:
        _gumbel_reduce_kernel[(B,)](
            part_max, part_idx, out, V,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1,
        )
    return out


def _cuda_math(logits):
    return logits.is_cuda and libdevice is not None


def top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p=None, cfg=None, fallbacks=None):
    """min_p: float32 [B] (None: off); cfg: TOP_K_TOP_P_CFG's layout (tests, benchmarks), None picks
    it for the device; fallbacks: int32 [1], increased on the device by the rows drawn through the exact
    fallback (None: not counted)."""
    B, V = logits.shape
    dev = logits.device
    temperature, top_k, top_p = temperature.contiguous(), top_k.contiguous(), top_p.contiguous()
    min_p = torch.zeros_like(top_p) if min_p is None else min_p.contiguous()
    seed, step = seed.contiguous(), step.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out
    cfg = cfg or TOP_K_TOP_P_CFG["gpu" if logits.is_cuda else "interp"]
    st, ch, fin = cfg["stats"], cfg["chain"], cfg["finish"]
    if fin["max_rounds"] < 1:  # Triton 3.6 fails to compile a loop whose condition is false from the start
        raise ValueError(f"finish.max_rounds must be >= 1, got {fin['max_rounds']}")
    splits, cap, chain_splits = st["num_splits"], st["cap"], ch["num_splits"]
    # one float32 and one int32 workspace (two allocations, not seven): contiguous pieces
    f_sizes, i_sizes = (splits * 3, splits * cap, chain_splits * 5), (splits * 2, splits * cap, chain_splits * 2, 1)
    stats_f, cand_l, chain_f = torch.empty(B * sum(f_sizes), dtype=torch.float32, device=dev).split(
        [B * n for n in f_sizes])
    stats_i, cand_i, chain_i, flags = torch.empty(B * sum(i_sizes), dtype=torch.int32, device=dev).split(
        [B * n for n in i_sizes])
    if fallbacks is None:  # a counter of its own (not a piece of the workspace): aligned as a caller's, one variant
        fallbacks = torch.empty(1, dtype=torch.int32, device=dev)
    cuda_math = _cuda_math(logits)
    _stats_kernel[(B, splits)](
        logits, temperature, stats_f, stats_i, cand_l, cand_i, V, *logits.stride(),
        NUM_SPLITS=splits, BLOCK=st["block"], CAP=cap, num_warps=st["num_warps"])
    _decide_kernel[(B,)](
        stats_f, stats_i, cand_l, cand_i, temperature, top_k, top_p, min_p, seed, step, out, flags, V,
        NUM_SPLITS=splits, CAP=cap, MAX_ROUNDS=fin["max_rounds"], CUDA_MATH=cuda_math, num_warps=fin["num_warps"])
    chunk = triton.cdiv(triton.cdiv(V, chain_splits), ch["block"]) * ch["block"]
    _gumbel_kernel[(B, chain_splits)](
        logits, temperature, seed, step, flags, out, chain_f, chain_i, V, chunk, *logits.stride(),
        NUM_SPLITS=chain_splits, BLOCK_V=ch["block"], CHAIN=True, CUDA_MATH=cuda_math,
        num_warps=ch["num_warps"])
    _finish_kernel[(B,)](
        logits, temperature, top_k, top_p, min_p, seed, step, flags, stats_f, stats_i, cand_l, cand_i,
        chain_f, chain_i, out, fallbacks, V, *logits.stride(),
        NUM_SPLITS=splits, CAP=cap, CHAIN_SPLITS=chain_splits, BLOCK_V=fin["block"],
        MAX_ROUNDS=fin["max_rounds"], CUDA_MATH=cuda_math, num_warps=fin["num_warps"])
    return out



# --------------------------------------------------------------------------------------------
# structured outputs' masks

_BITMASK_BLOCK = 4096  # tokens per program: 128 words of a mask row


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, V, W, stride, BLOCK: tl.constexpr):
    """Program (i, j): tokens [j * BLOCK, (j + 1) * BLOCK) of logits row rows[i], against bitmask row i.
    Only the disallowed tokens are read and written."""
    i = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i)
    word = tl.load(bitmask_ptr + i.to(tl.int64) * W + v // 32, mask=v < 32 * W, other=0)
    banned = (((word >> (v % 32)) & 1) == 0) & (v < V)
    ptr = logits_ptr + row * stride + v
    x = tl.load(ptr, mask=banned, other=0.0).to(tl.float32)  # a NaN stays NaN, as min(NaN, -inf) is
    tl.store(ptr, tl.where(x != x, x, float("-inf")).to(logits_ptr.dtype.element_ty), mask=banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """sampling_reference.apply_token_bitmask in one launch over the R masked rows (a grid of R x V / 4096
    programs: the batch size is not an argument, so nothing recompiles as it changes)."""
    B, V = logits.shape
    if rows is None:
        rows = torch.arange(B, device=logits.device)
    if logits.stride(1) != 1 or not bitmask.is_contiguous():
        raise ValueError("apply_token_bitmask needs logits rows and the bitmask contiguous")
    if bitmask.shape[0]:
        _bitmask_kernel[(bitmask.shape[0], triton.cdiv(V, _BITMASK_BLOCK))](
            logits, bitmask, rows, V, bitmask.shape[1], logits.stride(0), BLOCK=_BITMASK_BLOCK, num_warps=4)
    return logits

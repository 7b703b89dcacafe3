"""Paged-KV ops, the fused elementwise ops of a decoder layer, and sampling.

Each takes backend=None|"triton"|"torch": None picks Triton for CUDA tensors and the PyTorch reference
otherwise. Each family is a pair of modules: the Triton kernels in ops/<family>.py and their readable
PyTorch versions, which state the contracts, in ops/<family>_reference.py (paged_attention, fused,
sampling, moe, fp8_gemm). Two Triton modules mirror a function of another family's reference: cascade.py,
paged_attention_reference.cascade_attention_decode; logprob_kernels.py, sampling_reference.logprobs
(not named logprobs.py: importing a submodule ops.logprobs would rebind the function ops.logprobs to
it). The cache's address map and the ops' contracts: docs/design.md. The Triton modules are imported only
when asked for: triton is optional on CPU.
"""
import functools
import importlib
from typing import NamedTuple

import torch

from ops import paged_attention_reference, sampling_reference

BACKENDS = ("triton", "torch")


def _use_triton(backend, tensor) -> bool:
    if backend is None:
        return tensor.is_cuda
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return backend == "triton"


def _pick(backend, tensor, family: str):
    """ops/<family>.py or ops/<family>_reference.py, as backend and tensor's device say."""
    return importlib.import_module(f"ops.{family}" if _use_triton(backend, tensor) else f"ops.{family}_reference")


def _checked_out(out, q, dtype=None):
    """An op's out (the attention ops', the fused RoPE's): None, or a tensor of q's shape, dtype (or the dtype
    given) and device (a view is fine)."""
    dtype = dtype or q.dtype
    if out is not None and (out.shape != q.shape or out.dtype != dtype or out.device != q.device):
        raise ValueError(f"out must match q: got {tuple(out.shape)} {out.dtype} on {out.device}, "
                         f"q is {tuple(q.shape)} {dtype} on {q.device}")
    return out


def paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, backend=None, *,
                           max_seq_len=None, row_order=None, out=None):
    """max_seq_len (optional): a CPU-side bound of seq_lens; the Triton backend uses it only to size its
    split-KV grid (results are right for any value). row_order (optional): an int32 [B] permutation of
    the rows, the order in which the Triton kernel starts them (the engine's: longest first). out
    (optional, as in every attention op): a tensor shaped as q that receives the result (returned)."""
    return _pick(backend, q, "paged_attention").paged_attention_decode(
        q, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len, row_order=row_order,
        out=_checked_out(out, q))


def cascade_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, cu_group_rows,
                             group_prefix_lens, backend=None, *, plan=None, out=None):
    """paged_attention_decode for rows in groups that share a prefix: rows cu_group_rows[g]:
    cu_group_rows[g+1] (int32 [G+1], from 0, nondecreasing, at most B; later rows share nothing) share
    their first group_prefix_lens[g] (int32 [G], <= each member's seq_len) tokens, in the same physical
    blocks; the prefix K/V is read once per group (per row tile), not once per row. plan
    (optional): the Triton prefix pass's work list on q's device (ops.cascade.PrefixPass.plan); without it
    the Triton backend plans from the groups, reading them on the host (what a CUDA graph cannot hold)."""
    if cu_group_rows.dim() != 1 or group_prefix_lens.shape != (cu_group_rows.shape[0] - 1,):
        raise ValueError(f"cu_group_rows must be [G+1] and group_prefix_lens [G]; got "
                         f"{tuple(cu_group_rows.shape)} and {tuple(group_prefix_lens.shape)}")
    if cu_group_rows.dtype != torch.int32 or group_prefix_lens.dtype != torch.int32:
        raise ValueError(f"cu_group_rows and group_prefix_lens must be int32; got {cu_group_rows.dtype} "
                         f"and {group_prefix_lens.dtype}")
    if _use_triton(backend, q):
        return importlib.import_module("ops.cascade").cascade_attention_decode(
            q, key_cache, value_cache, block_tables, seq_lens, scale, cu_group_rows, group_prefix_lens, plan=plan,
            out=_checked_out(out, q))
    return paged_attention_reference.cascade_attention_decode(
        q, key_cache, value_cache, block_tables, seq_lens, scale, cu_group_rows, group_prefix_lens,
        out=_checked_out(out, q))


def paged_attention_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, backend=None, *,
                            max_seqlen_q=None, out=None):
    """max_seqlen_q (optional): a CPU-side bound of the query lengths; the Triton backend uses it to pick a
    smaller query tile for short chunks (it never needs it, and never synchronises with the device)."""
    return _pick(backend, q, "paged_attention").paged_attention_prefill(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q=max_seqlen_q,
        out=_checked_out(out, q))


def rms_norm(x, weight, eps, backend=None):
    """x [T, H], weight [H] -> weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)."""
    return _pick(backend, x, "fused").rms_norm(x, weight, eps)


def rope_and_write_kv_cache(q, k, v, cos, sin, positions, key_cache, value_cache, slot_mapping, backend=None, *,
                            qk_norm=None, input_norm=None, bias=None, out=None, scales=None):
    """q [T, Hq, D], k and v [T, Hkv, D]: RoPE of q and k with the float32 tables cos/sin [max_pos, D] at
    positions [T], after the per-head RMSNorm over D of each when qk_norm = (q_weight [D], k_weight [D],
    eps) is given (Qwen3's QK-norm); the rotated k and v go to the cache through slot_mapping (the contract
    of ops/paged_attention_reference.write_kv_cache) -> the rotated q: a new contiguous tensor, or out (a
    contiguous tensor shaped as q) when given. input_norm = (hidden [T, H], eps): q, k and v are projections
    of the raw hidden rows, the RMSNorm before them folded into their weight, and are first scaled by each
    row's rsqrt(mean(hidden^2) + eps); bias = (q_bias [Hq * D], k_bias [Hkv * D], v_bias [Hkv * D]) is
    added after that (ops/fused_reference.py states the rounding). scales = (row_scale [T, 1], (q_cols, k_cols,
    v_cols)): q, k and v are an FP8 product still to be scaled (fp8_product's), in float32; each is first scaled
    and rounded to the model's dtype, which out and the returned q then have (input_norm's hidden's dtype, so
    input_norm is needed). One kernel on CUDA."""
    if out is not None and not out.is_contiguous():
        raise ValueError("out must be contiguous")
    dtype = _deferred_dtype(scales, input_norm, q)
    return _pick(backend, q, "fused").rope_and_write_kv_cache(
        q, k, v, cos, sin, positions, key_cache, value_cache, slot_mapping, qk_norm, input_norm=input_norm,
        bias=bias, out=_checked_out(out, q, dtype), scales=scales, dtype=dtype)


# silu_and_mul's to_e4m3 is one program per row, two passes: on the H200 (Qwen3-8B's widths, CUDA graphs) it
# takes 1.5-1.8x the two kernels it replaces at 8-64 rows, 1.01-1.09x at 128-256, 0.97x at 512, 0.55-0.58x at
# 4,096-16,384 (benchmarks/NOTES.md, session 32): the models ask for it above this many rows
SILU_E4M3_ABOVE_ROWS = 256


def silu_and_mul(x, backend=None, *, input_norm=None, bias=None, scales=None, to_e4m3=False):
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]; with input_norm = (hidden [T, H], eps) and bias [2I], x is first
    scaled and biased as rope_and_write_kv_cache's q; scales = (row_scale [T, 1], columns [2I]): x is an FP8
    product still to be scaled, as there. to_e4m3: the product's rows rounded to e4m3 for an FP8 projection
    (E4M3Rows, fp8_matmul's x), in the same kernel on CUDA."""
    dtype = _deferred_dtype(scales, input_norm, x)
    impl = _pick(backend, x, "fused")
    if not to_e4m3:
        return impl.silu_and_mul(x, input_norm, bias, scales, dtype)
    return E4M3Rows(*impl.silu_and_mul(x, input_norm, bias, scales, dtype, _gemm_rows(x.shape[0], x)), x.shape[0],
                    dtype)


def _deferred_dtype(scales, input_norm, x):
    """The dtype the fused ops round to and return: x's, or with an FP8 product's deferred scales the model's
    (input_norm's hidden's)."""
    if scales is None:
        return x.dtype
    if input_norm is None:
        raise ValueError("scales need input_norm, whose hidden rows give the model's dtype")
    return input_norm[0].dtype


def gumbel_sample(logits, temperature, seed, step, backend=None):
    """One Gumbel-max draw per row: argmax_v logits[b, v] / temperature[b] + G(seed[b], step[b], v)
    with the counter-based noise of ops/sampling_reference.py; logits [B, V] of any float dtype,
    temperature >= 0 (0: the argmax) -> int64 [B]."""
    return _pick(backend, logits, "sampling").gumbel_sample(logits, temperature, seed, step)


def top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, backend=None, *, min_p=None, fallbacks=None):
    """The same draw over the kept set of top-k, top-p and min-p (ties of logit values kept together:
    ops/sampling_reference.kept_mask); top_k int64 [B] (>= V: off), top_p float32 [B] (1: off), min_p
    float32 [B] (0 or None: off). fallbacks: int32 [1] or None; the Triton kernels add to it the rows
    they drew through their exact fallback (a row whose rounds ran out: ops/sampling.py), which the
    reference never needs."""
    if not _use_triton(backend, logits):
        return sampling_reference.top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p=min_p)
    return importlib.import_module("ops.sampling").top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step,
                                                                      min_p=min_p, fallbacks=fallbacks)


def logprobs(logits, targets, k, backend=None):
    """Raw log-probabilities, packed for one copy to the host: logits [N, V] of any float dtype, targets
    int64 [N], 0 <= k <= 32 -> float32 [N, 2 + 2k]: log_softmax(logits)[target], the target's rank (1 + the
    tokens of a larger logit) as int32 bits, the k largest log-probabilities (descending; ties: smaller id
    first), their ids as int32 bits (unpack_logprobs)."""
    impl = importlib.import_module("ops.logprob_kernels" if _use_triton(backend, logits) else "ops.sampling_reference")
    return impl.logprobs(logits, targets, k)


def unpack_logprobs(packed):
    """logprobs' output [N, 2 + 2k] -> (target logprob [N], target rank int32 [N], top logprobs [N, k], top ids
    int32 [N, k])."""
    k = (packed.shape[1] - 2) // 2
    bits = packed.view(torch.int32)
    return packed[:, 0], bits[:, 1], packed[:, 2:2 + k], bits[:, 2 + k:]


def apply_token_bitmask(logits, bitmask, rows=None, backend=None):
    """Structured outputs' masks, in place: logits row rows[i] ([B, V], any float dtype) keeps token t iff bit
    t % 32 of bitmask[i, t // 32] is 1 (int32 [R, W] on the logits' device), else -inf; t >= 32 * W is
    disallowed; rows int64 [R] distinct, None: row i. Returns logits (ops/sampling_reference.py)."""
    return _pick(backend, logits, "sampling").apply_token_bitmask(logits, bitmask, rows)


def apply_penalties(logits, token_ids, prompt_lens, num_tokens, repetition, presence, frequency):
    """Repetition (over prompt and outputs), presence and frequency (over outputs) penalties as batched
    torch ops on any device (ops/sampling_reference.apply_penalties): logits float32 [R, V], token_ids
    [R, W] (row r's tokens: its first num_tokens[r], of which prompt_lens[r] are its prompt) -> [R, V]."""
    return sampling_reference.apply_penalties(logits, token_ids, prompt_lens, num_tokens, repetition, presence,
                                              frequency)


FP8_DTYPES = paged_attention_reference.FP8_DTYPES


def quantize_rows_to_e4m3(x, input_weight=None, rows=None, backend=None):
    """(q float8_e4m3fn, scale float32 [R, 1]) with x' [R, C] ~ q * scale, x' = x * input_weight (optional, [C]:
    a folded RMSNorm's weight) in float32: each row's scale is its largest magnitude / 448 (an all-zero row:
    1), so its largest value maps to e4m3's largest. Weights per output row (engine/models/quantization.py)
    and activations per token (fp8_matmul) alike (ops/fused_reference.py; Triton: one kernel). rows (>= R):
    q and scale get that many rows, the first R x's; the others are padding for a GEMM, whose own rows
    of the product nothing reads (their values are the backend's: unwritten memory in Triton's)."""
    if rows is not None and rows < x.shape[0]:
        raise ValueError(f"rows must be at least x's {x.shape[0]}, got {rows}")
    return _pick(backend, x, "fused").quantize_rows_to_e4m3(x, input_weight, rows)


class E4M3Rows(NamedTuple):
    """Activations already rounded for fp8_matmul (its x): q float8_e4m3fn [P, C] and scale float32 [P, 1] of
    quantize_rows_to_e4m3, of which the first `count` rows are the activations' (P >= count: padding for the
    GEMM, _gemm_rows), and dtype, theirs (the model's): made by the kernel before the matmul (silu_and_mul's
    to_e4m3, fp8_matmul's quantize_sum), which saves the quantization's own kernel."""
    q: torch.Tensor
    scale: torch.Tensor
    count: int
    dtype: torch.dtype


# torch's FP8 GEMM with a scale per row of each operand (CUTLASS on Hopper) takes up to twice as long at 129-255
# rows as at 256 (the H200, benchmarks/NOTES.md, session 23): fp8_matmul pads those row counts to 256
SCALED_MM_PADDED = (128, 256)
# Up to this many rows (more with a residual: then the scaling kernel is also the sum's) fp8_matmul multiplies
# with unit scales, which torch sends to cuBLASLt, whose FP8 GEMM read the Qwen3-8B weights 1.3-2x as fast at
# 1-128 rows on the H200 (benchmarks/NOTES.md, session 25), and scales the float32 product in a kernel of its own:
# faster up to 64 rows for gate_up, up to 256 with a residual for o_proj and down_proj
UNIT_SCALE_ROWS = 64
UNIT_SCALE_ROWS_WITH_RESIDUAL = 256
# Above those, the row-scaled GEMM runs with fast accumulation (the tensor cores' own partial sums, promoted to
# float32 less often): 9-14% faster for Qwen3-8B's qkv, o and gate_up at 16,384 rows on the H200, 4-5% off the
# 8B long run's prefill steps, its KL divergence from bf16 unchanged (benchmarks/NOTES.md, session 30)
FAST_ACCUMULATION = True


@functools.lru_cache(maxsize=None)
def _unit_scale(device):
    return torch.ones((), dtype=torch.float32, device=device)


def _gemm_rows(rows, x):
    """The rows of the row-scaled GEMM's FP8 operand for `rows` activations on x's device (SCALED_MM_PADDED)."""
    low, high = SCALED_MM_PADDED
    return high if x.is_cuda and low < rows < high else rows


def fp8_matmul(x, weight, weight_scale, input_weight=None, residual=None, backend=None, *, quantize_sum=False,
               sum_input_weight=None):
    """x [T, K] (the model's dtype) @ (weight * weight_scale[:, None])^T -> [T, N] in x's dtype: W8A8 with
    dynamic per-token activation scales. weight float8_e4m3fn [N, K] with weight_scale float32 [N] (one scale
    per output row); input_weight [K] (optional): a folded RMSNorm's weight, multiplied into x first;
    residual [T, N] (optional): the product is added into it, in place, and it is returned. Each row of
    x' = x * input_weight goes to e4m3 (quantize_rows_to_e4m3), unless x comes rounded already (E4M3Rows:
    input_weight is then ignored); torch._scaled_mm multiplies the FP8 operands, accumulating in float32. Up
    to UNIT_SCALE_ROWS rows (UNIT_SCALE_ROWS_WITH_RESIDUAL with a residual) it does so with unit scales into
    float32, and scale_product (ops/fp8_gemm.py) applies both scales (and the residual's sum) in one rounding;
    above, _scaled_mm applies them itself, with fast accumulation (FAST_ACCUMULATION), the row counts of
    SCALED_MM_PADDED padded up to its bound on CUDA. quantize_sum (with residual): the sum's kernel also rounds
    the summed rows times sum_input_weight [N] (optional: the next projection's folded norm weight) to e4m3
    for the FP8 projection that reads them next (add_and_quantize_rows): returns (residual, E4M3Rows).
    Contract: the float64 product of the dequantized operands, to float32 accumulation, or to ~1e-3 of the
    product's size with fast accumulation over thousands of products (tests/test_fp8_weights.py)."""
    rows, cols = _count(x), weight.shape[0]
    dtype = x.dtype
    if residual is not None and (residual.shape != (rows, cols) or residual.dtype != dtype):
        raise ValueError(f"residual must be [{rows}, {cols}] in {dtype}, got {tuple(residual.shape)} in {residual.dtype}")
    if quantize_sum and residual is None:
        raise ValueError("quantize_sum needs a residual: it rounds the sum")
    if rows == 0:
        out = residual if residual is not None else weight.new_empty((0, cols), dtype=dtype)
        return (out, _e4m3_rows(out, sum_input_weight, backend)) if quantize_sum else out
    if rows <= (UNIT_SCALE_ROWS if residual is None else UNIT_SCALE_ROWS_WITH_RESIDUAL):
        product, scales = _unit_scale_product(x, weight, weight_scale, input_weight, backend)
    else:
        x = _e4m3_rows(x, input_weight, backend)
        product = torch._scaled_mm(x.q, weight.t(), scale_a=x.scale, scale_b=weight_scale.float().reshape(1, -1),
                                   out_dtype=dtype, use_fast_accum=FAST_ACCUMULATION)[:rows]
        scales = None
    if quantize_sum:
        q, scale = _pick(backend, residual, "fused").add_and_quantize_rows(
            residual, product, scales, sum_input_weight, _gemm_rows(rows, residual))
        return residual, E4M3Rows(q, scale, rows, dtype)
    if scales is not None:
        return _pick(backend, product, "fp8_gemm").scale_product(product, *scales, residual, dtype)
    return product if residual is None else residual.add_(product)


def fp8_product(x, weight, weight_scale, input_weight=None, backend=None):
    """fp8_matmul's product without a residual, for a kernel that reads it elementwise and applies its scales
    there (the scales of rope_and_write_kv_cache and silu_and_mul): (product, scales). Up to UNIT_SCALE_ROWS rows
    the product is the unit-scale GEMM's, float32 [T, N], and scales = (row_scale [T, 1], weight_scale [N]): the
    scaling kernel is saved. Otherwise fp8_matmul's finished product, and None. x: as fp8_matmul's."""
    if 0 < _count(x) <= UNIT_SCALE_ROWS:
        return _unit_scale_product(x, weight, weight_scale, input_weight, backend)
    return fp8_matmul(x, weight, weight_scale, input_weight, backend=backend), None


def _count(x):
    """The rows of fp8_matmul's x: a tensor's, or E4M3Rows' count."""
    return x.count if isinstance(x, E4M3Rows) else x.shape[0]


def _e4m3_rows(x, input_weight, backend, padded=True):
    """x (a tensor, times input_weight) rounded to e4m3 (E4M3Rows; its rows padded for the row-scaled GEMM
    unless not padded), or x itself if it comes rounded."""
    if isinstance(x, E4M3Rows):
        return x
    rows = _gemm_rows(x.shape[0], x) if padded else None
    return E4M3Rows(*quantize_rows_to_e4m3(x, input_weight, rows, backend), x.shape[0], x.dtype)


def _unit_scale_product(x, weight, weight_scale, input_weight, backend):
    """(the float32 product of x's quantized rows and weight, unit scales, (x's row scales, weight_scale))."""
    x = _e4m3_rows(x, input_weight, backend, padded=False)
    q, scale = x.q[:x.count], x.scale[:x.count]
    one = _unit_scale(q.device)
    return torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32), (scale, weight_scale)


def moe_route(router_logits, top_k: int, renormalize: bool, backend=None):
    """A mixture-of-experts layer's routing: (weights float32 [T, k], expert ids int64 [T, k]) of the router's
    logits [T, E] (ops/moe_reference.py; Triton: ops/moe.py, one kernel)."""
    return _pick(backend, router_logits, "moe").moe_route(router_logits, top_k, renormalize)


def moe_experts(x, gate_up, down, weights, ids, backend=None):
    """The routed experts' SwiGLU MLPs, weighted and summed per token: x [T, H], gate_up [E, 2I, H], down
    [E, H, I], weights [T, k], ids int64 [T, k] -> [T, H] (ops/moe_reference.py; Triton: ops/moe.py, two
    grouped GEMMs over the pairs sorted by expert, nothing waiting for the host)."""
    return _pick(backend, x, "moe").moe_experts(x, gate_up, down, weights, ids)


def moe_compile_launches(gate_up, down, top_k: int, max_tokens: int, backend=None) -> int:
    """Compile, before a run, every launch of the Triton experts that a step of up to max_tokens tokens can
    pick (ops/moe.py compile_launches); returns how many ran (0 for the reference, which compiles nothing)."""
    return _pick(backend, gate_up, "moe").compile_launches(gate_up, down, top_k, max_tokens)

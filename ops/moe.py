"""The Triton versions of ops/moe_reference.py: the routing in one kernel, the routed experts as two grouped GEMMs.

    moe_route(router_logits[T, E], top_k, renormalize) -> (weights float32 [T, k], ids int64 [T, k])
    moe_experts(x[T, H], gate_up[E, 2I, H], down[E, H, I], weights[T, k], ids[T, k]) -> [T, H]

The T * k (token, expert) pairs are grouped by expert and each expert's run is padded to a multiple of BLOCK_M
(sorted_pairs: one program at decode sizes, a fill and three small kernels above, on the device, sized by the bound
T * k + E * (BLOCK_M - 1), so nothing waits for the host and the grids depend only on T, k and E). Each program of
the first kernel takes one block of BLOCK_M pairs of one expert and BLOCK_N columns of its intermediate: it gathers
the pairs' token rows of x, multiplies them by that expert's gate and up rows over H, and writes silu(gate) * up in
x's dtype ([P, I], by sorted row, so that the second kernel reads a block's rows as one box). The second kernel
multiplies those rows by the expert's down projection and scales each by its pair's weight ([T * k, H], by pair);
the k rows of a token are summed after. The weights (and the second kernel's rows) are read in TMA boxes (tensor
descriptors). A block past the last expert's run (expert -1) does nothing; an expert no token picks has no block, so
its weights are never read.

Which tiles: moe_launch(T, ...) reads the table that benchmarks/moe_op.py --save measured for the shape, the
dtype and the device (ops/moe_tuned/<key>.json: the fastest launch at each token count it swept; the
nearest swept count is taken, as vLLM's tuned fused-MoE configs are), and DEFAULT_LAUNCH without one.
"""
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ops.paged_attention import dot_precision


def sorted_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """(pair index per padded row int64 [P] (-1: padding), expert per block int64 [P // block_m] (-1: none))
    for ids [T, k]: the pairs t * k + j grouped by expert, in expert order, each expert's run padded to a
    multiple of block_m (its pairs in no set order: each pair's row of the product is its own);
    P = the bound T * k + E * (block_m - 1), rounded up to block_m. Nothing on the host. Up to ONE_PROGRAM_PAIRS
    pairs (decode steps) one program does it all: fill, histogram, the runs' layout, each pair's place; above,
    a fill of -1 and three kernels over the device (the histogram, the layout in one program, the places)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    rows = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    expert_of_block = torch.empty(rows // block_m, dtype=torch.int64, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    if pairs <= ONE_PROGRAM_PAIRS:
        pair_of_row = torch.empty(rows, dtype=torch.int64, device=ids.device)
        _one_program_kernel[(1,)](flat, counts, cursor, pair_of_row, expert_of_block, pairs, num_experts, rows,
                                  block_m, BLOCK_P=ONE_PROGRAM_PAIRS, BLOCK_E=block_e,
                                  BLOCK_ROWS=1024, BLOCK_BLOCKS=64, num_warps=8)
        return pair_of_row, expert_of_block
    counts.zero_()
    pair_of_row = torch.full((rows,), -1, dtype=torch.int64, device=ids.device)  # the whole device fills it
    grid = (triton.cdiv(pairs, _PAIRS_PER_PROGRAM),)
    _count_kernel[grid](flat, counts, pairs, BLOCK=_PAIRS_PER_PROGRAM)
    _layout_kernel[(1,)](counts, cursor, expert_of_block, num_experts, rows, block_m, BLOCK_E=block_e,
                         BLOCK_BLOCKS=64)
    _place_kernel[grid](flat, cursor, pair_of_row, pairs, BLOCK=_PAIRS_PER_PROGRAM)
    return pair_of_row, expert_of_block


_PAIRS_PER_PROGRAM = 1024
# Pairs that one program lays out (256 tokens of top 8): its four steps cost less than four launches there. One
# block of them whatever the count: one variant to compile
ONE_PROGRAM_PAIRS = 2048


@triton.jit(do_not_specialize=["pairs"])  # T * k: one variant whatever its divisibility (NOTES, session 35)
def _count_kernel(ids_ptr, counts_ptr, pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < pairs
    expert = tl.load(ids_ptr + offs, mask=live, other=0)
    tl.atomic_add(counts_ptr + expert, tl.full([BLOCK], 1, tl.int32), mask=live)


@triton.jit
def _lay_out_runs(counts_ptr, cursor_ptr, expert_ptr, num_experts, rows, block_m,
                  BLOCK_E: tl.constexpr, BLOCK_BLOCKS: tl.constexpr):
    """Each expert's padded run start (the cursor its pairs are placed from) and each block's expert: the number
    of runs that end at or before the block's start (-1 past the last). The counts are read from L2 (.cg): in
    the one-program kernel they are atomics' results of the same program."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0, cache_modifier=".cg")
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, run_end - padded, mask=experts < num_experts)
    run_end = tl.where(experts < num_experts, run_end, 1 << 30)
    for first in range(0, rows // block_m, BLOCK_BLOCKS):
        blocks = first + tl.arange(0, BLOCK_BLOCKS)
        ended = tl.sum((run_end[None, :] <= (blocks * block_m)[:, None]).to(tl.int32), 1)
        expert = tl.where(ended < num_experts, ended, -1)
        tl.store(expert_ptr + blocks, expert.to(tl.int64), mask=blocks < rows // block_m)


@triton.jit
def _layout_kernel(counts_ptr, cursor_ptr, expert_ptr, num_experts, rows, block_m,
                   BLOCK_E: tl.constexpr, BLOCK_BLOCKS: tl.constexpr):
    _lay_out_runs(counts_ptr, cursor_ptr, expert_ptr, num_experts, rows, block_m, BLOCK_E, BLOCK_BLOCKS)


@triton.jit(do_not_specialize=["pairs", "rows"])
def _one_program_kernel(ids_ptr, counts_ptr, cursor_ptr, pair_ptr, expert_ptr, pairs, num_experts, rows, block_m,
                        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_BLOCKS: tl.constexpr):
    """sorted_pairs of up to BLOCK_P pairs in one program: every row -1 and every count 0, then (after a barrier,
    which orders the threads' global writes) the histogram, the layout, each pair's place, as the three kernels."""
    experts = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + experts, tl.zeros([BLOCK_E], tl.int32), mask=experts < num_experts)
    for first in range(0, rows, BLOCK_ROWS):
        row = first + tl.arange(0, BLOCK_ROWS)
        tl.store(pair_ptr + row, tl.full([BLOCK_ROWS], -1, tl.int64), mask=row < rows)
    offs = tl.arange(0, BLOCK_P)
    live = offs < pairs
    expert = tl.load(ids_ptr + offs, mask=live, other=0)
    tl.debug_barrier()
    tl.atomic_add(counts_ptr + expert, tl.full([BLOCK_P], 1, tl.int32), mask=live)
    tl.debug_barrier()
    _lay_out_runs(counts_ptr, cursor_ptr, expert_ptr, num_experts, rows, block_m, BLOCK_E, BLOCK_BLOCKS)
    tl.debug_barrier()
    row = tl.atomic_add(cursor_ptr + expert, tl.full([BLOCK_P], 1, tl.int32), mask=live)
    tl.store(pair_ptr + row, offs.to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["pairs"])
def _place_kernel(ids_ptr, cursor_ptr, pair_ptr, pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < pairs
    expert = tl.load(ids_ptr + offs, mask=live, other=0)
    row = tl.atomic_add(cursor_ptr + expert, tl.full([BLOCK], 1, tl.int32), mask=live)
    tl.store(pair_ptr + row, offs.to(tl.int64), mask=live)


@triton.jit
def _program_tile(num_blocks, num_col_tiles, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program. GROUP_M 0: a 2D grid's (program_id 0, program_id 1), the
    row blocks of a column tile next to each other. GROUP_M > 0: a 1D grid walked GROUP_M row blocks at a
    time, every column tile of a group before the next group, so that the programs in flight share their
    rows of the input and their expert's weights in L2 (the grouped order of Triton's matmul tutorial)."""
    if GROUP_M == 0:
        return tl.program_id(0), tl.program_id(1)
    pid = tl.program_id(0)
    per_group = GROUP_M * num_col_tiles
    first = pid // per_group * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + pid % per_group % size, pid % per_group // size


@triton.jit
def _block_tile(pair_ptr, block, col_tile, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's tile: the pairs of row block `block` (BLOCK_M sorted rows; -1: padding; live marks the
    others) and the BLOCK_N output columns of `col_tile` (col_mask: those < num_cols)."""
    pair = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair >= 0, cols, cols < num_cols


@triton.jit(do_not_specialize=["num_blocks"])  # it follows T: one variant a launch, compiled before a run
def _gate_up_kernel(x_ptr, w_desc, out_ptr, pair_ptr, expert_ptr, top_k, H, I, s_xt, s_ot, num_blocks, num_col_tiles,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """w_desc: gate_up as [E * 2I, H] in [BLOCK_N, BLOCK_K] boxes (a box past an expert's gate or up rows
    reads the next rows: they feed only output columns >= I, which are not stored). Writes the block's rows
    of out [P, I] in the sorted order (a padding row: nothing)."""
    block, col_tile = _program_tile(num_blocks, num_col_tiles, GROUP_M)
    expert = tl.load(expert_ptr + block).to(tl.int32)  # a box's coordinates are 32-bit
    if expert < 0:
        return
    pair, live, cols, col_mask = _block_tile(pair_ptr, block, col_tile, I, BLOCK_M, BLOCK_N)
    token = tl.where(live, pair // top_k, 0)
    gate_row = expert * 2 * I + col_tile * BLOCK_N
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + token[:, None].to(tl.int64) * s_xt + ks[None, :], mask=live[:, None] & (ks < H)[None, :],
                    other=0.0)
        g = w_desc.load([gate_row, k0])
        u = w_desc.load([gate_row + I, k0])
        if UPCAST:  # the interpreter's 16-bit tl.dot is wrong (Triton 3.9)
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        gate = tl.dot(a, g.T, gate, input_precision=DOT_PREC)
        up = tl.dot(a, u.T, up, input_precision=DOT_PREC)
    dt = out_ptr.dtype.element_ty
    gate, up = gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32)  # the reference's roundings
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * s_ot + cols[None, :], (act * up).to(dt),
             mask=live[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_blocks"])
def _down_kernel(h_desc, w_desc, weight_ptr, out_ptr, pair_ptr, expert_ptr, H, I, s_ot, num_blocks, num_col_tiles,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """h_desc: the gate/up kernel's out [P, I] in [BLOCK_M, BLOCK_K] boxes (a padding row holds anything: it
    feeds only its own output row, which is not stored); w_desc: down as [E * H, I] in [BLOCK_N, BLOCK_K]
    boxes. Writes each live pair's row of out [T * k, H], scaled by its weight."""
    block, col_tile = _program_tile(num_blocks, num_col_tiles, GROUP_M)
    expert = tl.load(expert_ptr + block).to(tl.int32)  # a box's coordinates are 32-bit
    if expert < 0:
        return
    pair, live, cols, col_mask = _block_tile(pair_ptr, block, col_tile, H, BLOCK_M, BLOCK_N)
    safe = tl.where(live, pair, 0).to(tl.int64)
    w_row = expert * H + col_tile * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = h_desc.load([block * BLOCK_M, k0])
        b = w_desc.load([w_row, k0])
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=DOT_PREC)
    dt = out_ptr.dtype.element_ty
    scale = tl.load(weight_ptr + safe, mask=live, other=0.0).to(dt).to(tl.float32)
    rows_out = acc.to(dt).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + safe[:, None] * s_ot + cols[None, :], rows_out.to(dt), mask=live[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch: BLOCK_N output columns, BLOCK_K of the reduction a step, its warps and stages,
    and the programs' order (group_m: _program_tile's GROUP_M; 0, the row blocks of a column tile together)."""

    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3  # Triton's own default on CUDA, which the measured figures ran with
    group_m: int = 0


DEFAULT_TILES = Tiles()


@dataclass(frozen=True)
class Launch:
    """The experts op's launch: block_m pairs of one expert a program takes, and each kernel's tiles."""

    block_m: int = 16
    gate_up: Tiles = DEFAULT_TILES
    down: Tiles = DEFAULT_TILES

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict) -> "Launch":
        return cls(fields["block_m"], Tiles(**fields["gate_up"]), Tiles(**fields["down"]))


DEFAULT_LAUNCH = Launch()
TUNED_DIR = Path(__file__).with_name("moe_tuned")


@functools.cache
def tuned_key(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, device: torch.device) -> str:
    """The tuned table's file stem for a shape, a dtype and a device (its CUDA name, spaces as _)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"E{num_experts}_I{inter}_H{hidden}_{str(dtype).removeprefix('torch.')}_{name.replace(' ', '_')}"


@functools.cache
def _tuned_table(key: str) -> dict[int, Launch]:
    path = TUNED_DIR / f"{key}.json"
    if not path.exists():
        return {}
    return {int(tokens): Launch.from_json(fields) for tokens, fields in json.loads(path.read_text()).items()}


def moe_launch(tokens: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
               device: torch.device) -> Launch:
    """The measured launch for `tokens` tokens (that of the nearest token count swept), else DEFAULT_LAUNCH."""
    table = _tuned_table(tuned_key(num_experts, inter, hidden, dtype, device))
    if not table:
        return DEFAULT_LAUNCH
    return table[min(table, key=lambda swept: (abs(swept - tokens), swept))]


def compile_launches(gate_up: torch.Tensor, down: torch.Tensor, top_k: int, max_tokens: int) -> int:
    """Run the op once, on zeros, for each launch that moe_launch picks for a step of 1..max_tokens tokens
    (at the smallest count picking it), so that every one is compiled before a run (a compilation inside one
    stalled its step by ~1 s: benchmarks/NOTES.md, session 35); returns the launches run. The nearest swept
    count picks, so the counts to try are the swept ones up to max_tokens and max_tokens itself. Each token's
    k experts are distinct and the tokens spread over all of them."""
    num_experts, two_i, hidden = gate_up.shape
    inter, dtype, device = two_i // 2, gate_up.dtype, gate_up.device
    swept = _tuned_table(tuned_key(num_experts, inter, hidden, dtype, device))
    runs = {}
    for tokens in sorted({t for t in swept if t <= max_tokens} | ({max_tokens} if swept else set())):
        runs.setdefault(moe_launch(tokens, num_experts, inter, hidden, dtype, device), tokens)
    for tokens in runs.values():
        x = torch.zeros(tokens, hidden, dtype=gate_up.dtype, device=gate_up.device)
        ids = torch.arange(tokens, device=x.device)[:, None] * top_k + torch.arange(top_k, device=x.device)
        ids %= num_experts
        moe_experts(x, gate_up, down, torch.full((tokens, top_k), 1 / top_k, device=x.device), ids)
    return len(runs)


def moe_route(router_logits, top_k: int, renormalize: bool):
    """ops/moe_reference.moe_route in one kernel: each program takes BLOCK_T tokens' logits, their softmax in
    float32, and picks the top_k largest one after another (the lower id on a tie, as the contract says; torch.topk
    on CUDA orders ties otherwise)."""
    T, num_experts = router_logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        block_e = triton.next_power_of_2(num_experts)
        block_t = max(1, min(16, 2048 // block_e))  # ~16 values a thread of 4 warps
        _route_kernel[(triton.cdiv(T, block_t),)](
            logits, weights, ids, T, num_experts, logits.stride(0), K=top_k, RENORMALIZE=renormalize,
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, num_experts, s_lt, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * s_lt + experts[None, :],
                mask=(rows < T)[:, None] & real[None, :], other=0.0).to(tl.float32)
    x = tl.where(real[None, :], x, float("-inf"))  # a row past T stays finite: no NaN below
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    left = tl.where(real[None, :], p, -1.0)  # -1: picked, or no expert
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        value, best = tl.max(left, 1, return_indices=True, return_indices_tie_break_left=True)
        top_w = tl.where(slots[None, :] == j, value[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, best[:, None].to(tl.int64), top_i)
        left = tl.where(experts[None, :] == best[:, None], -1.0, left)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    out = rows[:, None].to(tl.int64) * K + slots[None, :]
    mask = (rows < T)[:, None] & (slots < K)[None, :]
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


def moe_experts(x, gate_up, down, weights, ids, block_m: int | None = None, gate_up_tiles: Tiles | None = None,
                down_tiles: Tiles | None = None):
    """block_m: the pairs of one expert a program takes; the tiles of each kernel (each None: moe_launch's).
    A tile wider than its matrix is narrowed to it (16 at least, for tl.dot)."""
    T, H = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter, k = two_i // 2, ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    tuned = moe_launch(T, num_experts, inter, H, x.dtype, x.device)
    block_m = block_m or tuned.block_m
    gate_up_tiles, down_tiles = gate_up_tiles or tuned.gate_up, down_tiles or tuned.down
    pair_of_row, expert_of_block = sorted_pairs(ids, num_experts, block_m)
    hidden = torch.empty((pair_of_row.numel(), inter), dtype=x.dtype, device=x.device)  # by sorted row
    per_pair = torch.empty((T * k, H), dtype=x.dtype, device=x.device)  # every pair's row is written
    upcast, precision = not x.is_cuda, dot_precision(x.dtype)  # float32: exact products, not TF32
    x = x.contiguous()
    blocks = expert_of_block.numel()
    n, kk = _fitted(gate_up_tiles, inter, H)
    col_tiles = triton.cdiv(inter, n)
    _gate_up_kernel[_grid(blocks, col_tiles, gate_up_tiles)](
        x, _boxes(gate_up, n, kk), hidden, pair_of_row, expert_of_block, k, H, inter, x.stride(0), hidden.stride(0),
        blocks, col_tiles, BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=kk, GROUP_M=gate_up_tiles.group_m,
        UPCAST=upcast, DOT_PREC=precision, num_warps=gate_up_tiles.num_warps, num_stages=gate_up_tiles.num_stages)
    n, kk = _fitted(down_tiles, H, inter)
    col_tiles = triton.cdiv(H, n)
    _down_kernel[_grid(blocks, col_tiles, down_tiles)](
        TensorDescriptor.from_tensor(hidden, [block_m, kk]), _boxes(down, n, kk), weights.reshape(-1).contiguous(),
        per_pair, pair_of_row, expert_of_block, H, inter, per_pair.stride(0), blocks, col_tiles,
        BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=kk, GROUP_M=down_tiles.group_m, UPCAST=upcast, DOT_PREC=precision,
        num_warps=down_tiles.num_warps, num_stages=down_tiles.num_stages)
    return per_pair.view(T, k, H).sum(dim=1)


def _boxes(weights: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """A TMA descriptor of stacked expert weights [E, R, C] as one [E * R, C] matrix in [rows, cols] boxes."""
    if not weights.is_contiguous() or weights.shape[2] * weights.element_size() % 16:
        raise ValueError(f"the experts' weights {tuple(weights.shape)} {weights.dtype}: TMA boxes need them contiguous "
                         f"and rows of a multiple of 16 bytes")
    return TensorDescriptor.from_tensor(weights.flatten(0, 1), [rows, cols])


def _grid(blocks: int, col_tiles: int, tiles: Tiles) -> tuple[int, ...]:
    """The launch grid of _program_tile's order for tiles.group_m."""
    return (blocks * col_tiles,) if tiles.group_m else (blocks, col_tiles)


def _fitted(tiles: Tiles, cols: int, depth: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of tiles for a kernel of `cols` output columns over a reduction of `depth`."""
    return (min(tiles.block_n, triton.next_power_of_2(max(cols, 16))),
            min(tiles.block_k, triton.next_power_of_2(max(depth, 16))))

"""CUDA graphs: of the decode forward and its logits, one per batch-size bucket (DecodeGraphs), with a graph
of the draw from those logits per bucket size; and of the forward of a step with prompt chunks, cut at its
attention calls (PiecewiseGraphs).

A decode step copies its inputs into static buffers, pads the batch up to the smallest bucket that
holds it (padding rows: slot -1, so nothing is written, seq_len 0, so nothing is read, and last in
decode_order) and replays that bucket's graph, which ends with the logits of every row (a decode row is
its sequence's last, and each draws). block_tables are as wide as max_model_len needs, so a graph never
depends on the batch's current lengths. With a CascadePolicy, buckets of at least its min_step_rows also
get a cascade graph, for steps whose decode rows share prefixes: its static group buffers hold max_entries
groups, the step's groups followed by empty ones (cu_group_rows repeats its last value, prefix 0), its
static plan the prefix pass's work list in its first rows (the op reads only as many as the first counts),
and the bucket's padding rows come after every group. A step whose rows all draw from those logits as they
are, at a temperature with no truncation (the Gumbel-max sampler: no processor, mask, fork or truncation),
copies the sampling fields into the draw graph's buffers and replays it: the host launches two graphs
instead of the head's matmul and the sampler's kernels (host-bound steps of small models:
benchmarks/NOTES.md).

A step with prompt chunks has lengths, chunks and groups of its own, so its attention (the kernels'
grids and metadata) cannot be a graph's; everything else in it depends only on its token count. The
model declares its forward as num_layers + 1 pieces cut at the attention calls (engine/models/decoder.py),
each piece here a graph per token-count bucket, and the step replays piece 0, runs layer 0's attention
eagerly, replays piece 1, and so on: ~10 launches a layer become ~3. The tokens past the step's own, up
to the bucket, are padding (StaticInputs): rows are independent outside attention, and attention never
reads them.
"""
import time

import torch

import ops
from engine.attention import AttentionMetadata, CascadeMetadata
from engine.kernel_compiles import CompilePool
from engine.models.decoder import ForwardState
from engine.prefix_groups import CascadePolicy
from ops.cascade import WORK_FIELDS


class StaticInputs:
    """A graph's token inputs [max_rows]: ids, positions and cache slots. A step's rows are copied to the
    front; the rows after them, up to the bucket, get slot -1 (nothing written) and keep ids and positions
    of an earlier step (valid ones: zeros at first)."""

    def __init__(self, max_rows: int, device):
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int32, device=device)

    def stage(self, input_ids, positions, slot_mapping, size: int) -> None:
        rows = input_ids.shape[0]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[rows:size].fill_(-1)


def smallest_bucket(buckets: list[int], rows: int) -> int | None:
    """The first of the ascending buckets that holds `rows`, None when none does."""
    return next((b for b in buckets if b >= rows), None)


# Decode buckets are multiples of 16 up to this many rows and of 64 above: a larger step pads at most 63 rows, which
# cost only GEMM rows (their attention reads nothing), and 1,024 rows take 8 graphs more than 512 instead of 32
COARSE_BUCKETS_FROM = 512


def bucket_sizes(max_batch: int) -> list[int]:
    """The decode graphs' batch sizes, ascending: 1, 2, 4, 8, the multiples of 16 up to COARSE_BUCKETS_FROM, those
    of 64 above it, then max_batch."""
    sizes = [1, 2, 4, 8, *range(16, COARSE_BUCKETS_FROM + 1, 16), *range(COARSE_BUCKETS_FROM + 64, max_batch, 64)]
    return [b for b in sizes if b < max_batch] + [max_batch]


def copy_groups(static: CascadeMetadata, groups: CascadeMetadata) -> None:
    """Write a step's G groups into static buffers of E >= G groups, padded with empty groups, and its
    plan into the first rows of the static plan, whose first row counts the items (device copies only)."""
    num_groups, cu = groups.group_prefix_lens.shape[0], static.cu_group_rows
    cu[:num_groups + 1].copy_(groups.cu_group_rows, non_blocking=True)
    cu[num_groups + 1:].copy_(groups.cu_group_rows[-1:].expand(cu.shape[0] - num_groups - 1))
    static.group_prefix_lens[:num_groups].copy_(groups.group_prefix_lens, non_blocking=True)
    static.group_prefix_lens[num_groups:].zero_()
    static.plan[:groups.plan.shape[0]].copy_(groups.plan, non_blocking=True)


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int, device,
                 cascade: CascadePolicy | None = None, compiles: CompilePool | None = None):
        """compiles: a dry pass of every graph's forward first, so that their kernels compile side by side
        (engine/kernel_compiles.py); None: each compiles at its capture's warm-up call."""
        self.model, self.kv_cache = model, kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.inputs = StaticInputs(max_batch, device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int32, device=device)  # padding rows keep their place
        self.decode_order = self.rows.clone()
        keys = [(size, False) for size in self.buckets]
        if cascade is not None:
            entries = cascade.max_entries
            self.groups = CascadeMetadata(
                torch.zeros(entries + 1, dtype=torch.int32, device=device),
                torch.zeros(entries, dtype=torch.int32, device=device),
                torch.zeros(1 + cascade.prefix_pass.max_items(max_batch, entries), WORK_FIELDS, dtype=torch.int32,
                            device=device))
            keys += [(size, True) for size in self.buckets if size >= cascade.min_step_rows]
        # every bucket's logits, in one buffer (a bucket's own output would hold its rows x vocab for good)
        self.logits_out = torch.empty(max_batch, model.arch.vocab_size, dtype=model.dtype, device=device)
        # the draw graphs' inputs: each row's temperature, seed and output index (SamplingTensors')
        self.temperature = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.step = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.graphs, self.draws, self.tokens = {}, {}, {}  # draws and tokens by bucket size: a cascade twin shares
        self._last: tuple[int, torch.Tensor] | None = None  # the last run's bucket size and logits view
        if compiles is not None:
            with compiles.ahead():
                for key in keys:
                    self._forward(*key)
                for size in self.buckets:
                    self._draw(size)
        pools = {"forward": None, "draw": None}  # largest first, so the smaller ones reuse the largest's pool
        for key in sorted(keys, reverse=True):
            self.graphs[key], _ = self._captured(lambda: self._forward(*key), pools, "forward")
        for size in sorted(self.buckets, reverse=True):
            self.draws[size], self.tokens[size] = self._captured(lambda: self._draw(size), pools, "draw")
        torch.cuda.synchronize()

    @staticmethod
    def _captured(fn, pools: dict, name: str) -> "tuple[torch.cuda.CUDAGraph, torch.Tensor]":
        """fn's graph in pools[name] (the first capture makes it) and its output; a warm-up call before
        compiles kernels and sizes the allocator outside the capture."""
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pools[name]):
            out = fn()
        pools[name] = pools[name] or graph.pool()
        return graph, out

    def _forward(self, size: int, cascade: bool) -> torch.Tensor:
        meta = AttentionMetadata(self.inputs.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 cascade=self.groups if cascade else None,
                                 decode_order=None if cascade else self.decode_order[:size])
        hidden = self.model(self.inputs.input_ids[:size], self.inputs.positions[:size], self.kv_cache, meta)
        return self.model.compute_logits(hidden, out=self.logits_out[:size])

    def _draw(self, size: int) -> torch.Tensor:
        return ops.gumbel_sample(self.logits_out[:size], self.temperature[:size], self.seed[:size], self.step[:size])

    def fits(self, batch_size: int, cascade: bool = False) -> bool:
        """Whether a graph runs a decode batch of this size (with shared-prefix groups: cascade)."""
        return (smallest_bucket(self.buckets, batch_size), cascade) in self.graphs

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode batch that fits (meta.cascade: its graph): a view of the buffer that
        every bucket writes, valid until the next run."""
        batch = input_ids.shape[0]
        key = (smallest_bucket(self.buckets, batch), meta.cascade is not None)
        size = key[0]
        self.inputs.stage(input_ids, positions, meta.slot_mapping, size)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:size].zero_()
        self.block_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if meta.decode_order is not None:  # a cascade graph does not read it
            self.decode_order[:batch].copy_(meta.decode_order, non_blocking=True)
            self.decode_order[batch:size].copy_(self.rows[batch:size])
        if meta.cascade is not None:
            copy_groups(self.groups, meta.cascade)
        self.graphs[key].replay()
        logits = self.logits_out[:batch]
        self._last = size, logits
        return logits

    def draw(self, logits: torch.Tensor, temperature, seed, step) -> torch.Tensor | None:
        """Tokens int64 [B] drawn by the Gumbel-max sampler (ops.gumbel_sample) from the logits of the last run,
        which must be the very tensor it returned (not a copy, a selection or a processed version), with
        float32 temperature [B] and int64 seed and step [B]; None for any other logits. The tokens are a
        copy: the graph's own are overwritten by the next draw."""
        if self._last is None or logits is not self._last[1]:
            return None
        size, batch = self._last[0], logits.shape[0]
        for static, values in ((self.temperature, temperature), (self.seed, seed), (self.step, step)):
            static[:batch].copy_(values, non_blocking=True)
        self.draws[size].replay()
        return self.tokens[size][:batch].clone()


PIECE_BUCKETS = 64  # at most about this many multiples of the step, so that capture time stays bounded
# Steps of more tokens run eagerly: their kernels outlast their launches, so a graph gains nothing there,
# and each bucket costs ~37 ms of start-up (29 pieces on the 0.6B shape; benchmarks/NOTES.md, session 24)
PIECE_MAX_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts with a piecewise graph: the powers of two from 16 below a step, then every multiple of
    the step (256, or the power of two that keeps the multiples to PIECE_BUCKETS), then max_tokens."""
    step = max(256, 1 << (-(-max_tokens // PIECE_BUCKETS) - 1).bit_length())
    small = [1 << k for k in range(4, step.bit_length() - 1)]
    return [t for t in small + list(range(step, max_tokens, step)) if t < max_tokens] + [max_tokens]


class PiecewiseGraphs:
    """The forward of steps with prompt chunks of up to max_tokens tokens, as graphs of the pieces between
    attention calls (see the module's docstring). Static buffers, sliced to a bucket's first rows: the
    inputs (StaticInputs), the rotated q and the attention output [max_tokens, Hq, D] (shared by every layer:
    a layer's attention reads q and writes its output between two pieces) and the final hidden states.
    The residual stream passes from one piece to the next in the graphs' pool (self.state holds it between
    them); pieces are captured and replayed in the same order, so the pool's reuse during capture is right
    during replay. capture=False runs the same pieces eagerly (the CPU, where there are no graphs: the tests
    check the cut there)."""

    @torch.inference_mode()
    def __init__(self, model, kv_cache, max_tokens: int, device, capture: bool = True,
                 compiles: CompilePool | None = None):
        """compiles: as DecodeGraphs'."""
        self.model, self.kv_cache = model, kv_cache
        arch = model.arch
        self.buckets = token_buckets(max_tokens)
        self.inputs = StaticInputs(max_tokens, device)
        self.q = torch.zeros(max_tokens, arch.num_attention_heads, arch.head_dim, dtype=model.dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.hidden = torch.zeros(max_tokens, arch.hidden_size, dtype=model.dtype, device=device)
        self.state: ForwardState | None = None  # a forward's, between two of its pieces
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] | None = None
        start = time.perf_counter()
        if capture and compiles is not None:
            with compiles.ahead():
                for size in self.buckets:
                    self._pieces(size)
        if capture:
            self.graphs, pool = {}, None
            for size in reversed(self.buckets):  # largest first, so the smaller ones reuse its pool
                self.graphs[size], pool = self._capture(size, pool)
            torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start

    def _capture(self, size: int, pool) -> tuple[list, object]:
        """The pieces' graphs at one bucket, in the pool (None: a new one) -> (graphs, the pool)."""
        self._pieces(size)  # warm-up: compiles kernels, sizes the allocator outside the capture
        graphs = []
        for piece in range(self.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._piece(piece, size)
            pool = pool or graph.pool()
            graphs.append(graph)
        return graphs, pool

    def _pieces(self, size: int) -> None:
        """Every piece at one bucket, eagerly."""
        for piece in range(self.num_pieces):
            self._piece(piece, size)

    @property
    def num_pieces(self) -> int:
        return self.model.num_pieces

    def _piece(self, piece: int, size: int) -> None:
        """The model's piece `piece` over the buffers' first `size` rows: it reads the static attention output
        and writes the static q; the last one's final hidden states are copied into self.hidden."""
        if piece == 0:
            inputs = self.inputs
            self.state = ForwardState(inputs.input_ids[:size], inputs.positions[:size], inputs.slot_mapping[:size],
                                      q_out=self.q[:size])
        else:
            self.state.attn_out = self.attn_out[:size].flatten(1)
        self.model.piece(piece, self.state, self.kv_cache)
        if piece == self.num_pieces - 1:
            self.hidden[:size].copy_(self.state.hidden)
            self.state = None

    def fits(self, num_tokens: int) -> bool:
        return smallest_bucket(self.buckets, num_tokens) is not None

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of a step of T <= max_tokens tokens (a view of a static buffer,
        valid until the next run)."""
        num_tokens = input_ids.shape[0]
        size = smallest_bucket(self.buckets, num_tokens)
        self.inputs.stage(input_ids, positions, meta.slot_mapping, size)
        q, out, last = self.q[:num_tokens], self.attn_out[:num_tokens], self.num_pieces - 1
        for piece in range(self.num_pieces):
            if self.graphs is None:
                self._piece(piece, size)
            else:
                self.graphs[size][piece].replay()
            if piece < last:
                self.model.attend(piece, q, self.kv_cache, meta, out=out)
        return self.hidden[:num_tokens]

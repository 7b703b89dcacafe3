"""CUDA graphs of the decode forward, one per batch-size bucket, sharing one memory pool.

A decode step copies its inputs into static buffers, pads the batch up to the smallest bucket that
holds it (padding rows: slot -1, so nothing is written, seq_len 0, so nothing is read, and last in
decode_order) and replays that bucket's graph. block_tables are as wide as max_model_len needs, so a
graph never depends on the batch's current lengths. With a CascadePolicy, buckets of at least its
min_rows also get a cascade graph, for steps whose decode rows share prefixes: its static group buffers
hold max_entries groups, the step's groups followed by empty ones (cu_group_rows repeats its last value,
prefix 0), and the bucket's padding rows come after every group.
"""
import torch

from engine.attention import AttentionMetadata, CascadeMetadata
from engine.prefix_groups import CascadePolicy


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def copy_groups(static: CascadeMetadata, groups: CascadeMetadata) -> None:
    """Write a step's G groups into static buffers of E >= G groups, padded with empty groups (device
    copies only)."""
    num_groups, cu = groups.group_prefix_lens.shape[0], static.cu_group_rows
    cu[:num_groups + 1].copy_(groups.cu_group_rows, non_blocking=True)
    cu[num_groups + 1:].copy_(groups.cu_group_rows[-1:].expand(cu.shape[0] - num_groups - 1))
    static.group_prefix_lens[:num_groups].copy_(groups.group_prefix_lens, non_blocking=True)
    static.group_prefix_lens[num_groups:].zero_()


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int, device,
                 cascade: CascadePolicy | None = None):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int32, device=device)  # padding rows keep their place
        self.decode_order = self.rows.clone()
        keys = [(size, False) for size in self.buckets]
        if cascade is not None:
            entries = cascade.max_entries
            self.groups = CascadeMetadata(torch.zeros(entries + 1, dtype=torch.int32, device=device),
                                          torch.zeros(entries, dtype=torch.int32, device=device))
            keys += [(size, True) for size in self.buckets if size >= cascade.min_rows]
        self.graphs, self.outputs = {}, {}
        pool = None
        for key in sorted(keys, reverse=True):  # largest first, so the smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            self._forward(*key)  # warm-up: compiles kernels, sizes the allocator outside the capture
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            pool = pool or graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def _forward(self, size: int, cascade: bool) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 cascade=self.groups if cascade else None,
                                 decode_order=None if cascade else self.decode_order[:size])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)

    def _bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def fits(self, batch_size: int, cascade: bool = False) -> bool:
        """Whether a graph runs a decode batch of this size (with shared-prefix groups: cascade)."""
        return (self._bucket(batch_size), cascade) in self.graphs

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [B, hidden] of a decode batch that fits (meta.cascade: its graph)."""
        batch = input_ids.shape[0]
        key = (self._bucket(batch), meta.cascade is not None)
        size = key[0]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:size].zero_()
        self.block_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if meta.decode_order is not None:  # a cascade graph does not read it
            self.decode_order[:batch].copy_(meta.decode_order, non_blocking=True)
            self.decode_order[batch:size].copy_(self.rows[batch:size])
        if meta.cascade is not None:
            copy_groups(self.groups, meta.cascade)
        self.graphs[key].replay()
        return self.outputs[key][:batch]

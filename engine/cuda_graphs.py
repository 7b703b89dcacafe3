"""CUDA graphs of the decode forward, one per batch-size bucket, sharing one memory pool.

A decode step copies its inputs into static buffers, pads the batch up to the smallest bucket that
holds it (padding rows: slot -1, so nothing is written, and seq_len 0, so nothing is read) and
replays that bucket's graph. block_tables are as wide as max_model_len needs, so a graph never
depends on the batch's current lengths.
"""
import torch

from engine.attention import AttentionMetadata


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int, device):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs, self.outputs = {}, {}
        pool = None
        for size in reversed(self.buckets):  # largest first, so the smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            self._forward(size)  # warm-up: compiles kernels, sizes the allocator outside the capture
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = pool or graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [B, hidden] of a decode batch of B <= the largest bucket."""
        batch = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:size].zero_()
        self.block_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:batch]

"""One engine step on the data plane: per-step tensors from a ScheduledBatch, the model call, sampling.

Per-step metadata is built on the CPU with numpy (no per-token Python loops) and copied to the device
once per step; every layer reads the same AttentionMetadata.
"""
import numpy as np
import torch

from engine.block_manager import KVBlockManager
from engine.kv_cache import PagedKVCache
from engine.models.qwen3 import AttentionMetadata, Qwen3ForCausalLM
from engine.sampler import SamplingTensors, sample
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, kv_cache: PagedKVCache, block_manager: KVBlockManager, device):
        self.model, self.kv_cache, self.block_manager, self.device = model, kv_cache, block_manager, device

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """input_ids [T], positions [T], attention metadata, and the row of each sequence's last token."""
        starts = np.array([s.num_computed_tokens for s in batch.seqs], dtype=np.int64)
        counts = np.array(batch.num_new_tokens, dtype=np.int64)
        cu_seqlens = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1] - starts, counts)
        token_ids = [s.token_slice(a, a + n) for s, a, n in zip(batch.seqs, starts.tolist(), counts.tolist())]
        input_ids = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=int(cu_seqlens[-1]))
        seq_ids = [s.seq_id for s in batch.seqs]
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=self._to_device(batch.slot_mapping),
            block_tables=self.block_manager.get_block_table_tensor(seq_ids).to(self.device, non_blocking=True),
            seq_lens=self._to_device((starts + counts).astype(np.int32)),
            cu_seqlens_q=self._to_device(cu_seqlens),
            max_seqlen_q=int(counts.max()),
        )
        last_rows = self._to_device(cu_seqlens[1:].astype(np.int64) - 1)
        return self._to_device(input_ids), self._to_device(positions), meta, last_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run the batch; returns one sampled token per sequence (meaningful where its chunk ends its prefill)."""
        input_ids, positions, meta, last_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        logits = self.model.compute_logits(hidden[last_rows])
        params = SamplingTensors.build(
            [s.sampling for s in batch.seqs], [len(s.output_token_ids) for s in batch.seqs],
            self.model.arch.vocab_size, self.device,
        )
        return sample(logits, params).tolist()

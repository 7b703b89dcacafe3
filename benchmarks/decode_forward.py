"""A decode step's forward alone (no lm_head, no sampling), as CUDA graph replays (benchmarks/ops.bench) on
the Qwen3-0.6B shape, with metadata built here rather than by the scheduler, to ask one question at a time:
  lengths     256 rows at equal lengths around a multiple of the decode tile (1024, 1025, 1056, 1088) and
              mixed: what a partly filled last tile costs against its bytes
  placement   the same rows over blocks contiguous per sequence, as the engine allocates them (prompt
              blocks contiguous, decode blocks interleaved), and shuffled: does block placement matter
  streams     the batch whole, as two halves one after the other, and as two halves on two streams (each
              half's latency-bound kernels beside the other's attention)
  write       1-256 rows with and without the rope/K-V write kernel (q passed through unrotated, nothing
              written: wrong outputs, right timing): the most that fusing it into attention could save
  carveout    streams' halves again with cuBLAS held to fewer SMs (torch's SM carveout), so that one half's
              matmuls compute on part of the device while the other half's attention reads K/V on the rest
Usage: [MODEL=qwen3-8b] python3 benchmarks/decode_forward.py [lengths] [placement] [streams] [write] [carveout]
(default: all five)
Results and reasoning: benchmarks/NOTES.md, sessions 12 and 13.
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ops import bench  # noqa: E402
from benchmarks.profile_decode import COPY_BYTES_PER_S, bench_engine  # noqa: E402
from engine.attention import AttentionMetadata, PagedAttention  # noqa: E402


class Bench:
    def __init__(self):
        self.engine = bench_engine("scheduler.max_num_seqs=256", "model.piecewise_graphs=false")
        self.model, self.kv, self.bs = self.engine.model, self.engine.kv_cache, self.engine.block_size
        self.device = self.kv.key_caches[0].device
        self.bytes_per_token = self.kv.bytes / (self.engine.num_blocks * self.bs)

    def meta(self, tables: np.ndarray, lens: np.ndarray) -> tuple[AttentionMetadata, torch.Tensor]:
        """Decode metadata of rows with block tables `tables` and context lengths `lens` -> (meta, positions)."""
        tables = torch.tensor(tables, dtype=torch.int32, device=self.device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        last = seq_lens.long() - 1
        slots = (tables.gather(1, (last // self.bs)[:, None])[:, 0].long() * self.bs + last % self.bs).int()
        order = torch.tensor(np.argsort(-lens, kind="stable"), dtype=torch.int32, device=self.device)
        return AttentionMetadata(slots, tables, seq_lens, decode_order=order), last

    def contiguous(self, lens: np.ndarray) -> np.ndarray:
        """Block tables that give row i the blocks i * width .. (i + 1) * width - 1."""
        width = -(-int(lens.max()) // self.bs)
        return np.arange(len(lens))[:, None] * width + np.arange(width)[None, :]

    def forward_ms(self, lens: np.ndarray, tables: np.ndarray | None = None) -> float:
        meta, positions = self.meta(self.contiguous(lens) if tables is None else tables, lens)
        ids = torch.randint(0, 1000, (len(lens),), device=self.device)
        return bench(lambda: self.model(ids, positions, self.kv, meta), graph=True)

    def floor_ms(self, lens: np.ndarray) -> float:
        return self.bytes_per_token * lens.sum() / COPY_BYTES_PER_S * 1e3


def lengths(b: Bench) -> None:
    rng = np.random.default_rng(0)
    for n, lo, hi in [(256, 1024, 1024), (256, 1025, 1025), (256, 1056, 1056), (256, 1088, 1088), (256, 100, 2000)]:
        lens = rng.integers(lo, hi + 1, n)
        print(f"{n} rows, {lo}-{hi}: {b.forward_ms(lens):.3f} ms (K/V at copy speed {b.floor_ms(lens):.2f})",
              flush=True)


def placement(b: Bench) -> None:
    rng = np.random.default_rng(0)
    n, prompt_blocks = 256, 64
    lens = np.full(n, 1056)
    width = -(-int(lens.max()) // b.bs)
    decode_blocks = n * prompt_blocks + np.arange(width - prompt_blocks)[None, :] * n + np.arange(n)[:, None]
    prompt_tables = b.contiguous(np.full(n, prompt_blocks * b.bs))
    tables = {"contiguous": b.contiguous(lens),
              "as the engine allocates": np.concatenate([prompt_tables, decode_blocks], 1),
              "shuffled within its span": rng.permutation(n * width).reshape(n, width),
              "shuffled over the pool": rng.permutation(b.engine.num_blocks)[: n * width].reshape(n, width)}
    print(f"{n} rows x 1056 tokens: " + ", ".join(f"{k} {b.forward_ms(lens, t):.3f} ms" for k, t in tables.items()),
          flush=True)


def streams(b: Bench, cases=((256, 1024, 1024), (256, 100, 2000), (128, 100, 2000)), label="") -> None:
    rng = np.random.default_rng(0)
    for n, lo, hi in cases:
        lens = rng.integers(lo, hi + 1, n)
        tables = b.contiguous(lens)
        ids = torch.randint(0, 1000, (n,), device=b.device)
        meta, positions = b.meta(tables, lens)
        halves = []  # (ids, positions, meta) of each half
        for rows in (slice(0, n // 2), slice(n // 2, n)):
            half_meta, half_positions = b.meta(tables[rows], lens[rows])
            halves.append((ids[rows], half_positions, half_meta))
        side = torch.cuda.Stream()

        def one_after_the_other():
            for i, p, m in halves:
                b.model(i, p, b.kv, m)

        def side_by_side():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            b.model(*halves[0][:2], b.kv, halves[0][2])
            with torch.cuda.stream(side):
                b.model(*halves[1][:2], b.kv, halves[1][2])
            main.wait_stream(side)

        whole = bench(lambda: b.model(ids, positions, b.kv, meta), graph=True)
        serial, overlapped = bench(one_after_the_other, graph=True), bench(side_by_side, graph=True)
        print(f"{label}{n} rows, {lo}-{hi}: whole {whole:.3f} ms, halves one after the other {serial:.3f} ms, "
              f"halves on two streams {overlapped:.3f} ms (K/V at copy speed {b.floor_ms(lens):.2f})", flush=True)


def carveout(b: Bench) -> None:
    """Session 36 found two streams overlap nothing at 256 rows: the decode kernel's grid takes every SM. cuBLAS
    held to (SMs - carveout) leaves the rest to the other stream's attention."""
    sms = torch.cuda.get_device_properties(b.device).multi_processor_count
    try:
        for carve in (0, sms // 8, sms // 4, sms // 2):
            torch._C._set_sm_carveout_experimental(carve)
            streams(b, ((256, 100, 2000), (256, 1024, 1024)), f"cuBLAS on {sms - carve} of {sms} SMs: ")
    finally:
        torch._C._set_sm_carveout_experimental(None)


def write(b: Bench) -> None:
    rng = np.random.default_rng(0)
    real = PagedAttention.__dict__["write"]
    for n, lo, hi in [(256, 100, 2000), (256, 1024, 1024), (128, 300, 1500), (64, 300, 1500), (32, 500, 1500),
                      (8, 1000, 2000), (1, 1500, 1500)]:
        lens = rng.integers(lo, hi + 1, n)
        whole = b.forward_ms(lens)
        PagedAttention.write = staticmethod(lambda q, *args, **kwargs: q)
        try:
            without = b.forward_ms(lens)
        finally:
            PagedAttention.write = real
        print(f"{n} rows, {lo}-{hi}: {whole:.3f} ms, without the write kernel {without:.3f} ms "
              f"({(whole - without) * 1e3 / b.model.arch.num_hidden_layers:.2f} us a layer)", flush=True)


if __name__ == "__main__":
    questions = {"lengths": lengths, "placement": placement, "streams": streams, "write": write, "carveout": carveout}
    b = Bench()
    with torch.inference_mode():
        for name in sys.argv[1:] or list(questions):
            questions[name](b)
    b.engine.close()

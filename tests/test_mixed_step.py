"""A mixed step (decode rows and prefill chunks in one forward) against the same rows run as a decode-only
step and a prefill-only step, on copies of the same KV cache."""
import copy

import numpy as np
import pytest
import torch

from engine.attention import AttentionMetadata, PrefillMetadata
from engine.block_manager import KVBlockManager
from engine.kv_cache import PagedKVCache
from engine.models.loader import build_model

BLOCK = 4


def metadata(manager, seq_ids, starts, counts, slots, num_decode):
    """The step's metadata for sequences that compute counts[i] tokens from starts[i]."""
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tables = manager.get_block_table_tensor(seq_ids)
    seq_lens = torch.tensor([a + n for a, n in zip(starts, counts)], dtype=torch.int32)
    prefill = None
    if num_decode < len(seq_ids):
        prefill = PrefillMetadata(tables[num_decode:], seq_lens[num_decode:], torch.from_numpy(cu[num_decode:] - num_decode))
    return AttentionMetadata(torch.from_numpy(slots), tables[:num_decode], seq_lens[:num_decode], prefill)


def positions_of(starts, counts):
    return torch.cat([torch.arange(a, a + n) for a, n in zip(starts, counts)])


def run(model, cache, manager, tokens, seq_ids, counts, num_decode):
    """Append counts[i] tokens to each sequence and run one forward; returns the hidden states."""
    starts = [manager.state(s).sequence_length for s in seq_ids]
    slots = manager.slot_mapping_for_append(seq_ids, counts)
    ids = torch.cat([torch.tensor(tokens[s][a:a + n]) for s, a, n in zip(seq_ids, starts, counts)])
    meta = metadata(manager, seq_ids, starts, counts, slots, num_decode)
    return model(ids, positions_of(starts, counts), cache, meta)


@pytest.mark.usefixtures("one_thread")
def test_mixed_step_equals_separate_prefill_and_decode_steps(make_config):
    cfg = make_config("model.device=cpu", "model.dtype=float32", "model.max_model_len=64")
    model, _ = build_model(cfg.model, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(3)
    tokens = {s: torch.randint(0, 256, (40,), generator=generator).tolist() for s in range(4)}
    manager = KVBlockManager(64, BLOCK, enable_prefix_caching=False)
    cache = PagedKVCache(model.kv_cache_spec, 64, BLOCK, torch.float32, torch.device("cpu"))
    for s in range(4):
        manager.create_sequence(s)
    # before the step: sequences 0 and 1 have 9 and 13 tokens stored, 2 is half prefilled (6), 3 is new
    run(model, cache, manager, tokens, [0, 1, 2], [9, 13, 6], num_decode=0)
    split_manager, split_cache = copy.deepcopy(manager), copy.deepcopy(cache)

    mixed = run(model, cache, manager, tokens, [0, 1, 2, 3], [1, 1, 7, 5], num_decode=2)
    decoded = run(model, split_cache, split_manager, tokens, [0, 1], [1, 1], num_decode=2)
    prefilled = run(model, split_cache, split_manager, tokens, [2, 3], [7, 5], num_decode=0)

    torch.testing.assert_close(mixed, torch.cat([decoded, prefilled]), rtol=1e-5, atol=1e-5)
    for layer in range(len(cache.key_caches)):
        torch.testing.assert_close(cache.key_caches[layer], split_cache.key_caches[layer])
        torch.testing.assert_close(cache.value_caches[layer], split_cache.value_caches[layer])


def test_longest_first_is_the_decode_start_order():
    """The plain decode kernel starts rows longest first, ties in batch order (by hand)."""
    from engine.model_runner import longest_first

    order = longest_first(np.array([5, 900, 17, 900, 1, 64], dtype=np.int32))
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 5, 2, 0, 4]
    assert longest_first(np.zeros(0, dtype=np.int32)).tolist() == []


def test_sampled_rows_padded_to_a_decode_bucket():
    """An eager step's sampled rows reach the lm_head padded to the smallest decode-graph bucket that holds them
    (their first row repeated), a row count the graphs' captures multiplied; as they are without buckets, without
    rows, or past the largest bucket."""
    from engine.cuda_graphs import bucket_sizes
    from engine.model_runner import padded_to_bucket

    buckets = bucket_sizes(1024)
    for n in (1, 3, 16, 17, 452, 582, 924, 1024):
        rows = np.arange(5, 5 + 2 * n, 2, dtype=np.int64)
        padded = padded_to_bucket(rows, buckets)
        assert padded.size == min(b for b in buckets if b >= n) and padded.dtype == rows.dtype
        assert np.array_equal(padded[:n], rows) and (padded[n:] == rows[0]).all()
    assert padded_to_bucket(rows, None) is rows
    assert padded_to_bucket(np.zeros(0, np.int64), buckets).size == 0
    assert padded_to_bucket(np.arange(1025), buckets).size == 1025

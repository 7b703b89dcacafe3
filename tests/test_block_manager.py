import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import (
    DuplicateSequenceError, KVBlockManager, OutOfBlocksError, UnknownSequenceError,
)


def slot_by_formula(block_table, pos, block_size):
    return block_table[pos // block_size] * block_size + pos % block_size


def test_article_worked_example():
    manager = KVBlockManager(num_physical_blocks=10, block_size=4)
    manager.free_blocks.clear()
    manager.free_blocks.extend([5, 2, 9, 1, 0, 3, 4, 6, 7, 8])
    manager.create_sequence(0)
    slots = [manager.append_token(0) for _ in range(13)]
    assert manager.sequences[0].block_table == [5, 2, 9, 1]
    assert slots[6] == 10  # logical block 1, offset 2 -> physical block 2 -> slot 2 * 4 + 2
    assert manager.sequences[0].sequence_length == 13
    assert manager.internal_fragmentation_tokens() == 3
    assert manager.get_block_table_tensor([0]).tolist() == [[5, 2, 9, 1]]
    assert manager.get_seq_lens_tensor([0]).tolist() == [13]


def test_errors_leave_the_pool_unchanged():
    manager = KVBlockManager(num_physical_blocks=3, block_size=2)
    manager.create_sequence(7)
    manager.append_tokens(7, 5)
    before = (list(manager.free_blocks), manager.sequences[7].block_table[:], manager.sequences[7].sequence_length)
    with pytest.raises(OutOfBlocksError):
        manager.append_tokens(7, 2)
    with pytest.raises(OutOfBlocksError):
        manager.slot_mapping_for_append([7], [3])
    with pytest.raises(DuplicateSequenceError):
        manager.create_sequence(7)
    with pytest.raises(UnknownSequenceError):
        manager.append_token(8)
    assert (list(manager.free_blocks), manager.sequences[7].block_table, manager.sequences[7].sequence_length) == before
    manager.release_sequence(7)
    with pytest.raises(UnknownSequenceError):
        manager.release_sequence(7)
    assert sorted(manager.free_blocks) == [0, 1, 2] and manager.invariants_ok()


def test_batch_slot_mapping_is_all_or_nothing():
    manager = KVBlockManager(num_physical_blocks=4, block_size=4)
    for sid in (0, 1):
        manager.create_sequence(sid)
    slots = manager.slot_mapping_for_append([0, 1], [3, 6])
    assert len(slots) == 9 and len(set(slots.tolist())) == 9
    with pytest.raises(OutOfBlocksError):  # needs 1 (seq 0) + 1 (seq 1) blocks, 1 free
        manager.slot_mapping_for_append([0, 1], [2, 3])
    assert [s.sequence_length for s in manager.sequences.values()] == [3, 6]


operations = st.lists(
    st.tuples(st.sampled_from(["create", "append", "fork", "release"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 9), caching=st.booleans(), ops=operations)
def test_random_lifecycles_keep_the_invariants(num_blocks, block_size, caching, ops):
    """Against a simulated device (slot -> the label last written there): every live sequence reads back
    its own tokens through its table, whatever was appended, forked (with the returned copies made) or
    released since; a fork makes 1 or 2 children (as n says) with the lowest ids not live."""
    manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    device, content, labels = {}, {}, itertools.count()  # content: sid -> the labels of its tokens
    for op, sid, n in ops:
        free_before = manager.num_free_blocks
        if op in ("append", "fork") and manager.sequences:  # most draws reach a live sequence
            sid = sorted(manager.sequences)[sid % len(manager.sequences)]
        try:
            if op == "create":
                manager.create_sequence(sid)
                content[sid] = []
            elif op == "append":
                state = manager.state(sid)
                start = state.sequence_length
                slots = manager.append_tokens(sid, n).tolist()
                assert slots == [slot_by_formula(state.block_table, p, block_size) for p in range(start, start + n)]
                for slot in slots:
                    device[slot] = next(labels)
                    content[sid].append(device[slot])
            elif op == "fork":
                children = [c for c in range(8) if c not in manager.sequences][: 1 + n % 2]
                parent = manager.state(sid)
                copies = manager.fork(sid, children)
                partial = parent.sequence_length % block_size != 0
                assert copies == [(parent.block_table[-1], manager.state(c).block_table[-1])
                                  for c in children if partial]
                for src, dst in copies:
                    for i in range(block_size):
                        device[dst * block_size + i] = device.get(src * block_size + i)
                content.update({c: list(content[sid]) for c in children})
            else:
                manager.release_sequence(sid)
                del content[sid]
        except (OutOfBlocksError, UnknownSequenceError, DuplicateSequenceError):
            assert manager.num_free_blocks == free_before
        assert manager.invariants_ok()
        live = manager.sequences.values()
        assert {s.sequence_id for s in live} == set(content)
        held = set()  # the slots of live tokens, each once
        for s in live:
            slots = [slot_by_formula(s.block_table, p, block_size) for p in range(s.sequence_length)]
            assert [device.get(slot) for slot in slots] == content[s.sequence_id]
            held.update(slots)
        waste = sum((-s.sequence_length) % block_size for s in live)
        assert manager.internal_fragmentation_tokens() == waste
        stored = manager.num_used_blocks * block_size - manager.internal_fragmentation_tokens()
        assert stored == len(held) and sum(s.sequence_length for s in live) == sum(map(len, content.values()))
        used = {b for s in live for b in s.block_table}
        assert manager.num_used_blocks == len(used)
        assert manager.num_cached_blocks == 0  # nothing registers a hash here
    for sid in list(manager.sequences):
        manager.release_sequence(sid)
    assert sorted(manager.free_blocks) == list(range(num_blocks)) and manager.invariants_ok()


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 5), lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8),
       spare=st.integers(0, 3), order=st.randoms(use_true_random=False))
def test_a_decode_batch_fits_and_is_placed_as_one_token_at_a_time(block_size, lengths, spare, order):
    """num_appendable: the longest leading run of sequences whose next token fits when each takes a free
    block at a block boundary, in order; slot_mapping_for_append of that run gives each token the slot of
    the formula, new blocks taken from the head of the free list in the run's order; the block tables
    read back as the lists, padded with -1."""
    num_blocks = max(sum(-(-n // block_size) for n in lengths) + spare, 1)
    manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=False)
    for sid, n in enumerate(lengths):
        manager.create_sequence(sid)
        manager.append_tokens(sid, n)
    ids = list(range(len(lengths)))
    order.shuffle(ids)
    free, fit, taken = list(manager.free_blocks), 0, 0
    for sid in ids:  # by hand: one token each, in order, while the pool has the blocks
        at_boundary = lengths[sid] % block_size == 0
        if at_boundary and taken == len(free):
            break
        taken, fit = taken + at_boundary, fit + 1
    assert manager.num_appendable(ids) == fit
    slots = manager.slot_mapping_for_append(ids[:fit]).tolist()
    new_blocks = [manager.state(s).block_table[-1] for s in ids[:fit] if lengths[s] % block_size == 0]
    assert new_blocks == free[:taken]
    assert slots == [slot_by_formula(manager.state(s).block_table, lengths[s], block_size) for s in ids[:fit]]
    assert [manager.state(s).sequence_length for s in ids] == [lengths[s] + (i < fit) for i, s in enumerate(ids)]
    tables = [manager.state(s).block_table for s in ids]
    width = max(map(len, tables))
    assert manager.get_block_table_tensor(ids).tolist() == [t + [-1] * (width - len(t)) for t in tables]
    assert manager.get_block_table_tensor(ids, width + 2).tolist() == [t + [-1] * (width + 2 - len(t)) for t in tables]
    assert manager.invariants_ok()


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 8), lengths=st.lists(st.integers(1, 200), min_size=1, max_size=300))
def test_the_table_rows_are_as_wide_as_the_longest_table_not_as_the_rows_are_many(block_size, lengths):
    """Sequences of these lengths live at once: table_rows has a row for each and fewer than twice the longest
    table's columns (8 at least), however many rows it grew to (a table of 2,048 rows was once 65,536 columns
    wide, its growth a 0.3 s np.full inside a step)."""
    manager = KVBlockManager(num_physical_blocks=sum(-(-n // block_size) for n in lengths), block_size=block_size)
    for sid, length in enumerate(lengths):
        manager.create_sequence(sid)
        manager.append_tokens(sid, length)
    longest = max(-(-n // block_size) for n in lengths)
    rows, width = manager.table_rows.shape
    assert rows >= len(lengths) and longest <= width <= max(8, 2 * longest - 1)
    assert manager.invariants_ok()

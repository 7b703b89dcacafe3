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
    st.tuples(st.sampled_from(["create", "append", "release"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 9), ops=operations)
def test_random_lifecycles_keep_the_invariants(num_blocks, block_size, ops):
    manager = KVBlockManager(num_blocks, block_size)
    owner = {}  # slot -> sequence that wrote it
    for op, sid, n in ops:
        free_before = manager.num_free_blocks
        try:
            if op == "create":
                manager.create_sequence(sid)
            elif op == "append":
                state = manager.state(sid)
                start = state.sequence_length
                slots = manager.append_tokens(sid, n).tolist()
                assert slots == [slot_by_formula(state.block_table, p, block_size) for p in range(start, start + n)]
                for slot in slots:
                    assert owner.get(slot, sid) == sid, "slot shared by two live sequences"
                    owner[slot] = sid
            else:
                blocks = set(manager.state(sid).block_table)
                manager.release_sequence(sid)
                owner = {s: o for s, o in owner.items() if s // block_size not in blocks}
        except (OutOfBlocksError, UnknownSequenceError, DuplicateSequenceError):
            assert manager.num_free_blocks == free_before
        assert manager.invariants_ok()
        waste = sum((-s.sequence_length) % block_size for s in manager.sequences.values())
        assert manager.internal_fragmentation_tokens() == waste
        used = sum(len(s.block_table) for s in manager.sequences.values())  # nothing shared: no hashes
        assert used * block_size - manager.stored_tokens() == waste
        assert manager.stored_tokens() == manager.logical_tokens() and manager.num_cached_blocks == 0
    for sid in list(manager.sequences):
        manager.release_sequence(sid)
    assert sorted(manager.free_blocks) == list(range(num_blocks)) and manager.invariants_ok()

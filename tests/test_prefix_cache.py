"""Prefix caching in the block manager: a hand-worked trace, the hash's format, all-or-nothing failures,
caching off, and a stateful property test against a simulated device (slot -> token written)."""
import copy
import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.block_manager import (
    DuplicateSequenceError, KVBlockManager, OutOfBlocksError, RecentPromptHashes, UnknownSequenceError,
    extend_block_hashes, leading_equal_blocks,
)
from engine.sequence import SamplingParams, Sequence


def snapshot(manager: KVBlockManager):
    """Everything a failed call must leave as it was, LRU order and free-list order included."""
    return (
        list(manager.free_blocks), list(manager.cached_blocks), list(manager.ref_counts),
        list(manager.block_hash), dict(manager.cached_block_of),
        {sid: (s.sequence_length, list(s.block_table), s.num_hashed_blocks) for sid, s in manager.sequences.items()},
    )


def slots_of(manager: KVBlockManager, sequence_id: int, positions) -> list[int]:
    table, size = manager.state(sequence_id).block_table, manager.block_size
    return [table[p // size] * size + p % size for p in positions]


class Device:
    """What the GPU would hold: the token whose KV was written at each slot."""

    def __init__(self, manager: KVBlockManager):
        self.manager, self.kv = manager, {}

    def write(self, sequence_id: int, tokens, start: int) -> None:
        for slot, token in zip(slots_of(self.manager, sequence_id, range(start, start + len(tokens))), tokens):
            self.kv[slot] = token

    def block(self, block: int) -> list:
        size = self.manager.block_size
        return [self.kv.get(block * size + i) for i in range(size)]


def prefill(manager: KVBlockManager, device: Device, sequence_id: int, prompt, hashes=None) -> list[int]:
    """Admit a prompt as the scheduler would: hit its cached full blocks (all but the last token),
    compute the rest, register its full blocks. Returns the hit blocks."""
    hashes = extend_block_hashes([], prompt, manager.block_size) if hashes is None else hashes
    hit = manager.match_prefix(hashes[: (len(prompt) - 1) // manager.block_size])
    assert manager.can_admit(len(prompt), hit)
    start = manager.create_sequence(sequence_id, hit).sequence_length
    manager.append_tokens(sequence_id, len(prompt) - start)
    device.write(sequence_id, prompt[start:], start)
    manager.register_full_blocks(sequence_id, hashes)
    return hit


def test_hand_worked_trace():
    # block_size 4, 7 blocks; the free list starts [0 1 2 3 4 5 6].
    manager = KVBlockManager(num_physical_blocks=7, block_size=4)
    device = Device(manager)
    a = list(range(1, 11))                 # A: 10 tokens -> full blocks [1..4] [5..8], partial [9 10]
    b = list(range(1, 9)) + [20, 21, 22]   # B: A's first 8 tokens, then 3 of its own

    # A: empty cache, no hit; takes blocks 0 1 2; blocks 0 and 1 are full and get A's hashes.
    assert prefill(manager, device, "A", a) == []
    assert manager.state("A").block_table == [0, 1, 2] and manager.state("A").num_hashed_blocks == 2
    # B: both full blocks hit (8 tokens, blocks 0 and 1, now ref 2); its third token block is new: 3.
    assert prefill(manager, device, "B", b) == [0, 1]
    assert manager.state("B").block_table == [0, 1, 3]
    assert manager.ref_counts[:4] == [2, 2, 1, 1] and manager.num_free_blocks == 3  # 4 5 6
    # Physically: A's 10 tokens + B's own 3 = 13 in 4 blocks; without sharing: 10 + 11 = 21.
    logical = sum(s.sequence_length for s in manager.sequences.values())
    assert (manager.internal_fragmentation_tokens(), logical, manager.num_used_blocks) == (3, 21, 4)

    # A finishes: block 2 (unhashed) is free again; 0 and 1 stay referenced by B.
    manager.release_sequence("A")
    assert list(manager.free_blocks) == [4, 5, 6, 2] and manager.num_cached_blocks == 0
    # B decodes token 23: block 3 is full, its hash chains on block 1's.
    b.append(23)
    manager.append_token("B"), device.write("B", [23], 11)
    b_hashes = extend_block_hashes([], b, 4)
    manager.register_full_blocks("B", b_hashes)
    assert manager.block_hash[3] == block_digest(b_hashes[1], [20, 21, 22, 23])
    # B is preempted: its table [0 1 3] is visited tail first, so the LRU is 3, 1, 0 (3 goes first).
    manager.release_sequence("B")
    assert list(manager.cached_blocks) == [3, 1, 0] and manager.num_free_blocks == 7
    assert manager.match_prefix(b_hashes) == [0, 1, 3]

    # D: 20 unrelated tokens = 5 blocks; 4 free blocks (4 5 6 2), then the LRU's oldest, 3, is evicted.
    d = list(range(100, 120))
    assert prefill(manager, device, "D", d) == []
    assert manager.state("D").block_table == [4, 5, 6, 2, 3]
    assert manager.match_prefix(b_hashes) == [0, 1]  # B's third block left the index with block 3
    # C = A's first 8 tokens + 2 more: cannot fit now (0 and 1 hit, 1 more block needed, none left).
    c = list(range(1, 9)) + [30, 31]
    c_hashes = extend_block_hashes([], c, 4)
    assert not manager.can_admit(len(c), manager.match_prefix(c_hashes[:2]))
    # D finishes; its 5 hashed blocks join the LRU tail first: 1 0 | 3 2 6 5 4.
    manager.release_sequence("D")
    assert list(manager.cached_blocks) == [1, 0, 3, 2, 6, 5, 4] and not manager.free_blocks
    # C hits 0 and 1 (8 of its 10 tokens); its last block evicts the oldest left, 3 (D's tail).
    assert prefill(manager, device, "C", c, c_hashes) == [0, 1]
    assert manager.state("C").block_table == [0, 1, 3]
    assert manager.match_prefix(extend_block_hashes([], d, 4)) == [4, 5, 6, 2]
    # The hits served the KV of A's tokens: blocks 0 and 1 still hold what A wrote.
    assert device.block(0) + device.block(1) == c[:8]
    # Hit tokens over the trace: A 0, B 8, D 0, C 8.
    assert manager.invariants_ok()


def block_digest(parent: bytes, tokens) -> bytes:
    """The hash's definition, built independently: blake2b-128 of the parent's hash then the ids as
    little-endian int64 (struct, not numpy)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


def one_block(tokens, parent: bytes | None = None) -> bytes:
    """The engine's hash of one full block after `parent`."""
    return extend_block_hashes([parent] if parent else [], tokens, len(tokens))[-1]


def test_hash_format_and_chaining():
    tokens = [3, 1, 4, 1]
    digest = one_block(tokens)
    assert len(digest) == 16 and digest == block_digest(b"", tokens)
    assert one_block(tokens, digest) == block_digest(digest, tokens)
    assert one_block([1, 4, 1, 3]) != digest                      # order matters
    assert one_block([2**40, 0]) != one_block([0, 2**40])         # int64, not truncated
    assert one_block([9, 9], digest) != one_block([9, 9], one_block([3, 1, 4, 2]))  # parent matters

    hashes = extend_block_hashes([], [1, 2, 3], 2)  # one full block
    same = hashes
    assert extend_block_hashes(hashes, [3, 4, 5], 2) is same and len(hashes) == 2  # from position 2 on
    assert hashes == [block_digest(b"", [1, 2]), block_digest(block_digest(b"", [1, 2]), [3, 4])]
    assert extend_block_hashes([], [7, 7, 1, 2], 2)[1] != hashes[1]  # same block tokens, other prefix


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40),
       st.integers(1, 5), st.integers(0, 12))
def test_leading_equal_blocks_is_the_longest_run_of_equal_blocks(a, b, block_size, limit):
    """Against a block-by-block scan (small alphabets, so runs of equal blocks are common)."""
    expected = 0
    while (expected < limit and (expected + 1) * block_size <= min(len(a), len(b))
           and a[expected * block_size:(expected + 1) * block_size] == b[expected * block_size:(expected + 1) * block_size]):
        expected += 1
    assert leading_equal_blocks(a, b, block_size, limit) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.integers(0, 70), st.lists(st.integers(0, 2**40), max_size=40)),
                                    min_size=1, max_size=6))
def test_recent_prompt_hashes_equal_hashing_from_scratch(block_size, prompts):
    """Each prompt keeps a random part of the one before (ending inside a block, on its edge, or
    past its end) and adds its own tokens: the memo's hashes are extend_block_hashes' from scratch."""
    memo, previous = RecentPromptHashes(block_size), list(range(60))
    for keep, own in prompts:
        prompt = previous[:keep] + own
        assert memo.hashes_of(prompt) == extend_block_hashes([], prompt, block_size)
        previous = prompt


def test_recent_prompt_hashes_hash_only_the_blocks_after_the_shared_ones(monkeypatch):
    """A second prompt sharing 10 full blocks and 3 tokens with the first hashes only its blocks from the 11th on;
    a sequence of the manager with hashes already (outputs) extends them without the memo."""
    calls = []
    real = hashlib.blake2b
    monkeypatch.setattr(hashlib, "blake2b", lambda data, **kw: calls.append(data) or real(data, **kw))
    manager = KVBlockManager(num_physical_blocks=64, block_size=4)
    first = Sequence(0, "a", list(range(100, 150)), SamplingParams(), 64)   # 12 full blocks
    second = Sequence(1, "b", list(range(100, 143)) + [7] * 9, SamplingParams(), 64)  # 13 full blocks
    manager.hash_known_blocks(first)
    assert len(calls) == 12
    manager.hash_known_blocks(second)
    assert len(calls) == 12 + 3 and second.block_hashes == extend_block_hashes([], second.prompt_token_ids, 4)
    second.output_token_ids += [1, 2, 3, 4]   # a 14th full block
    manager.hash_known_blocks(second)
    assert len(calls) == 12 + 3 + 13 + 1 and len(second.block_hashes) == 14
    assert second.block_hashes == extend_block_hashes([], [*second.prompt_token_ids, 1, 2, 3, 4], 4)


def test_failures_change_nothing():
    manager = KVBlockManager(num_physical_blocks=4, block_size=2)
    device = Device(manager)
    prefill(manager, device, 0, [1, 2, 3, 4, 5])   # blocks 0 1 2, hashed 0 1
    manager.release_sequence(0)                      # LRU: 1 0; free: 3 2
    prefill(manager, device, 1, [9, 9, 9])           # takes 3 (hashed) and 2
    before = snapshot(manager)
    cases = [
        (DuplicateSequenceError, lambda: manager.create_sequence(1, [0, 1])),
        (ValueError, lambda: manager.create_sequence(2, [0, 2])),         # 2 holds no hash
        (ValueError, lambda: manager.create_sequence(2, [0, 0])),         # a block twice
        (OutOfBlocksError, lambda: manager.append_tokens(1, 6)),          # 3 blocks > 2 cached
        (OutOfBlocksError, lambda: manager.slot_mapping_for_append([1], [6])),
        (UnknownSequenceError, lambda: manager.slot_mapping_for_append([1, 5], [1, 1])),
        (ValueError, lambda: manager.slot_mapping_for_append([1, 1], [1, 1])),
        (ValueError, lambda: manager.append_tokens(1, -1)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert snapshot(manager) == before and manager.invariants_ok()
    assert manager.match_prefix(extend_block_hashes([], [1, 2, 3, 4], 2)) == [0, 1]


def test_equal_content_computed_twice_is_indexed_once():
    manager = KVBlockManager(num_physical_blocks=4, block_size=2)
    hashes = extend_block_hashes([], [5, 6, 7], 2)
    for sid in (0, 1):  # both admitted before either registers: neither hits
        manager.create_sequence(sid)
        manager.append_tokens(sid, 3)
    manager.register_full_blocks(0, hashes)
    manager.register_full_blocks(1, hashes)  # block 2 holds the same content as block 0: stays unhashed
    assert manager.cached_block_of == {hashes[0]: 0} and manager.block_hash[2] is None
    assert manager.state(1).num_hashed_blocks == 1 and manager.invariants_ok()
    manager.release_sequence(1)
    manager.release_sequence(0)
    assert list(manager.cached_blocks) == [0] and sorted(manager.free_blocks) == [1, 2, 3]


def test_only_stored_full_blocks_are_registered():
    manager = KVBlockManager(num_physical_blocks=3, block_size=4)
    hashes = extend_block_hashes([], list(range(9)), 4)  # the whole prompt's 2 full blocks
    manager.create_sequence(0)
    manager.append_tokens(0, 6)  # a first prefill chunk: block 0 full, block 1 half stored
    manager.register_full_blocks(0, hashes)
    assert manager.cached_block_of == {hashes[0]: 0} and manager.state(0).num_hashed_blocks == 1
    manager.append_tokens(0, 3)
    manager.register_full_blocks(0, hashes)
    assert manager.cached_block_of == {hashes[0]: 0, hashes[1]: 1} and manager.block_hash[2] is None
    assert manager.state(0).num_hashed_blocks == 2 and manager.invariants_ok()


def test_the_hashes_matches_and_registrations_of_sequences():
    """hash_known_blocks: a sequence's known full blocks, copied to the other samples of its prompt, none while it
    scores its prompt or with caching off; cached_prefix never takes its last token's block; register_known_blocks
    hashes the blocks that outputs complete and registers them only while the sequence is live."""
    manager = KVBlockManager(num_physical_blocks=6, block_size=2)
    first, other = (Sequence(i, "r", [1, 2, 3, 4], SamplingParams(), 8) for i in (0, 1))
    manager.hash_known_blocks(first, other)
    assert first.block_hashes == other.block_hashes == extend_block_hashes([], [1, 2, 3, 4], 2)
    assert other.block_hashes is not first.block_hashes
    scoring = Sequence(2, "s", [1, 2, 3, 4], SamplingParams(prompt_logprobs=0), 8)
    manager.hash_known_blocks(scoring)
    plain = Sequence(3, "p", [1, 2], SamplingParams(), 4)
    KVBlockManager(6, 2, enable_prefix_caching=False).hash_known_blocks(plain)
    assert scoring.block_hashes == [] and plain.block_hashes == []

    first.block_state = manager.create_sequence(0, manager.cached_prefix(first))
    manager.append_tokens(0, 4)
    manager.register_full_blocks(0, first.block_hashes)
    assert manager.cached_prefix(other) == [0] and first.num_computed_tokens == 4  # block 1 holds its last token
    first.output_token_ids += [5, 6]
    manager.append_tokens(0, 2)  # the outputs' slots: allocated before their ids are known
    manager.register_known_blocks(first)
    assert first.block_hashes == extend_block_hashes([], [1, 2, 3, 4, 5, 6], 2) and manager.num_used_blocks == 3
    assert manager.state(0).num_hashed_blocks == 3 and len(manager.cached_block_of) == 3
    other.output_token_ids += [7, 8]
    manager.register_known_blocks(other)  # not live (waiting): hashed, not registered
    assert len(other.block_hashes) == 3 and len(manager.cached_block_of) == 3 and manager.invariants_ok()


def test_reset_prefix_cache_frees_only_unreferenced_blocks():
    manager = KVBlockManager(num_physical_blocks=6, block_size=2)
    device = Device(manager)
    prefill(manager, device, 0, [1, 2, 3, 4, 5])
    prefill(manager, device, 1, [7, 8, 9])
    manager.release_sequence(0)
    manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0 and sorted(manager.free_blocks) == [0, 1, 2, 5]  # 3 4: live
    assert manager.match_prefix(extend_block_hashes([], [1, 2, 3, 4], 2)) == []
    assert manager.match_prefix(extend_block_hashes([], [7, 8], 2)) == [3]  # live: still indexed
    assert manager.invariants_ok()


def test_caching_off_is_the_plain_manager():
    manager = KVBlockManager(num_physical_blocks=6, block_size=2, enable_prefix_caching=False)
    device = Device(manager)
    prompt = [1, 2, 3, 4, 5]
    assert prefill(manager, device, 0, prompt) == []
    assert manager.state(0).num_hashed_blocks == 0 and not manager.cached_block_of
    assert prefill(manager, device, 1, prompt) == []  # the same prompt again: no hit
    assert [manager.state(s).block_table for s in (0, 1)] == [[0, 1, 2], [3, 4, 5]]
    manager.release_sequence(0)
    manager.release_sequence(1)
    assert sorted(manager.free_blocks) == list(range(6)) and manager.num_cached_blocks == 0
    assert manager.invariants_ok()


CORRUPTIONS = {
    "reference count off by one": lambda m: m.ref_counts.__setitem__(0, 3),
    "cached block also free": lambda m: m.free_blocks.append(next(iter(m.cached_blocks))),
    "free block holds a hash": lambda m: m.block_hash.__setitem__(m.free_blocks[0], bytes(16)),
    "index points at another block": lambda m: m.cached_block_of.update({m.block_hash[0]: 1}),
    "partial block counted as hashed": lambda m: setattr(m.state(1), "num_hashed_blocks", 2),
    "table longer than its tokens": lambda m: m.state(1).block_table.append(m.free_blocks.popleft()),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_invariants_catch_corruption(corrupt):
    manager = KVBlockManager(num_physical_blocks=6, block_size=2)
    device = Device(manager)
    prefill(manager, device, 0, [1, 2, 3, 4, 5])  # blocks 0 1 2; 0 1 hashed
    prefill(manager, device, 1, [1, 2, 3])        # hits 0, takes 3: ref counts 2 1 1 1
    manager.release_sequence(0)                   # 2 free; 1 cached
    assert manager.invariants_ok()
    corrupt(manager)
    assert not manager.invariants_ok()


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0, 7, 7], [6, 5, 4, 3, 2, 1]]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions (prompts from a few shared prefixes), prefill chunks, decode steps, batches,
    registrations, releases (finish or preemption) and resets under a small pool."""

    @initialize(num_blocks=st.integers(2, 9), block_size=st.integers(1, 4), caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks, block_size, caching):
        self.manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.device = Device(self.manager)
        self.tokens, self.prompt_len, self.hashes = {}, {}, {}
        self.next_id = 0

    def _pick(self, index):
        live = sorted(self.manager.sequences)
        return live[index % len(live)] if live else None

    def _append(self, sid, count, register):
        """append_tokens through the manager, written on the device, then (as the scheduler does
        after scheduling) the newly full blocks registered; a failure must change nothing."""
        manager, state = self.manager, self.manager.state(sid)
        before, unreferenced = snapshot(manager), {b for b, r in enumerate(manager.ref_counts) if r == 0}
        start, old_table = state.sequence_length, len(state.block_table)
        try:
            slots = manager.append_tokens(sid, count).tolist()
        except OutOfBlocksError:
            assert manager.new_blocks_for(sid, count) > manager.num_free_blocks and snapshot(manager) == before
            return
        assert set(state.block_table[old_table:]) <= unreferenced  # never a block a live table holds
        assert slots == slots_of(manager, sid, range(start, start + count))
        for slot in slots:  # writes land only in this sequence's own, unhashed blocks
            block = slot // manager.block_size
            assert manager.ref_counts[block] == 1 and manager.block_hash[block] is None
        self.device.write(sid, self.tokens[sid][start : start + count], start)
        if register:
            self.register(sid)

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 9), tail=st.lists(st.integers(0, 3), max_size=3),
          chunk=st.integers(1, 16), register=st.booleans())
    def admit(self, prefix, cut, tail, chunk, register):
        manager, sid = self.manager, self.next_id
        prompt = prefix[:cut] + tail
        hashes = extend_block_hashes([], prompt, manager.block_size)
        hit = manager.match_prefix(hashes[: (len(prompt) - 1) // manager.block_size])
        assert manager.enable_prefix_caching or not hit
        for i, block in enumerate(hit):  # a hit serves exactly the KV of the prompt tokens it stands for
            assert self.device.block(block) == prompt[i * manager.block_size : (i + 1) * manager.block_size]
        trial = copy.deepcopy(manager)  # oracle for can_admit: take the prefix, then ask for the rest
        trial.create_sequence(sid, hit)
        fits = trial.can_append(sid, len(prompt) - len(hit) * manager.block_size)
        assert manager.can_admit(len(prompt), hit) == fits
        if not fits:
            return
        self.next_id += 1
        self.tokens[sid], self.prompt_len[sid], self.hashes[sid] = list(prompt), len(prompt), []
        start = manager.create_sequence(sid, hit).sequence_length
        self._append(sid, min(chunk, len(prompt) - start), register)

    @rule(index=st.integers(0, 8), chunk=st.integers(1, 16), register=st.booleans())
    def prefill_chunk(self, index, chunk, register):
        sid = self._pick(index)
        if sid is not None:
            remaining = self.prompt_len[sid] - self.manager.state(sid).sequence_length
            if remaining > 0:
                self._append(sid, min(chunk, remaining), register)

    @rule(index=st.integers(0, 8), token=st.integers(0, 9), register=st.booleans())
    def decode(self, index, token, register):
        sid = self._pick(index)
        if sid is not None and self.manager.state(sid).sequence_length == len(self.tokens[sid]):
            self.tokens[sid].append(token)
            self._append(sid, 1, register)
            if self.manager.state(sid).sequence_length < len(self.tokens[sid]):
                self.tokens[sid].pop()  # out of blocks: the token was not stored

    @rule(indices=st.lists(st.integers(0, 8), max_size=4, unique=True))
    def decode_batch(self, indices):
        manager = self.manager
        sids = sorted({self._pick(i) for i in indices} - {None})
        sids = [s for s in sids if manager.state(s).sequence_length == len(self.tokens[s])]
        before = snapshot(manager)
        try:
            slots = manager.slot_mapping_for_append(sids).tolist()
        except OutOfBlocksError:
            assert snapshot(manager) == before
            return
        for sid, slot in zip(sids, slots):
            self.tokens[sid].append(sid % 10)
            self.device.kv[slot] = sid % 10

    def register(self, sid):
        """As the engine does: extend the sequence's hashes over the tokens after those they cover."""
        hashes, block_size = self.hashes[sid], self.manager.block_size
        extend_block_hashes(hashes, self.tokens[sid][len(hashes) * block_size:], block_size)
        self.manager.register_full_blocks(sid, hashes)

    @rule(index=st.integers(0, 8))
    def register_later(self, index):
        sid = self._pick(index)
        if sid is not None:
            self.register(sid)

    @rule(index=st.integers(0, 8))
    def release(self, index):
        sid = self._pick(index)
        if sid is not None:
            self.manager.release_sequence(sid)

    @rule()
    def reset(self):
        self.manager.reset_prefix_cache()
        assert self.manager.num_cached_blocks == 0

    @invariant()
    def pool_is_consistent(self):
        assert self.manager.invariants_ok()

    @invariant()
    def every_live_position_holds_its_token(self):
        manager = self.manager
        for sid, state in manager.sequences.items():
            slots = slots_of(manager, sid, range(state.sequence_length))
            assert [self.device.kv.get(s) for s in slots] == self.tokens[sid][: state.sequence_length]

    @invariant()
    def counts_match_an_independent_count(self):
        manager, size = self.manager, self.manager.block_size
        filled = {}  # block -> slots written in it by any live sequence
        for state in manager.sequences.values():
            for i, block in enumerate(state.block_table):
                filled[block] = max(filled.get(block, 0), min(size, state.sequence_length - i * size))
        assert manager.num_used_blocks == len(filled)
        assert manager.num_used_blocks * size - manager.internal_fragmentation_tokens() == sum(filled.values())
        hashed_idle = sum(1 for b, h in enumerate(manager.block_hash) if h is not None and b not in filled)
        assert manager.num_cached_blocks == hashed_idle

    def teardown(self):
        if hasattr(self, "manager"):
            for sid in list(self.manager.sequences):
                self.manager.release_sequence(sid)
            assert self.manager.num_free_blocks == self.manager.num_physical_blocks and self.manager.invariants_ok()


PrefixCacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_prefix_cache_machine = PrefixCacheMachine.TestCase

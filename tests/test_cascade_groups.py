"""engine/prefix_groups.py: a hand-computed example, and a property test against a brute-force oracle
(pure Python over rows) whose results must also satisfy the op's own group check."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.prefix_groups import MAX_CASCADE_GROUPS, CascadePolicy, StepCost, find_prefix_groups
from ops.cascade import PrefixPass
from ops.paged_attention_reference import check_cascade_groups

ON = CascadePolicy(2, 1)
# block_size 4; rows in the order the scheduler gives them (by first block)
TABLES = [
    [10, 11, 12, 13, -1],  # 15 tokens        A: three rows agree on 3 columns, but row 2's context
    [10, 11, 12, 20, 21],  # 18               ends inside block 12 (2 full blocks): prefix 2 blocks
    [10, 11, 12, -1, -1],  # 10
    [30, -1, -1, -1, -1],  # 3                alone
    [40, 41, 42, -1, -1],  # 12               B: 3 columns, 3 full blocks each: 12 = row 4's whole context
    [40, 41, 42, 44, -1],  # 13
    [50, 51, -1, -1, -1],  # 5                C: the -1 padding agrees too, but only 1 full block each
    [50, 51, -1, -1, -1],  # 6
    [60, 61, -1, -1, -1],  # 2                no full block: no prefix
    [60, 62, -1, -1, -1],  # 3
    [70, -1, -1, -1, -1],  # 4                alone
]
LENS = [15, 18, 10, 3, 12, 13, 5, 6, 2, 3, 4]


def groups_of(policy, tables=TABLES, lens=LENS, block_size=4):
    found = find_prefix_groups(np.array(tables, dtype=np.int32), np.array(lens, dtype=np.int32), block_size, policy)
    return None if found is None else (found.cu_group_rows.tolist(), found.group_prefix_lens.tolist(),
                                       found.shared_rows)


@pytest.mark.parametrize("policy, expected", [
    (ON, ([0, 3, 4, 6, 8], [8, 0, 12, 4], 7)),  # A, the row alone as a plain group, B, C; rows 8-10 after
    (CascadePolicy(3, 1), ([0, 3], [8], 3)),  # only A has 3 rows
    (CascadePolicy(2, 12), ([0, 4, 6], [0, 12], 2)),  # only B shares 12 tokens: rows 0-3 before it are plain
    (CascadePolicy(2, 1, max_groups=2), ([0, 3, 4, 6], [8, 0, 12], 5)),  # saved tokens: A 2 * 8, B 12, C 4
    (CascadePolicy(2, 1, max_groups=1), ([0, 3], [8], 3)),
    (CascadePolicy(2, 13), None),
])
def test_hand_computed_groups(policy, expected):
    assert groups_of(policy) == expected


def test_no_groups():
    assert groups_of(ON, [[1, 2]], [8]) is None  # one row
    assert groups_of(ON, [[1, 2], [3, 4]], [8, 8]) is None  # no first block in common


# plain = 10 + 1 row + 0.5 unique token + 0.25 repeated token; cascade = 20 + 2 prefix-pass items
# + 0.5 own token + 1 prefix token + 3 groups (microseconds, for 100 bytes of K/V a token)
COST = StepCost(plain=(10, 1, 0.5, 0.25), cascade=(20, 2, 0.5, 1, 3), kv_bytes_per_token=100)


def test_step_cost_by_hand():
    rows, prefixes = np.array([3, 2]), np.array([8, 12])
    # a group pays when (0.5 r - 1) p > 3 at 100 bytes a token: 0.5 * 8 = 4 > 3 yes, 0 * 12 no; at 200
    # bytes the terms double: (1 r - 2) p > 3: 8 yes, 0 no
    assert COST.groups_that_pay(rows, prefixes, 100).tolist() == [True, False]
    assert COST.groups_that_pay(rows, prefixes, 200).tolist() == [True, False]
    assert COST.groups_that_pay(np.array([3]), np.array([6]), 100).tolist() == [False]  # 0.5 * 6 = 3, not > 3
    # 11 rows reading 91 tokens, groups as above: grouped 3 * 8 + 2 * 12 = 48 tokens, prefixes 20, repeated 28.
    # with 11 items: plain 10 + 11 + 0.5 * 63 + 0.25 * 28 = 59.5; cascade 20 + 22 + 0.5 * 43 + 20 + 6 = 89.5
    assert not COST.cascade_pays(11, 91, rows, prefixes, 100, 11)
    # with 64 rows sharing 1,000 tokens in one group, reading 64,000 + 640 own: plain 10 + 64 + 0.5 * 1,640
    # + 0.25 * 63,000 = 16,644; cascade, 64 items: 20 + 128 + 0.5 * 640 + 1,000 + 3 = 1,471; with 8,000
    # items: 20 + 16,000 + 1,323 = 17,343, plain
    assert COST.cascade_pays(64, 64_640, np.array([64]), np.array([1000]), 100, 64)
    assert not COST.cascade_pays(64, 64_640, np.array([64]), np.array([1000]), 100, 8000)


def test_groups_that_the_cost_takes():
    one_row_tiles = PrefixPass(block_q=1, block_n=4, align=1, programs=2)  # A's prefix of 8: 1 chunk, 3 items
    policy = CascadePolicy(2, 1, cost=COST, kv_bytes_per_token=100, prefix_pass=one_row_tiles)
    # candidates A (3 rows x 8), B (2 x 12), C (2 x 4): only A pays for itself ((0.5 * 3 - 1) 8 = 4 > 3), and
    # then the step: 11 rows, 91 tokens, A alone: plain 10 + 11 + 0.5 * 75 + 0.25 * 16 = 62.5; cascade 20 + 2 * 3
    # + 0.5 * 67 + 8 + 3 = 70.5: plain wins, so no groups
    assert groups_of(policy) is None
    cheap = StepCost(plain=(10, 1, 0.5, 0.25), cascade=(0, 0, 0.5, 1, 3), kv_bytes_per_token=100)
    # the same with a free launch: cascade 0 + 0 + 33.5 + 8 + 3 = 44.5 < 62.5, A alone, with A's plan: its 3
    # rows against tokens [0, 8) in slot 0 of 1
    taken = CascadePolicy(2, 1, cost=cheap, kv_bytes_per_token=100, prefix_pass=one_row_tiles)
    assert groups_of(taken) == ([0, 3], [8], 3)
    found = find_prefix_groups(np.array(TABLES, dtype=np.int32), np.array(LENS, dtype=np.int32), 4, taken)
    assert found.plan.tolist() == [[3] + [0] * 7] + [[row, 1, 0, 8, 0, 1, 8, 0] for row in range(3)]
    assert groups_of(CascadePolicy(2, 1, cost=cheap, kv_bytes_per_token=100)) == ([0, 3], [8], 3)
    # a step of fewer rows than min_step_rows takes nothing
    assert groups_of(CascadePolicy(2, 1, min_step_rows=12, cost=cheap, kv_bytes_per_token=100)) is None


def test_policy_for_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert CascadePolicy.for_mode("off", cuda) is None and CascadePolicy.for_mode("auto", cpu) is None
    assert CascadePolicy.for_mode("on", cpu) == ON
    auto = CascadePolicy.for_mode("auto", cuda, kv_bytes_per_token=1234)
    assert auto.min_rows >= 2 and auto.min_prefix_tokens >= 1 and auto.max_entries == 2 * auto.max_groups
    assert auto.cost is not None and auto.kv_bytes_per_token == 1234 and auto.min_step_rows >= 2
    # groups of >= 2 rows: as many as an engine's rows can hold, MAX_CASCADE_GROUPS at least
    for max_num_seqs, groups in ((0, MAX_CASCADE_GROUPS), (16, MAX_CASCADE_GROUPS), (1024, 512)):
        for mode in ("on", "auto"):
            assert CascadePolicy.for_mode(mode, cuda, max_num_seqs=max_num_seqs).max_groups == groups


@pytest.mark.parametrize("num_groups", [32, 64])
def test_measured_cost_takes_the_samples_of_a_rollout(num_groups):
    """STEP_COST as measured, for Qwen3-0.6B's heads on the H200 (the prefix pass's tiles of 32 rows, 33
    programs a kv head: ops.cascade.PrefixPass.of there): a full step of an engine of 16 x num_groups rows, in
    num_groups groups of 16 samples sharing 1,024-token prompts, each with ~256 tokens of its own, takes every
    group (a policy of MAX_CASCADE_GROUPS, the engine's size not given, only the first 32); 64 rows of 2
    samples sharing 16 tokens take none."""
    h200 = PrefixPass(block_q=32, block_n=64, align=1, programs=33)
    auto = CascadePolicy.for_mode("auto", torch.device("cuda"), 4096, h200, max_num_seqs=16 * num_groups)
    block_size, prompt_blocks, own_blocks = 16, 64, 16
    tables, lens = [], []
    for g in range(num_groups):
        for r in range(16):
            own = [10_000 + (g * 16 + r) * own_blocks + b for b in range(own_blocks)]
            tables.append([g * prompt_blocks + b for b in range(prompt_blocks)] + own)
            lens.append((prompt_blocks + own_blocks) * block_size - r)
    tables, lens = np.array(tables, dtype=np.int32), np.array(lens, dtype=np.int32)
    found = find_prefix_groups(tables, lens, block_size, auto)
    assert found is not None and found.shared_rows == 16 * num_groups and len(found.group_prefix_lens) == num_groups
    assert (found.group_prefix_lens == prompt_blocks * block_size).all()
    unsized = find_prefix_groups(tables, lens, block_size, CascadePolicy.for_mode("auto", torch.device("cuda"), 4096,
                                                                                   h200))
    assert unsized.shared_rows == 16 * min(num_groups, MAX_CASCADE_GROUPS)
    pairs = [[p // 2 * 5, 1000 + p] for p in range(64)]  # rows 2k and 2k + 1 share one block
    assert find_prefix_groups(np.array(pairs, dtype=np.int32), np.full(64, 17, dtype=np.int32), 16, auto) is None


def oracle(tables, lens, block_size, policy):
    """The groups, row by row: runs of rows with the same first block, each column checked on every member."""
    n, runs, start = len(lens), [], 0
    for row in range(1, n + 1):
        if row == n or tables[row][0] != tables[start][0]:
            runs.append((start, row))
            start = row
    found = []
    for start, end in runs:
        if end - start < max(policy.min_rows, 2):
            continue
        cap, k = min(lens[r] // block_size for r in range(start, end)), 0
        while k < cap and all(tables[r][k] == tables[start][k] for r in range(start, end)):
            k += 1
        if k * block_size >= max(policy.min_prefix_tokens, 1):
            found.append((start, end, k * block_size))
    found = sorted(sorted(found, key=lambda g: -(g[1] - g[0] - 1) * g[2])[:policy.max_groups])
    if not found:
        return None
    cu, prefixes, shared = [0], [], 0
    for start, end, prefix in found:
        if start > cu[-1]:
            cu.append(start), prefixes.append(0)
        cu.append(end), prefixes.append(prefix)
        shared += end - start
    return cu, prefixes, shared


@st.composite
def decode_rows(draw):
    """Rows that take a random number of leading blocks of one of three chains, then blocks of their own."""
    block_size, width = draw(st.sampled_from([1, 2, 4])), 6
    chains = [list(range(c * width, (c + 1) * width)) for c in range(3)]
    own = iter(range(3 * width, 1000))
    tables, lens = [], []
    for _ in range(draw(st.integers(1, 12))):
        num_blocks = draw(st.integers(1, width))
        shared = draw(st.integers(0, num_blocks))
        table = draw(st.sampled_from(chains))[:shared] + [next(own) for _ in range(num_blocks - shared)]
        tables.append(table + [-1] * (width - num_blocks))
        lens.append(draw(st.integers((num_blocks - 1) * block_size + 1, num_blocks * block_size)))
    policy = CascadePolicy(draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 3, 8])), draw(st.integers(1, 3)))
    return tables, lens, block_size, policy


@settings(max_examples=300, deadline=None)
@given(decode_rows())
def test_groups_match_brute_force(rows):
    tables, lens, block_size, policy = rows
    found = groups_of(policy, tables, lens, block_size)
    assert found == oracle(tables, lens, block_size, policy)
    if found is not None:
        cu, prefixes, _ = found
        assert len(prefixes) <= policy.max_entries
        as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        check_cascade_groups(as_int(tables), as_int(lens), as_int(cu), as_int(prefixes), block_size)

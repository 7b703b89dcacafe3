"""engine/prefix_groups.py: a hand-computed example, and a property test against a brute-force oracle
(pure Python over rows) whose results must also satisfy the op's own group check."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.prefix_groups import CascadePolicy, find_prefix_groups
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


def test_policy_for_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert CascadePolicy.for_mode("off", cuda) is None and CascadePolicy.for_mode("auto", cpu) is None
    assert CascadePolicy.for_mode("on", cpu) == ON
    auto = CascadePolicy.for_mode("auto", cuda)
    assert auto.min_rows >= 2 and auto.min_prefix_tokens >= 1 and auto.max_entries == 2 * auto.max_groups


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

"""Slurm hostlist and tasks-per-node expansion, including the shapes real clusters emit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc.runtime.hostlist import expand_hostlist, expand_tasks_per_node


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("node1", ("node1",)),
        ("gpu-a[01-03,07],gpu-b9", ("gpu-a01", "gpu-a02", "gpu-a03", "gpu-a07", "gpu-b9")),
        ("n[08-11]", ("n08", "n09", "n10", "n11")),
        ("n[8-11]", ("n8", "n9", "n10", "n11")),
        ("n[098-101]", ("n098", "n099", "n100", "n101")),
        ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
        ("n[3]", ("n3",)),
        ("n[1,3-4,9]", ("n1", "n3", "n4", "n9")),
        ("n[1-2]x", ("n1x", "n2x")),
        ("[1-2]", ("1", "2")),
        ("a,b[1-2],c", ("a", "b1", "b2", "c")),
        ("n[5-5]", ("n5",)),
        ("node-0.cluster.local", ("node-0.cluster.local",)),
    ],
)
def test_expand_hostlist(expr: str, expected: tuple[str, ...]) -> None:
    assert expand_hostlist(expr) == expected


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("", "empty hostlist"),
        ("n[1-3", "unclosed"),
        ("n1-3]", "unbalanced"),
        ("n[1-[2]]", "nested"),
        ("n[5-3]", "reversed range '5-3'"),
        ("n[a-c]", "bad range 'a-c'"),
        ("n[1-]", "bad range '1-'"),
        ("n[-1]", "bad range '-1'"),
        ("n[]", "bad range ''"),
        ("n[1,,2]", "bad range ''"),
        ("n[+1]", "bad range"),
        ("a,,b", "empty host name"),
        ("a,", "empty host name"),
        (",a", "empty host name"),
        ("a b", "whitespace"),
    ],
)
def test_expand_hostlist_rejects_malformed(expr: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        expand_hostlist(expr)


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("4", (4,)),
        ("2(x3),1", (2, 2, 2, 1)),
        ("1,2(x2),3", (1, 2, 2, 3)),
        ("8(x1)", (8,)),
    ],
)
def test_expand_tasks_per_node(expr: str, expected: tuple[int, ...]) -> None:
    assert expand_tasks_per_node(expr) == expected


@pytest.mark.parametrize(
    "expr", ["", "x", "2(x)", "2(3)", "2x3", "(x3)", "2(x3", "2,,1", "0", "2(x0)", "-1", " 2"]
)
def test_expand_tasks_per_node_rejects_malformed(expr: str) -> None:
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_tasks_per_node(expr)


_prefixes = st.text(alphabet="abcxyz-.", max_size=6)
_ranges = st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 20)), min_size=1, max_size=5)


@given(prefix=_prefixes, suffix=_prefixes, ranges=_ranges, width=st.integers(1, 5))
def test_bracket_expression_expands_every_range_in_order(
    prefix: str, suffix: str, ranges: list[tuple[int, int]], width: int
) -> None:
    elements = [
        f"{start:0{width}d}" if length == 0 else f"{start:0{width}d}-{start + length:0{width}d}"
        for start, length in ranges
    ]
    expected = tuple(
        f"{prefix}{number:0{width}d}{suffix}"
        for start, length in ranges
        for number in range(start, start + length + 1)
    )
    assert expand_hostlist(f"{prefix}[{','.join(elements)}]{suffix}") == expected


_hostnames = st.text(alphabet="abcdefgh0123456789-.", min_size=1, max_size=10)


@given(st.lists(_hostnames, min_size=1, max_size=8))
def test_plain_hostnames_expand_to_themselves(hosts: list[str]) -> None:
    assert expand_hostlist(",".join(hosts)) == tuple(hosts)


@given(
    st.lists(st.integers(1, 16), min_size=1, max_size=4),
    st.lists(st.integers(1, 16), min_size=1, max_size=4),
)
def test_two_groups_expand_as_cartesian_product(outer: list[int], inner: list[int]) -> None:
    expr = f"r[{','.join(map(str, outer))}]n[{','.join(map(str, inner))}]"
    assert expand_hostlist(expr) == tuple(f"r{a}n{b}" for a in outer for b in inner)


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 5)), min_size=1, max_size=6))
def test_tasks_per_node_repeats_each_count(entries: list[tuple[int, int]]) -> None:
    expr = ",".join(
        str(count) if repeat == 1 else f"{count}(x{repeat})" for count, repeat in entries
    )
    expected = tuple(count for count, repeat in entries for _ in range(repeat))
    assert expand_tasks_per_node(expr) == expected


@pytest.mark.parametrize(("expand", "expr", "complaint"), [
    (expand_hostlist, "node[1-99999999]", "names 99,999,999 hosts, more than any cluster has (1,048,576)"),
    (expand_hostlist, "a[1-1000]b[1-1000]c[1-10]", "names 10,000,000 hosts"),
    (expand_tasks_per_node, "2(x999999999999)", "names 999,999,999,999 nodes"),
])
def test_a_list_naming_more_than_any_cluster_is_refused_before_it_is_expanded(expand, expr: str,
                                                                               complaint: str) -> None:
    """Expanded first, such a list took a rank's memory and minutes (100M names: about 17 GiB) or a MemoryError."""
    with pytest.raises(ValueError) as refused:
        expand(expr)
    assert complaint in str(refused.value)
    assert len(expand_hostlist("n[1-1024]x[1-1024]")) == 1 << 20  # the limit itself still expands

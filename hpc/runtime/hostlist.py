"""Expansion of Slurm's compressed node and task lists.

Slurm hands every task its allocation in compressed form (``gpu-a[01-03,07]``,
``4(x2),1``) to keep the environment small; ranks need the plain lists to agree
on node order and on how many tasks share their node. Standard library only, so
that importing it never costs a launch its start-up time.
"""

from __future__ import annotations

import itertools
import math
import re

_BRACKET_GROUP = re.compile(r"(\[[^\[\]]*\])")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS_ENTRY = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
MAX_HOSTS = 1 << 20  # far beyond any Slurm cluster; a list naming more is damage, refused before it is expanded


def expand_hostlist(expr: str) -> tuple[str, ...]:
    """Expand a hostlist such as ``gpu-a[01-03,07],gpu-b9`` in Slurm's node order.

    Zero padding is kept (``[08-11]`` gives ``08 .. 11``) because it is part of
    the hostname. Several bracket groups in one name expand as a cartesian
    product with the leftmost group varying slowest, as Slurm does.
    """
    if not expr:
        raise ValueError("empty hostlist expression")
    items = [[_bracket_ranges(part[1:-1], expr) if part.startswith("[") else part
              for part in _BRACKET_GROUP.split(item)] for item in _split_top_level(expr)]
    _check_count(sum(math.prod(map(_size, parts)) for parts in items), "hosts", expr)
    return tuple("".join(pieces) for parts in items for pieces in itertools.product(*map(_expand_group, parts)))


def expand_tasks_per_node(expr: str) -> tuple[int, ...]:
    """Expand ``SLURM_TASKS_PER_NODE``-style counts such as ``2(x3),1`` to ``(2, 2, 2, 1)``."""
    if not expr:
        raise ValueError("empty tasks-per-node expression")
    entries: list[tuple[int, int]] = []
    for entry in expr.split(","):
        match = _TASKS_ENTRY.fullmatch(entry)
        if match is None:
            raise ValueError(f"bad entry {entry!r} in tasks-per-node {expr!r}; expected N or N(xM)")
        count, repeat = int(match[1]), int(match[2] or 1)
        if count == 0 or repeat == 0:
            raise ValueError(f"entry {entry!r} in tasks-per-node {expr!r} must be positive")
        entries.append((count, repeat))
    _check_count(sum(repeat for _, repeat in entries), "nodes", expr)
    return tuple(count for count, repeat in entries for _ in range(repeat))


def _check_count(count: int, what: str, expr: str) -> None:
    if count > MAX_HOSTS:
        raise ValueError(f"{expr[:80]!r} names {count:,} {what}, more than any cluster has ({MAX_HOSTS:,})")


def _split_top_level(expr: str) -> list[str]:
    """Split on commas outside brackets, since commas inside brackets separate ranges."""
    items: list[str] = []
    start = 0
    inside_brackets = False
    for position, char in enumerate(expr):
        if char.isspace():
            raise ValueError(f"whitespace at position {position} in hostlist {expr!r}")
        if char == "[":
            if inside_brackets:
                raise ValueError(f"nested '[' at position {position} in hostlist {expr!r}")
            inside_brackets = True
        elif char == "]":
            if not inside_brackets:
                raise ValueError(f"unbalanced ']' at position {position} in hostlist {expr!r}")
            inside_brackets = False
        elif char == "," and not inside_brackets:
            items.append(expr[start:position])
            start = position + 1
    if inside_brackets:
        raise ValueError(f"unclosed '[' in hostlist {expr!r}")
    items.append(expr[start:])
    if "" in items:
        raise ValueError(f"empty host name in hostlist {expr!r}")
    return items


def _bracket_ranges(group: str, expr: str) -> list[tuple[int, int, int]]:
    """A bracket group's ranges as (low, high, zero-padded width), checked."""
    ranges = []
    for element in group.split(","):
        match = _RANGE.fullmatch(element)
        if match is None:
            raise ValueError(f"bad range {element!r} in hostlist {expr!r}; expected N or N-M")
        low_text, high_text = match[1], match[2] or match[1]
        low, high = int(low_text), int(high_text)
        if low > high:
            raise ValueError(f"reversed range {element!r} in hostlist {expr!r}")
        ranges.append((low, high, len(low_text)))
    return ranges


def _size(part: str | list[tuple[int, int, int]]) -> int:
    """How many names a part of a name stands for: plain text one, a bracket group each number of its ranges."""
    return 1 if isinstance(part, str) else sum(high - low + 1 for low, high, _ in part)


def _expand_group(part: str | list[tuple[int, int, int]]) -> list[str]:
    """A part of a name: itself (plain text), or every number of its ranges, zero padded."""
    return [part] if isinstance(part, str) else [
        f"{number:0{width}d}" for low, high, width in part for number in range(low, high + 1)]

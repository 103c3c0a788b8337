"""Sizes and tables as people read them, the same in every command's output (ckpt, status, bench, report, plots)."""

from __future__ import annotations

import re
from collections.abc import Sequence

SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_SIZE = (1 << 63) - 1  # the most bytes a file offset or a tensor's element count can hold


def human_bytes(nbytes: float) -> str:
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if nbytes < 1024:
            break
        nbytes, unit = nbytes / 1024, bigger
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.1f} {unit}"


def parse_size(text: str) -> int:
    """``64M`` -> 67108864; a bare number is bytes. An unknown unit, a negative or a too large number is named
    as such, not only as "not a size"."""
    match = re.fullmatch(r"(-?)(\d+)([A-Z]?B?)", text.strip().upper())
    if not match or int(match[2]) == 0:
        raise ValueError(f"{text!r} is not a size like 1K, 64M or 4096")
    unit = match[3].removesuffix("B")
    if unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size like 1K, 64M or 4096: the units are K, M and G, not {unit}")
    if match[1]:
        raise ValueError(f"{text!r} is negative: a size is a byte count like 1K, 64M or 4096")
    nbytes = int(match[2]) * SIZE_UNITS[unit]
    if nbytes > MAX_SIZE:
        raise ValueError(f"{text!r} is too large: a size is at most 2^63 - 1 bytes")
    return nbytes


def human_size(nbytes: int) -> str:
    """The inverse of :func:`parse_size` where it is exact (``64M``), else the byte count."""
    for unit in ("G", "M", "K"):
        if nbytes >= SIZE_UNITS[unit] and nbytes % SIZE_UNITS[unit] == 0:
            return f"{nbytes // SIZE_UNITS[unit]}{unit}"
    return str(nbytes)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], right: bool = False) -> str:
    """Columns as wide as their widest cell, two spaces apart; left-aligned, or right-aligned for numbers."""
    cells = [[str(cell) for cell in row] for row in (header, *rows)]
    widths = [max(len(cell) for cell in column) for column in zip(*cells, strict=True)]
    align = str.rjust if right else str.ljust
    return "\n".join("  ".join(align(cell, w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells)

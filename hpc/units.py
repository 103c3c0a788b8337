"""Sizes as people read them, the same in every command's output (ckpt, report, plots)."""

from __future__ import annotations


def human_bytes(nbytes: float) -> str:
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if nbytes < 1024:
            break
        nbytes, unit = nbytes / 1024, bigger
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.1f} {unit}"

"""The files of a run directory (``<job.run_dir>/<job.name>``) and the small helpers that write and read them.

Ranks write them, ``hpc status``/``hpc report``/sweeps read them, from a login node too:
stdlib only, so that reading a run never imports torch, numpy or h5py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"  # rank 0: one JSON object per step
RANKS_DIR = "ranks"  # every rank's totals, ranks/rank-XXXXX.json, written when a run ends
TIMELINE_FILE = "timeline.json"  # the Chrome trace of every rank, with train.timeline
RESULT_FILE = "result.json"  # the final measures, written by hpc-rank; sweeps rank tasks by them


def write_json(path: Path, value: Any) -> None:
    """A small JSON file that appears whole or not at all, its content already on disk."""
    partial = path.with_name(path.name + ".part")
    with open(partial, "w") as handle:
        json.dump(value, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def last_metrics(run_path: Path) -> dict | None:
    """The last step rank 0 logged, or None before the first."""
    path = run_path / METRICS_FILE
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # the first line read may be cut, the last one half written
            continue
    return None


def read_result(run_path: Path) -> dict | None:
    path = run_path / RESULT_FILE
    return json.loads(path.read_text()) if path.exists() else None

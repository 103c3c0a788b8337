"""Per-rank spans for a Chrome-trace timeline of the whole job (Horovod's timeline, for every rank).

Each rank records complete events ("ph": "X") in memory, with times measured from
an instant all ranks share (``start``, taken right after a barrier, so clocks of
different hosts need not agree), and writes them to ``timeline/rank-XXXXX.json``
in the run directory at the end; rank 0 then merges every rank's file into one
``timeline.json`` that chrome://tracing and https://ui.perfetto.dev open, one
process row per rank and one thread row per thread (training loop, communication).
The format is the Trace Event Format's JSON object form.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from hpc.rundir import TIMELINE_FILE

MAX_EVENTS = 1_000_000  # per rank: a runaway job's timeline stops growing rather than filling memory
RANK_DIR = "timeline"


class Timeline:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, object]] = []
        self._origin_ns = time.perf_counter_ns()
        self._threads: dict[int, str] = {}

    def start(self) -> None:
        """Make now time zero: call it on every rank right after a barrier."""
        self._origin_ns = time.perf_counter_ns()
        self.events.clear()

    def now_us(self) -> float:
        return (time.perf_counter_ns() - self._origin_ns) / 1000

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: object) -> Iterator[None]:
        begin = self.now_us()
        try:
            yield
        finally:
            self.add(name, cat, begin, self.now_us() - begin, args)

    def add(self, name: str, cat: str, begin_us: float, duration_us: float, args: dict[str, object]) -> None:
        if len(self.events) >= MAX_EVENTS:
            return
        thread = threading.current_thread()
        self._threads.setdefault(thread.ident or 0, thread.name)
        self.events.append({"name": name, "cat": cat, "ph": "X", "ts": round(begin_us, 3),
                            "dur": round(duration_us, 3), "pid": self.rank, "tid": thread.ident or 0, "args": args})

    def metadata(self) -> list[dict[str, object]]:
        """Row names: "rank R (host)" per process, the thread's name per thread."""
        rows: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": self.rank,
                                          "args": {"name": f"rank {self.rank} ({socket.gethostname()})"}},
                                         {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                                          "args": {"sort_index": self.rank}}]
        for tid, name in self._threads.items():
            rows.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"name": "training loop" if name == "MainThread" else name}})
        return rows

    def write_rank_file(self, run_dir: Path) -> Path:
        path = run_dir / RANK_DIR / f"rank-{self.rank:05d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.metadata() + self.events))
        return path


def merge_rank_files(run_dir: Path, world_size: int) -> Path:
    """Join every rank's events into ``run_dir/timeline.json`` (rank 0, after a barrier)."""
    events: list[object] = []
    for rank in range(world_size):
        events.extend(json.loads((run_dir / RANK_DIR / f"rank-{rank:05d}.json").read_text()))
    path = run_dir / TIMELINE_FILE
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


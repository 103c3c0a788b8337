"""Stall inspector: name the ranks a collective waits for, then abort instead of hanging.

Gloo and NCCL block until their timeout (minutes) and then say only that an
operation timed out, not who failed to join it (nccl #1260, #1324). Horovod's
coordinator knows who has not submitted a tensor; we have no coordinator, so each
rank counts the operations it has entered on each *channel* (one process group's
collectives, or one direction of a point-to-point link: peers enter a channel's
operations in the same order) and a background thread publishes those counts, the
step and what the rank is doing to the job's TCP store every ``interval_s``. A rank
that has waited in operation n of channel c for ``warn_s`` reads its peers'
entries: a peer whose count on c is below n has not arrived, and the report says
where that peer is instead. Past ``abort_s`` the report becomes the rank's last
words: it exits at once (``os._exit``; the blocked thread is inside the backend and
cannot be interrupted) and the launcher takes the job down, long before the
backend's own timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hpc.rundir import STALL_EXIT  # a stalled rank's exit status (PREEMPTED_EXIT is 75); hpc status reads it too

KEY_PREFIX = "hpc/stall/rank-"
SILENT_AFTER_INTERVALS = 5  # a peer whose entry is older than this many intervals is presumed dead or frozen
STORE_TIMEOUT_S = 5.0  # a frozen store host must not hold a report (and the abort) for long


@dataclass
class Wait:
    op: str
    channel: str
    number: int  # this is the channel's number-th operation on this rank
    peers: tuple[int, ...]
    since: float  # time.monotonic()
    abort_s: float
    next_warning: float = field(default=0.0)  # seconds waited at which to warn next


def _exit_now(report: str) -> NoReturn:
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(STALL_EXIT)


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StallWatch:
    """One rank's side of the inspector; ``store`` is any object with torch's Store set/get/check."""

    def __init__(
        self, store: Any, rank: int, warn_s: float, abort_s: float, *, interval_s: float | None = None,
        log: Callable[[str], None] = _print, on_abort: Callable[[str], object] = _exit_now,
    ) -> None:
        self.store, self.rank, self.warn_s, self.abort_s = store, rank, warn_s, abort_s
        self.interval_s = interval_s if interval_s is not None else min(5.0, warn_s / 4)
        self.log, self.on_abort = log, on_abort
        self.step = 0
        self._activity = ("starting", time.monotonic())
        self._counts: dict[str, int] = {}
        self._waits: dict[int, Wait] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpc-stall-watch", daemon=True)
        self._host = socket.gethostname()
        self._store_error: str | None = None

    @classmethod
    def connect(cls, addr: str, port: int, rank: int, warn_s: float, abort_s: float) -> StallWatch:
        """A watch on its own client connection to the job's store, so it never queues behind the job's."""
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return cls(store, rank, warn_s, abort_s)

    def __enter__(self) -> StallWatch:
        self._publish()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def doing(self, activity: str) -> None:
        """What this rank is busy with, shown to peers that wait for it."""
        self._activity = (activity, time.monotonic())

    def passed(self, channel: str) -> None:
        """Count an operation that does not wait (a send): the receiver compares against it."""
        with self._lock:
            self._counts[channel] = self._counts.get(channel, 0) + 1

    @contextlib.contextmanager
    def waiting(self, op: str, channel: str, peers: Sequence[int], abort_s: float | None = None) -> Iterator[None]:
        """Around an operation that blocks until ``peers`` (global ranks) join it on ``channel``."""
        with self._lock:
            number = self._counts[channel] = self._counts.get(channel, 0) + 1
            wait = Wait(op, channel, number, tuple(p for p in peers if p != self.rank), time.monotonic(),
                        abort_s if abort_s is not None else self.abort_s, next_warning=self.warn_s)
            self._waits[id(wait)] = wait
        try:
            yield
        finally:
            with self._lock:
                del self._waits[id(wait)]

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._publish()
            self.inspect()

    def _state(self) -> dict[str, object]:
        activity, since = self._activity
        with self._lock:
            waits = [f"{w.op} (#{w.number} on {w.channel})" for w in self._waits.values()]
            counts = dict(self._counts)
        return {"host": self._host, "step": self.step, "doing": activity, "doing_s": time.monotonic() - since,
                "waiting": waits, "counts": counts, "at": time.time()}

    def _publish(self) -> None:
        try:
            self.store.set(f"{KEY_PREFIX}{self.rank}", json.dumps(self._state()))
        except Exception as exc:  # the store lives on rank 0: gone with it; inspect without peers
            self._store_error = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def _peer_state(self, peer: int) -> dict[str, Any] | None:
        key = f"{KEY_PREFIX}{peer}"
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception as exc:
            self._store_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return None

    def inspect(self) -> None:
        """Warn about, or abort on, every wait past its threshold (the watch thread calls this)."""
        now = time.monotonic()
        with self._lock:
            waits = list(self._waits.values())
        for wait in waits:
            waited = now - wait.since
            if waited >= wait.abort_s:
                report = self.report(wait, waited)
                self.log(f"hpc: error: {report}; aborting the job (stall abort threshold {wait.abort_s:g} s)")
                self.on_abort(report)
                return
            if waited >= wait.next_warning:
                wait.next_warning += self.warn_s
                self.log(f"hpc: stall: {self.report(wait, waited)}")

    def report(self, wait: Wait, waited: float) -> str:
        """One line: who waits where, and who has not arrived and what they are doing instead."""
        head = (f"rank {self.rank} ({self._host}) has waited {waited:.0f} s in {wait.op} "
                f"(#{wait.number} on channel {wait.channel}) at step {self.step}")
        missing, arrived = [], []
        self._store_error = None
        for peer in wait.peers:
            state = None if self._store_error else self._peer_state(peer)  # one timeout per report at most
            if state is None:
                missing.append(f"rank {peer} (no report: never started the watch or the store is unreachable)")
            elif int(state["counts"].get(wait.channel, 0)) < wait.number:
                missing.append(f"rank {peer} ({self._describe(state)})")
            else:
                arrived.append(peer)
        if missing:
            tail = "; not arrived: " + ", ".join(missing)
        else:
            tail = f"; every peer ({', '.join(map(str, arrived))}) entered it: data is slow or lost on the link"
        if self._store_error:
            tail += f" [store: {self._store_error}]"
        return head + tail

    def _describe(self, state: dict[str, Any]) -> str:
        silent = time.time() - float(state["at"])
        where = f"{state['host']}, step {state['step']}"
        if silent > SILENT_AFTER_INTERVALS * self.interval_s:
            return f"{where}, silent for {silent:.0f} s: dead or frozen, last seen in {state['doing']}"
        doing = f"in {state['doing']} for {state['doing_s']:.0f} s"
        if state["waiting"]:
            doing += ", waiting in " + ", ".join(state["waiting"])
        return f"{where}, {doing}"

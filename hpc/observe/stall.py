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

When the backend's timeout comes first (``parallel.timeout_s`` below ``train.stall_abort_s``), the
exception it raises out of a watched operation becomes ``CollectiveStalled`` carrying the same report, so
the rank's failure record names the channel and the ranks that never entered it, not a vanished peer.

On a GPU the host only queues collectives and blocks later, on the step's CUDA event: that wait is
registered on the ``DEVICE`` channel, and its report compares every channel this rank issued on with its
peers' counts: the ranks behind on a channel never issued its last operation (group, operation, number).
A rank that aborts records its report in the run's failures directory (``connect``'s ``run_path``), so
``hpc run``, ``hpc status`` and ``hpc logs`` lead with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hpc.errors import CollectiveStalled
from hpc.rundir import STALL_EXIT  # a stalled rank's exit status (PREEMPTED_EXIT is 75); hpc status reads it too

KEY_PREFIX = "hpc/stall/rank-"
SILENT_AFTER_INTERVALS = 5  # a peer whose entry is older than this many intervals is presumed dead or frozen
STORE_TIMEOUT_S = 5.0  # a frozen store host must not hold a report (and the abort) for long
DEVICE = "device"  # the channel of the host's waits for its own device to finish queued work
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)  # a backend's collective timeout (Gloo, NCCL)


@dataclass
class Wait:
    op: str
    channel: str
    number: int  # this is the channel's number-th operation on this rank
    peers: tuple[int, ...]
    since: float  # time.monotonic()
    abort_s: float
    next_warning: float = field(default=0.0)  # seconds waited at which to warn next
    thread: int = 0  # the waiting thread's ident: its stack goes into the abort's record
    next_look: float = 0.0  # seconds waited at which to look again whether to abort (a device merely slow)


def _where(wait: Wait) -> str:
    """``in all-reduce (#14 on channel tp group [0, 1])``, or ``for the device (step 2)``."""
    if wait.channel == DEVICE:
        return f"for {wait.op}"
    return f"in {wait.op} (#{wait.number} on channel {wait.channel})"


def _exit_now(report: str) -> NoReturn:
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(STALL_EXIT)


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StallWatch:
    """One rank's side of the inspector; ``store`` is any object with torch's Store set/get/check; ``run_path``:
    where an abort records its report (hpc/runtime/abort.py), None: nowhere."""

    def __init__(
        self, store: Any, rank: int, warn_s: float, abort_s: float, *, interval_s: float | None = None,
        log: Callable[[str], None] = _print, on_abort: Callable[[str], object] = _exit_now,
        run_path: Path | None = None,
    ) -> None:
        self.store, self.rank, self.warn_s, self.abort_s = store, rank, warn_s, abort_s
        self.interval_s = interval_s if interval_s is not None else min(5.0, warn_s / 4)
        self.log, self.on_abort, self.run_path = log, on_abort, run_path
        self.step = 0
        self._activity = ("starting", time.monotonic())
        self._counts: dict[str, int] = {}
        self._last: dict[str, str] = {}  # channel -> the operation entered last on it
        self._members: dict[str, tuple[int, ...]] = {}  # channel -> its other ranks, as waits named them
        self._waits: dict[int, Wait] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpc-stall-watch", daemon=True)
        self._host = socket.gethostname()

    @classmethod
    def connect(cls, addr: str, port: int, rank: int, warn_s: float, abort_s: float,
                run_path: Path | None = None) -> StallWatch:
        """A watch on its own client connection to the job's store, so it never queues behind the job's."""
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return cls(store, rank, warn_s, abort_s, run_path=run_path)

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
        """Around an operation that blocks until ``peers`` (global ranks) join it on ``channel`` (on a GPU: until
        it is queued). A backend's timeout raised inside becomes ``CollectiveStalled`` naming who never came."""
        with self._lock:
            number = self._counts[channel] = self._counts.get(channel, 0) + 1
            wait = Wait(op, channel, number, tuple(p for p in peers if p != self.rank), time.monotonic(),
                        abort_s if abort_s is not None else self.abort_s, next_warning=self.warn_s,
                        thread=threading.get_ident())
            self._last[channel] = op
            if wait.peers:
                self._members[channel] = wait.peers
            self._waits[id(wait)] = wait
        try:
            yield
        except Exception as exc:
            if isinstance(exc, CollectiveStalled) or not TIMED_OUT.search(str(exc)):
                raise
            cause = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            report = self.report(wait, time.monotonic() - wait.since)
            raise CollectiveStalled(f"{report}; the backend timed out ({type(exc).__name__}: {cause})") from exc
        finally:
            with self._lock:
                del self._waits[id(wait)]

    def device(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Around the host's wait for its device to finish step ``step``'s queued work (a CUDA event)."""
        return self.waiting(f"the device (step {step})", DEVICE, ())

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._publish()
            self.inspect()

    def _state(self) -> dict[str, object]:
        activity, since = self._activity
        with self._lock:
            waits = [_where(w) for w in self._waits.values()]
            counts, last = dict(self._counts), dict(self._last)
        return {"host": self._host, "step": self.step, "doing": activity, "doing_s": time.monotonic() - since,
                "waiting": waits, "counts": counts, "last": last, "at": time.time()}

    def _publish(self) -> None:
        try:
            self.store.set(f"{KEY_PREFIX}{self.rank}", json.dumps(self._state()))
        except Exception:  # the store lives on rank 0: gone with it; a report says so when it reads peers
            pass

    def _peer_states(self, peers: Sequence[int]) -> tuple[dict[int, dict[str, Any] | None], str | None]:
        """Each peer's last published state (None: none), and the store's error, which ends the reading (one
        timeout per report at most)."""
        states: dict[int, dict[str, Any] | None] = {}
        for peer in peers:
            key = f"{KEY_PREFIX}{peer}"
            try:
                states[peer] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception as exc:
                return {**states, **dict.fromkeys(peers[len(states):])}, f"{type(exc).__name__}: {exc}".splitlines()[0]
        return states, None

    def inspect(self) -> None:
        """Warn about, or abort on, every wait past its threshold (the watch thread calls this)."""
        now = time.monotonic()
        with self._lock:
            waits = list(self._waits.values())
        for wait in waits:
            waited, report = now - wait.since, None
            if waited >= max(wait.abort_s, wait.next_look):
                report, conclusive = self._report(wait, waited)
                if conclusive:
                    self.log(f"hpc: error: {report}; aborting the job (stall abort threshold {wait.abort_s:g} s)")
                    self._record(f"{report}; aborted the job (stall abort threshold {wait.abort_s:g} s)", wait)
                    self.on_abort(report)
                    return
                wait.next_look = waited + self.warn_s
            if waited >= wait.next_warning:
                wait.next_warning += self.warn_s
                self.log(f"hpc: stall: {report or self.report(wait, waited)}")

    def _record(self, report: str, wait: Wait) -> None:
        """The report as this rank's failure record, which ``hpc run``, ``hpc status`` and ``hpc logs`` lead with;
        its traceback is where the waiting thread is blocked."""
        if self.run_path is None:
            return
        from hpc.runtime.abort import record_failure

        frame = sys._current_frames().get(wait.thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        stack = f"Waiting in (most recent call last):\n{stack}{CollectiveStalled.__name__}: {report}\n"
        blamed = [] if wait.channel == DEVICE else [
            state["host"] for state in self._peer_states(wait.peers)[0].values() if state and _behind(state, wait)]
        record_failure(self.run_path, CollectiveStalled(report), step=self.step, traceback_text=stack,
                       blamed_hosts=blamed)

    def report(self, wait: Wait, waited: float) -> str:
        """One line: who waits where, and who has not arrived and what they are doing instead."""
        return self._report(wait, waited)[0]

    def _report(self, wait: Wait, waited: float) -> tuple[str, bool]:
        """The report, and whether it is worth aborting for: always, but for a wait on the device whose peers
        all issued as much as this rank (the device is slow, or stuck where the backend's timeout will end it)."""
        head = f"rank {self.rank} ({self._host}) has waited {waited:.0f} s {_where(wait)} at step {self.step}"
        if wait.channel == DEVICE:
            tail, conclusive = self._device_tail()
            return head + tail, conclusive
        return head + self._peers_tail(wait), True

    def _peers_tail(self, wait: Wait) -> str:
        states, store_error = self._peer_states(wait.peers)
        missing, arrived = [], []
        for peer, state in states.items():
            if state is None:
                missing.append(f"rank {peer} (no report: never started the watch or the store is unreachable)")
            elif _behind(state, wait):
                missing.append(f"rank {peer} ({self._describe(state)})")
            else:
                arrived.append(peer)
        if missing:
            tail = "; not arrived: " + ", ".join(missing)
        else:
            tail = f"; every peer ({', '.join(map(str, arrived))}) entered it: data is slow or lost on the link"
        return tail + (f" [store: {store_error}]" if store_error else "")

    def _device_tail(self) -> tuple[str, bool]:
        """For a wait on the device: per channel, the ranks that never issued its last operation (what a rank
        that skipped a collective leaves behind), then what this rank issued last on each channel."""
        with self._lock:
            counts, last, members = dict(self._counts), dict(self._last), dict(self._members)
        states, store_error = self._peer_states(sorted({peer for peers in members.values() for peer in peers}))
        behind = []
        for channel, peers in members.items():
            seen = {self.rank: (counts.get(channel, 0), last.get(channel, "?"))}
            seen |= {peer: (int(states[peer]["counts"].get(channel, 0)), states[peer].get("last", {}).get(channel, "?"))
                     for peer in peers if states.get(peer) is not None}
            top = max(number for number, _ in seen.values())
            late = [rank for rank, (number, _) in sorted(seen.items()) if number < top]
            if late:
                op = next(name for number, name in seen.values() if number == top)
                who = ", ".join(f"rank {r} (this rank)" if r == self.rank else f"rank {r} ({self._describe(states[r])})"
                                for r in late)
                behind.append(f"not arrived in {op} (#{top} on channel {channel}): {who}")
        silent = [peer for peer, state in states.items() if state is None]
        tail = "; " + "; ".join(behind) if behind else (
            "; every peer issued as many operations on every channel: the device is slow, or stuck in a collective "
            "every rank entered (parallel.timeout_s ends that)")
        tail += f"; no report from {', '.join(f'rank {p}' for p in silent)}" if silent else ""
        issued = [f"{last[c]} (#{counts[c]} on channel {c})" for c in last if c != DEVICE]
        tail += f"; last issued: {', '.join(issued)}" if issued else ""
        return tail + (f" [store: {store_error}]" if store_error else ""), bool(behind or silent)

    def _describe(self, state: dict[str, Any]) -> str:
        silent = time.time() - float(state["at"])
        where = f"{state['host']}, step {state['step']}"
        if silent > SILENT_AFTER_INTERVALS * self.interval_s:
            return f"{where}, silent for {silent:.0f} s: dead or frozen, last seen in {state['doing']}"
        doing = f"in {state['doing']} for {state['doing_s']:.0f} s"
        if state["waiting"]:
            doing += ", waiting " + ", ".join(state["waiting"])
        return f"{where}, {doing}"


def _behind(state: dict[str, Any], wait: Wait) -> bool:
    """Whether a peer's last report has it short of the operation ``wait`` is in: it never arrived."""
    return int(state["counts"].get(wait.channel, 0)) < wait.number

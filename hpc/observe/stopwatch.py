"""Durations on the clock of the device doing the work: CUDA events on a GPU, the host clock elsewhere.

On a GPU the host only queues kernels. A host clock around ``loss.backward()`` measures how long the
queuing took, not the backward; an NCCL wait returns at once while the stream waits. So on a GPU each
region is bounded by two events recorded on the stream that runs it, and the elapsed time is read
after the training step's one host synchronization has passed them: reading costs no synchronization
of its own. On the CPU the host clock is the device's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Stopwatch:
    """Sums the durations of regions timed on one device (``timing()``, or ``mark()``s given to ``add``).

    A CUDA mark is an event recorded on the calling thread's current stream: the region is timed on that
    stream (a communication thread inside its own stream times the communication). ``seconds()`` waits
    for the last event of each region, so it reads at once only after the work was synchronized."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self._host = 0.0
        self._regions: list[tuple[object, object]] = []

    def mark(self) -> object:
        """Now on this device: an event on the current stream on a GPU, else the host clock."""
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, start: object, end: object | None = None) -> None:
        """The region from ``start`` to ``end`` (default: now), both from ``mark()``."""
        end = self.mark() if end is None else end
        if self.cuda:
            self._regions.append((start, end))
        else:
            self._host += end - start

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        start = self.mark()
        yield
        self.add(start)

    def seconds(self) -> float:
        """The regions' total so far (resolving the events, once they are done)."""
        for start, end in self._regions:
            end.synchronize()
            self._host += start.elapsed_time(end) / 1e3
        self._regions.clear()
        return self._host

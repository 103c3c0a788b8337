"""The one object instrumented code reports to: timeline spans and stall tracking, each optional.

The training loop, the DP optimizer and the pipeline executor take a ``Probe``
argument and call ``span`` around work and ``collective`` around operations that
wait for peers; the probe fans that out to the timeline (hpc/observe/timeline.py) and the
stall inspector (hpc/observe/stall.py) when the run enabled them, and does nothing
otherwise, so library code needs no conditionals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from hpc.observe.stall import StallWatch
from hpc.observe.timeline import Timeline


class Probe:
    def __init__(self, timeline: Timeline | None = None, stall: StallWatch | None = None) -> None:
        self.timeline, self.stall = timeline, stall
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = step
        if self.stall is not None:
            self.stall.step = step

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args: object) -> Iterator[None]:
        """Work this rank does itself; peers waiting for it are told its name."""
        if self.stall is not None:
            self.stall.doing(name)
        if self.timeline is None:
            yield
            return
        with self.timeline.span(name, cat, step=self.step, **args):
            yield

    @contextlib.contextmanager
    def collective(
        self, name: str, channel: str, peers: Sequence[int], abort_s: float | None = None, **args: object
    ) -> Iterator[None]:
        """An operation that waits for ``peers`` (global ranks); peers enter a channel's operations in one order."""
        with contextlib.ExitStack() as stack:
            if self.stall is not None:
                stack.enter_context(self.stall.waiting(name, channel, peers, abort_s))
            if self.timeline is not None:
                stack.enter_context(self.timeline.span(name, "comm", step=self.step, channel=channel, **args))
            yield

    def sent(self, name: str, channel: str, **args: object) -> None:
        """A send posted without waiting: counted for the receiver's stall report, marked on the timeline."""
        if self.stall is not None:
            self.stall.passed(channel)
        if self.timeline is not None:
            args = {"step": self.step, "channel": channel, **args}
            self.timeline.add(name, "comm", self.timeline.now_us(), 0.0, args)

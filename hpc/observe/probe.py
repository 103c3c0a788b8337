"""The one object instrumented code reports to: timeline spans and stall tracking, each optional.

The training loop, the DP optimizer and the pipeline executor take a ``Probe``
argument and call ``span`` around work and ``collective`` around operations that
wait for peers; the probe fans that out to the timeline (hpc/observe/timeline.py) and the
stall inspector (hpc/observe/stall.py) when the run enabled them, and does nothing
otherwise, so library code needs no conditionals.

Code that holds only a process group, not a probe (tensor parallelism's autograd Functions, the
vocabulary-split loss a model's ``loss`` computes, expert parallelism's all-to-alls), reports through
``group_collective(group, name)``: the run registers each of its groups with ``Probe.watch_group``
(the channel named by mesh axis and global ranks, ``tp group [4, 5]``), and the registry below maps a
group to its ``GroupWatch`` until the probe closes. It is the one module-level state here: keyed by
the group object (weakly, so a group torch drops leaves it), filled by the run that made the groups
and emptied when that run's probe closes, so a second run in the same process starts clean. A
group nobody registered costs a dictionary lookup and counts nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from hpc.observe.stall import StallWatch
from hpc.observe.timeline import Timeline


class GroupWatch:
    """One process group's collectives, counted by the stall inspector on the channel naming the group: a
    counter and a context manager per operation; the inspector's thread publishes the counts."""

    __slots__ = ("channel", "peers", "stall")

    def __init__(self, stall: StallWatch, channel: str, peers: tuple[int, ...]) -> None:
        self.stall, self.channel, self.peers = stall, channel, peers

    def op(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.stall.waiting(name, self.channel, self.peers)


_WATCHED: weakref.WeakKeyDictionary[Any, GroupWatch] = weakref.WeakKeyDictionary()  # group -> its watch


def group_channel(axis: str, ranks: Sequence[int]) -> str:
    """``tp group [4, 5]``: a group's channel, by its mesh axis and global ranks."""
    return f"{axis} group [{', '.join(map(str, ranks))}]"


def group_collective(group: Any, name: str) -> contextlib.AbstractContextManager[None]:
    """Around collective ``name`` on ``group`` (a ProcessGroup, or None): counted on the group's channel when
    the run registered it (``Probe.watch_group``), nothing otherwise, nor while Dynamo traces a compiled block
    (``is_compiling`` is a constant to it: the graph keeps only the collective, unbroken)."""
    import torch  # loaded by whoever holds a process group

    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    watch = _WATCHED.get(group) if group is not None and _WATCHED else None
    return watch.op(name) if watch is not None else contextlib.nullcontext()


class Probe:
    def __init__(self, timeline: Timeline | None = None, stall: StallWatch | None = None) -> None:
        self.timeline, self.stall = timeline, stall
        self.step = 0
        self._groups: list[Any] = []

    def __enter__(self) -> Probe:
        if self.stall is not None:
            self.stall.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        """Unregister this run's groups and stop the stall inspector."""
        for group in self._groups:
            _WATCHED.pop(group, None)
        self._groups.clear()
        if self.stall is not None:
            self.stall.__exit__(*exc)

    def watch_group(self, axis: str, group: Any, ranks: Sequence[int]) -> None:
        """Count ``group``'s collectives that library code reports through ``group_collective`` on the channel
        ``group_channel(axis, ranks)`` (``ranks``: global) until this probe closes; nothing without a stall
        inspector or for a group of one."""
        if self.stall is None or group is None or len(ranks) < 2:
            return
        _WATCHED[group] = GroupWatch(self.stall, group_channel(axis, ranks), tuple(ranks))
        self._groups.append(group)

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

    def device(self, step: int) -> contextlib.AbstractContextManager[None]:
        """The host waiting for its device to finish step ``step`` (a CUDA event): a wait on the inspector's
        device channel, whose report compares what each rank issued on every channel."""
        return self.stall.device(step) if self.stall is not None else contextlib.nullcontext()

    def sent(self, name: str, channel: str, **args: object) -> None:
        """A send posted without waiting: counted for the receiver's stall report, marked on the timeline."""
        if self.stall is not None:
            self.stall.passed(channel)
        if self.timeline is not None:
            args = {"step": self.step, "channel": channel, **args}
            self.timeline.add(name, "comm", self.timeline.now_us(), 0.0, args)

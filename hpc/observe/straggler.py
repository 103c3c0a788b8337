"""Stragglers named: a rank whose steps compute persistently slower than the median rank's.

In a synchronous job every rank waits for the slowest at each collective, so one slow GPU (thermal
throttling, a noisy neighbour, a failing HBM stack) slows the whole job without any error. Each rank
keeps the compute time of its steps (the step less its waits for communication); every
``train.straggler_every`` steps the ranks gather their medians (one all-gather of a number, collective:
every rank at the same step; a median, so that one slow step, the first's allocation or a collector's pause,
is not a slow window), and a rank above ``train.straggler_threshold`` times the median for two
windows running is named with its host and slowdown: in metrics.jsonl (``stragglers``), on rank 0's
output, and from there in ``hpc status`` and ``hpc report``.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALL_GATHER = "all_gather_single"  # torch 2.13's name, else all_gather_into_tensor (torch 2.11)
PATIENCE = 2  # windows in a row above the threshold before a rank is named: one slow window is noise


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    slowdown: float  # its median step compute over the median rank's, in the last window

    def line(self) -> str:
        return f"straggler: rank {self.rank} on {self.host} computes {self.slowdown:.2f}x the median rank's step"

    def record(self) -> dict[str, object]:
        return {"rank": self.rank, "host": self.host, "slowdown": round(self.slowdown, 3)}


def slow_ranks(times: list[float], threshold: float) -> dict[int, float]:
    """Rank -> its slowdown, for the ranks whose time is above ``threshold`` times the median rank's (pure)."""
    median = statistics.median(times)
    if median <= 0:
        return {}
    return {rank: time / median for rank, time in enumerate(times) if time > threshold * median}


class StragglerWatch:
    """This rank's step compute times and, every ``every`` steps, the ranks named (see the module)."""

    def __init__(self, every: int, threshold: float, device: torch.device) -> None:
        import torch.distributed as dist

        self.every, self.threshold, self.device = every, threshold, device
        self.seconds: list[float] = []
        self.above: dict[int, int] = {}  # rank -> windows in a row above the threshold
        self.hosts: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname())

    def add(self, compute_s: float) -> None:
        self.seconds.append(compute_s)

    def due(self, done: int) -> bool:
        return done % self.every == 0

    def check(self) -> list[Straggler]:
        """Collective over the world: the ranks named in this window (the same list on every rank)."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([statistics.median(self.seconds) if self.seconds else 0.0], device=self.device)
        medians = torch.empty(dist.get_world_size(), device=self.device)
        getattr(dist, ALL_GATHER, dist.all_gather_into_tensor)(medians, mine)
        self.seconds = []
        slow = slow_ranks(medians.tolist(), self.threshold)
        self.above = {rank: self.above.get(rank, 0) + 1 for rank in slow}
        return [Straggler(rank, self.hosts[rank], slow[rank]) for rank, windows in sorted(self.above.items())
                if windows >= PATIENCE]

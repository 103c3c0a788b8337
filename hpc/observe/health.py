"""Start-up health check: each node writes where it must and finds its GPU free; then every group of the mesh
all-reduces and passes a ring of messages, in time.

Each node first (:func:`check_nodes`, local rank 0 for the node's directories): the run directory and the node's
scratch (``$SLURM_TMPDIR``, else ``$TMPDIR``, else /tmp) take ``DISK_BYTES`` written and fsynced, at a rate it
reports; each rank's GPU, where it has one, has at least half its memory free (a leftover process holds the
rest otherwise). A node that fails raises :class:`~hpc.errors.NodeUnhealthy` naming its host and what failed,
before any training step, so a restart inside the allocation (slurm/restart.py) excludes it for a spare.

A bad NIC, a wrong interface or a straggler node is cheapest to find before the
first step, when the report can name a link rather than a training step that got
slow. For the whole world and each mesh axis with groups of more than one rank:
a small all-reduce whose sum is checked, then a ring in which every rank sends
``message_bytes`` to the next rank of its group while receiving from the previous
one, twice (the first pass pays for connection set-up); the second pass's time
measures the link previous -> this rank. Every operation runs under the stall
inspector with the health check's timeout, so a dead link aborts the job naming
the ranks that did not answer instead of hanging. The timings are gathered on
every rank; rank 0 prints the report.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import HpcError, NodeUnhealthy
from hpc.observe.probe import Probe
from hpc.rundir import node_scratch
from hpc.runtime.mesh import AXES, Mesh
from hpc.runtime.placement import carries_cuda

MESSAGE_BYTES = 1 << 20
DISK_BYTES = 8 << 20


class HealthCheckError(HpcError):
    pass


@dataclass(frozen=True)
class Link:
    axis: str
    src: int
    dst: int
    src_host: str
    dst_host: str
    seconds: float
    nbytes: int

    def __str__(self) -> str:
        rate = self.nbytes / self.seconds / 1e6 if self.seconds > 0 else float("inf")
        return (f"{self.axis} rank {self.src} -> {self.dst} ({self.src_host} -> {self.dst_host}): "
                f"{self.nbytes >> 10} KiB in {self.seconds * 1e3:.2f} ms ({rate:,.0f} MB/s)")


@dataclass(frozen=True)
class HealthReport:
    allreduce_s: dict[str, float]  # per axis: the slowest rank's all-reduce time
    links: list[Link]  # every ring link of every checked axis

    def slowest(self, axis: str | None = None) -> Link:
        return max((link for link in self.links if axis in (None, link.axis)), key=lambda link: link.seconds)

    def lines(self) -> list[str]:
        out = []
        for axis, seconds in self.allreduce_s.items():
            times = sorted(link.seconds for link in self.links if link.axis == axis)
            out.append(f"health: {axis}: all-reduce {seconds * 1e3:.2f} ms; ring median link "
                       f"{times[len(times) // 2] * 1e3:.2f} ms, slowest {self.slowest(axis)}")
        if self.links:
            out.append(f"health: slowest link overall: {self.slowest()}")
        return out


@dataclass(frozen=True)
class NodeCheck:
    """One rank's own checks: what failed (None: nothing), and the write rates it measured (local rank 0)."""

    rank: int
    host: str
    problem: str | None
    write_mbps: dict[str, float]


def _write_rate(directory: Path, rank: int) -> float:
    """MB/s of ``DISK_BYTES`` written and fsynced into a file of ``directory``, removed after; OSError if not."""
    directory.mkdir(parents=True, exist_ok=True)  # the run's first writer may be this check
    path = directory / f".hpc-health-{socket.gethostname()}-{rank}"
    started = time.perf_counter()
    try:
        with path.open("wb") as handle:
            handle.write(bytes(DISK_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        path.unlink(missing_ok=True)
    return DISK_BYTES / (time.perf_counter() - started) / 1e6


def check_node(rank: int, local_rank: int, run_path: Path, device) -> NodeCheck:
    """This rank's checks (see the module); never raises: a failure is the check's ``problem``."""
    import torch

    rates, problem = {}, None
    if local_rank == 0:
        for name, directory in (("run directory", run_path), ("scratch", node_scratch())):
            try:
                rates[name] = _write_rate(directory, rank)
            except OSError as exc:
                problem = problem or f"{name} {directory} is not writable: {exc.strerror or exc}"
    if device.type == "cuda" and problem is None:
        free, total = torch.cuda.mem_get_info(device)
        if free < total / 2:
            problem = (f"GPU {device.index} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free: another process "
                       "holds the rest?")
    return NodeCheck(rank, socket.gethostname(), problem, rates)


def check_nodes(mesh: Mesh, probe: Probe, timeout_s: float, local_rank: int, run_path: Path) -> list[str]:
    """Collective over the world: every rank's :func:`check_node`, gathered; a rank whose node failed raises
    NodeUnhealthy (its own cause), the others go on and see it leave. Returns the report's lines (rank 0 prints
    them): the slowest writes."""
    import torch.distributed as dist

    mine = check_node(mesh.rank, local_rank, run_path, mesh.device)
    checks: list[NodeCheck | None] = [None] * dist.get_world_size()
    with probe.collective("health check of the nodes", "world", range(len(checks)), abort_s=timeout_s):
        dist.all_gather_object(checks, mine)
    if mine.problem:
        raise NodeUnhealthy(f"host {mine.host} failed its health check: {mine.problem}", rank=mine.rank)
    lines = []
    for name in ("run directory", "scratch"):
        rates = [(check.write_mbps[name], check.host) for check in checks if check and name in check.write_mbps]
        if rates:
            rate, host = min(rates)
            lines.append(f"health: {name} writes: slowest {rate:,.0f} MB/s ({host}) of {len(rates)} node"
                         f"{'s' * (len(rates) > 1)}")
    return lines


SLOW_LINK_FACTOR = 4.0  # a link taking this many times its model's time fails the check


def slow_links(report: HealthReport, expected_s, factor: float = SLOW_LINK_FACTOR) -> list[tuple[Link, float]]:
    """The ring links that took more than ``factor`` times ``expected_s(link)`` (a model's time for the message
    over that link: inside a node or across), slowest first, each with that time."""
    slow = [(link, expected_s(link)) for link in report.links]
    return sorted(((link, want) for link, want in slow if link.seconds > factor * want),
                  key=lambda pair: -pair[0].seconds / pair[1])


def _groups(mesh: Mesh) -> list[tuple[str, object, tuple[int, ...]]]:
    import torch.distributed as dist

    checked = [("world", dist.group.WORLD, tuple(range(mesh.shape.size)))]
    return checked + [(axis, mesh.group(axis), mesh.members[axis]) for axis in AXES if mesh.size(axis) > 1]


def _ring_pass(group, members: tuple[int, ...], me: int, payload, received) -> float:
    """The message to the next rank and the one from the previous, as one batch: NCCL runs what a rank posts
    in order on one stream, so a send posted before the receive would wait for the next rank's receive,
    queued behind that rank's own send. The host waits for the device, so the time is the link's."""
    import torch
    import torch.distributed as dist

    position = members.index(me)
    started = time.perf_counter()
    for work in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, payload, group=group, group_peer=(position + 1) % len(members)),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(position - 1) % len(members)),
    ]):
        work.wait()
    if received.is_cuda:
        torch.cuda.current_stream(received.device).synchronize()
    return time.perf_counter() - started


def check_mesh(mesh: Mesh, probe: Probe, timeout_s: float, message_bytes: int = MESSAGE_BYTES) -> HealthReport:
    """Collective over the whole world: every rank calls it and gets the same report."""
    import torch
    import torch.distributed as dist

    groups = _groups(mesh)
    me = mesh.rank
    # the mesh's device where its backend carries it (NCCL: the links training uses), else the host (Gloo)
    device = mesh.device if carries_cuda(None) else torch.device("cpu")
    timings = torch.zeros(len(groups), 2, dtype=torch.float64, device=device)  # per group: all-reduce s, ring s
    payload = torch.ones(message_bytes // 4, dtype=torch.float32, device=device)
    received = torch.empty_like(payload)
    for row, (axis, group, members) in enumerate(groups):
        ones = torch.ones(1, device=device)
        started = time.perf_counter()
        with probe.collective(f"health check all-reduce ({axis})", f"health-{axis}", members, abort_s=timeout_s):
            dist.all_reduce(ones, group=group)
            total = int(ones.item())  # on a GPU the host waits here, where the stall inspector watches
        timings[row, 0] = time.perf_counter() - started
        if total != len(members):
            raise HealthCheckError(f"all-reduce over {axis} summed to {ones.item():g}, expected {len(members)}",
                                   rank=me, ranks=list(members))
        if len(members) > 1:
            previous = members[(members.index(me) - 1) % len(members)]
            with probe.collective(f"health check ring ({axis})", f"health-{axis}", [previous], abort_s=timeout_s):
                _ring_pass(group, members, me, payload, received)
                timings[row, 1] = _ring_pass(group, members, me, payload, received)
    world = dist.get_world_size()
    everyone = [torch.zeros_like(timings) for _ in range(world)]
    hosts: list[str | None] = [None] * world
    with probe.collective("health check gather", "world", range(world), abort_s=timeout_s):
        dist.all_gather(everyone, timings)
        dist.all_gather_object(hosts, socket.gethostname())
    allreduce_s, links = {}, []
    for row, (axis, _, _members) in enumerate(groups):
        allreduce_s[axis] = max(float(everyone[rank][row, 0]) for rank in range(world))
        for rank in range(world):
            ring = _members_of(mesh, axis, rank)
            if len(ring) > 1:
                src = ring[(ring.index(rank) - 1) % len(ring)]
                links.append(Link(axis, src, rank, str(hosts[src]), str(hosts[rank]),
                                  float(everyone[rank][row, 1]), message_bytes))
    return HealthReport(allreduce_s, links)


def _members_of(mesh: Mesh, axis: str, rank: int) -> tuple[int, ...]:
    """The group along ``axis`` (or the world) that ``rank`` belongs to."""
    if axis == "world":
        return tuple(range(mesh.shape.size))
    return next(ranks for ranks in mesh.shape.group_ranks(axis) if rank in ranks)

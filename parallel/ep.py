"""Expert parallelism: a mixture-of-experts layer's experts sharded over a group of data-parallel ranks.

Each DP group is cut into expert-parallel groups of ``ep`` consecutive DP ranks
(``hpc.runtime.mesh.expert_group_ranks``); rank i of an EP group holds experts
``[i * E/ep, (i+1) * E/ep)``. A layer's kept tokens, sorted by expert, go to the ranks
holding their experts by one all-to-all with uneven splits (the counts travel first,
in a small all-to-all of their own), each rank runs its experts on what it received
from every peer, and a second all-to-all sends the outputs back. Both are ``AllToAll``,
an autograd Function whose backward is the reverse all-to-all.

The exchange is torch's ``all_to_all_single`` (one collective, Gloo or NCCL), or, with
``parallel.transport = "mpi"``, point-to-point messages through mpi4py (``parallel.ring``'s
transport): on shared memory MPI moves a small message in microseconds inside the
receiver's wait, where a Gloo collective costs about a millisecond of socket round trips,
so a router's small exchanges stop being latency-bound (``hpc bench alltoall``). Each exchange is
counted by the run's stall inspector on the EP group's channel (``ep group [0, 1]``,
``hpc.observe.probe.group_collective``), so a rank that never enters one is named.

Gradients: a rank's experts saw the tokens of its whole EP group, so their gradients
are summed over the ranks holding a replica of the same experts (one per EP group, dp/ep
of them) and divided by dp: exactly the single process's gradient of the global mean
loss. Dense parameters (routers included) are averaged over the whole DP group by the
distributed optimizer as ever (``jobs/train/loop.py`` leaves the experts out of it). Under
TP every TP rank runs the same whole experts on the same tokens (the MoE input is
full-width), in its own EP group, so nothing is split; under PP the ranks of an EP
group hold the same stage and run the same schedule, so their all-to-alls match.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hpc.errors import LayoutError
from hpc.observe.probe import group_collective
from hpc.runtime.mesh import Mesh, expert_group_ranks
from hpc.runtime.placement import host_numbers_to
from parallel.transport import PointToPoint, Transport, make_transport

PADDED_LIMIT = 1 << 20  # bytes a rank sends at most in a one-round padded exchange (latency-bound below this)
# The tag of EP's point-to-point messages: EP peers are DP peers, whose ring (tag 0) may run at the same time
# from the optimizer's communication thread; MPI guarantees tags up to 32767.
EP_TAG = 1 << 14


@dataclass(frozen=True)
class ExpertPlacement:
    """Which of a layer's ``n_experts`` this rank holds, and the group holding the rest."""

    n_experts: int
    group: ProcessGroup | None = None
    rank: int = 0
    size: int = 1
    sequences: int = 0  # what every rank of the group routes per training forward (0: unknown)
    transport: Transport | None = None  # point-to-point exchanges (parallel.transport = "mpi"); None: torch's

    @property
    def local(self) -> int:
        return self.n_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.local

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.local


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's EP group and the group of its experts' replicas (None when dp == ep: no replicas)."""

    ep_group: ProcessGroup
    ep_rank: int
    ep_size: int
    replica_group: ProcessGroup | None
    dp_size: int
    ep_members: tuple[int, ...] = ()  # global ranks, for stall reports
    replica_members: tuple[int, ...] = ()
    transport: Transport | None = None  # the EP group's point-to-point transport; None: torch's collectives

    def placement(self, n_experts: int, sequences: int = 0) -> ExpertPlacement:
        if n_experts % self.ep_size:
            raise LayoutError(f"parallel.ep={self.ep_size} does not divide an MoE layer's {n_experts} experts")
        return ExpertPlacement(n_experts, self.ep_group, self.ep_rank, self.ep_size, sequences, self.transport)


def build_expert_groups(mesh: Mesh, ep: int, transport: str = "torch") -> ExpertGroups:
    """Create every EP and replica group (collective: every rank calls it, in the same order); ``transport``
    "mpi" exchanges tokens through mpi4py (``parallel.transport``)."""
    ep_ranks, replica_ranks = expert_group_ranks(mesh.shape, ep)
    mine: dict[str, tuple[ProcessGroup, tuple[int, ...]]] = {}
    timeout = None if mesh.timeout_s is None else datetime.timedelta(seconds=mesh.timeout_s)
    for kind, groups in (("ep", ep_ranks), ("replica", replica_ranks if mesh.shape.dp > ep else [])):
        for ranks in groups:
            group = dist.new_group(list(ranks), timeout=timeout)  # the mesh's timeout, as its groups
            if mesh.rank in ranks:
                mine[kind] = (group, ranks)
    group, ranks = mine["ep"]
    replica, replica_ranks = mine.get("replica", (None, (mesh.rank,)))
    return ExpertGroups(group, ranks.index(mesh.rank), ep, replica, mesh.shape.dp, ranks, replica_ranks,
                        make_transport(transport, group) if transport == "mpi" else None)


def _all_to_all_single(out: torch.Tensor, x: torch.Tensor, recv: list[int], send: list[int], group: ProcessGroup,
                       transport: Transport | None) -> None:
    """``send[d]`` leading-dim slices of ``x`` to rank d, ``recv[s]`` from rank s into ``out``, in rank order:
    torch's collective, or one send and one receive per peer through ``transport``; counted by the stall
    inspector."""
    with group_collective(group, "all-to-all"):
        if transport is None:
            dist.all_to_all_single(out, x, recv, send, group=group)
        else:
            _point_to_point(out, x, recv, send, group, transport)


def _point_to_point(out: torch.Tensor, x: torch.Tensor, recv: list[int], send: list[int], group: ProcessGroup,
                    transport: Transport) -> None:
    me = dist.get_rank(group)
    outgoing, incoming = x.split(send), out.split(recv)
    incoming[me].copy_(outgoing[me])
    ops = [PointToPoint(False, incoming[peer], peer, EP_TAG) for peer in range(len(send)) if peer != me]
    ops += [PointToPoint(True, outgoing[peer].contiguous(), peer, EP_TAG) for peer in range(len(send)) if peer != me]
    for pending in transport.post(ops):
        pending.wait()


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup,
                transport: Transport | None = None) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    _all_to_all_single(out, x.contiguous(), recv, send, group, transport)
    return out


def _exchange(x: torch.Tensor, counts: torch.Tensor, send: list[int], group: ProcessGroup,
              max_rows: int | None, transport: Transport | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``send[d]`` rows of ``x`` to rank d (in order) with the header ``counts[d]`` (``[n, h]`` int64, each row
    summing to ``send[d]``); returns the rows received, by source, the headers received and their sums. With
    ``max_rows`` (a bound on the rows to any peer that every rank agrees on) and a small exchange, one round:
    padded messages with the header inside. Otherwise two: the headers, then the rows with uneven splits."""
    n, h = counts.shape
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    if max_rows is not None and n * (8 * h + max_rows * row_bytes) <= PADDED_LIMIT:
        if max(send) > max_rows:
            raise ValueError(f"all-to-all: {max(send)} rows for one peer, over the agreed bound of {max_rows}")
        return _padded_exchange(x, counts, send, max_rows, row_bytes, group, transport)
    received = torch.empty_like(counts)
    _all_to_all_single(received, counts, [1] * n, [1] * n, group, transport)
    recv = received.sum(1).tolist()
    return _all_to_all(x, send, recv, group, transport), received, recv


def _padded_exchange(x: torch.Tensor, counts: torch.Tensor, send: list[int], max_rows: int, row_bytes: int,
                     group: ProcessGroup, transport: Transport | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One equal-split all-to-all: to each peer its header rows, then its rows padded to ``max_rows``; moved
    as the widest integers dividing a row (copies of 1-byte elements are several times slower)."""
    n, h = counts.shape
    unit = next(dtype for dtype in (torch.int64, torch.int32, torch.uint8) if row_bytes % dtype.itemsize == 0)
    header_rows = -(-8 * h // row_bytes)
    message = torch.empty(n, header_rows + max_rows, row_bytes // unit.itemsize, dtype=unit,  # padding: any
                          device=x.device)
    headers = message[:, :header_rows].view(torch.uint8).view(n, header_rows * row_bytes)[:, :8 * h]
    headers.copy_(counts.view(torch.uint8))
    data = x.contiguous().view(len(x), row_bytes // x.element_size()).view(torch.uint8).view(unit)
    start = 0
    for peer, rows in enumerate(send):
        message[peer, header_rows:header_rows + rows] = data[start:start + rows]
        start += rows
    arrived = torch.empty_like(message)
    _all_to_all_single(arrived, message, [1] * n, [1] * n, group, transport)
    received = arrived[:, :header_rows].view(torch.uint8).view(n, header_rows * row_bytes)[:, :8 * h]
    received = received.contiguous().view(torch.int64)
    recv = received.sum(1).tolist()
    rows = torch.cat([arrived[source, header_rows:header_rows + r] for source, r in enumerate(recv)])
    return rows.view(torch.uint8).view(x.dtype).view(-1, *x.shape[1:]), received, recv


class Dispatch(torch.autograd.Function):
    """Forward: ``_exchange``. Backward: the gradient rows sent back, their split sizes now known."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: torch.Tensor, send: list[int], group: ProcessGroup,
                max_rows: int | None, transport: Transport | None):
        rows, received, recv = _exchange(x.detach(), counts, send, group, max_rows, transport)
        ctx.send, ctx.recv, ctx.group, ctx.transport = send, recv, group, transport
        ctx.mark_non_differentiable(received)
        return rows, received

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _received):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.transport), None, None, None, None, None


class AllToAll(torch.autograd.Function):
    """Rows ``send[i]`` to rank i, ``recv[i]`` rows from rank i; backward sends the gradient rows back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup,
                transport: Transport | None) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.transport = send, recv, group, transport
        return _all_to_all(x, send, recv, group, transport)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.transport), None, None, None, None


def all_to_all(x: torch.Tensor, send: Sequence[int], group: ProcessGroup, max_rows: int | None = None,
               transport: Transport | None = None) -> tuple[torch.Tensor, list[int]]:
    """Rows ``send[i]`` of ``x`` to rank i (uneven splits): the rows received and how many came from each rank
    (differentiable in ``x``). The split sizes travel first in a small all-to-all of their own, unless every
    rank passes the same ``max_rows`` (at least any split) and the padded exchange is small: then one round.
    ``transport`` (over ``group``): point-to-point instead of torch's collective."""
    send = [int(n) for n in send]
    counts = host_numbers_to(send, torch.int64, x.device).view(-1, 1)
    if torch.is_grad_enabled() and x.requires_grad:
        rows, received = Dispatch.apply(x, counts, send, group, max_rows, transport)
        return rows, received.view(-1).tolist()
    rows, _, recv = _exchange(x, counts, send, group, max_rows, transport)
    return rows, recv


def _apply(experts: Sequence[nn.Module], x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Expert i on the next ``counts[i]`` rows of ``x`` (every expert called, so each gets a gradient)."""
    return torch.cat([expert(rows) for expert, rows in zip(experts, x.split(list(counts)), strict=True)])


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The row order grouping received rows ``[source, local expert]`` (``counts``) by expert, then source;
    worked out on the host (a few numbers per peer), returned on ``counts``' device."""
    device, counts = counts.device, counts.cpu()
    starts = torch.cumsum(counts.flatten(), 0) - counts.flatten()
    starts = starts.view_as(counts)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
              for e in range(counts.shape[1]) for s in range(counts.shape[0])]
    return (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)).to(device)


def run_experts(x: torch.Tensor, counts: torch.Tensor, sizes: Sequence[int], experts: Sequence[nn.Module],
                placement: ExpertPlacement, max_rows: int | None = None) -> torch.Tensor:
    """The rows of ``x``, sorted by expert, through their experts wherever they live: ``counts`` rows each (on
    the device, int64), ``sizes`` the same numbers on the host (read once by the caller); ``max_rows``: a bound
    on the rows any rank sends any peer, the same on every rank (see ``all_to_all``)."""
    if placement.size == 1:
        return _apply(experts, x, sizes)
    group, local = placement.group, placement.local
    per_rank = counts.view(placement.size, local)
    send = [sum(sizes[rank * local:(rank + 1) * local]) for rank in range(placement.size)]
    received, received_counts = Dispatch.apply(x, per_rank, send, group, max_rows,  # [source, my local expert]
                                               placement.transport)
    recv = received_counts.sum(1).tolist()
    order = _expert_major(received_counts)
    held = [experts[placement.first + i] for i in range(local)]
    outputs = _apply(held, received[order], received_counts.sum(0).tolist())
    return AllToAll.apply(outputs[torch.argsort(order)], recv, send, group, placement.transport)


def reduce_expert_gradients(params: Sequence[nn.Parameter], groups: ExpertGroups) -> None:
    """Sum the experts' gradients over their replicas and divide by dp: the global mean loss's gradient."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    if groups.replica_group is not None:
        dist.all_reduce(flat, group=groups.replica_group)
    flat /= groups.dp_size
    for param, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        param.grad = chunk.view_as(param).clone()

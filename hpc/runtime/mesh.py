"""The (dp, tp, pp) grid of ranks and its process groups.

Layout: tensor-parallel ranks are adjacent, then data parallel, then pipeline:

    rank = tp_index + tp * (dp_index + dp * pp_index)

TP exchanges activations every layer, so its ranks must share a node (launchers
number local ranks consecutively); DP traffic is one all-reduce per step and PP
sends one activation per microbatch, so those may cross nodes. This is row-major
order over the shape (pp, dp, tp), the same as ``DeviceMesh(mesh_shape=(pp, dp, tp))``.

The arithmetic is pure so it is tested without processes; ``build_mesh`` is the
only part that talks to torch.distributed. We build the groups ourselves with
``new_group`` instead of DeviceMesh: on Gloo that is all DeviceMesh would do, and
the group for each axis stays an explicit object we pass around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hpc.errors import LayoutError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

Axis = Literal["dp", "tp", "pp"]
AXES: tuple[Axis, ...] = ("tp", "dp", "pp")  # fastest-varying first


@dataclass(frozen=True)
class MeshShape:
    dp: int
    tp: int
    pp: int

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> dict[Axis, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        return {"tp": rank % self.tp, "dp": rank // self.tp % self.dp, "pp": rank // (self.tp * self.dp)}

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def group_ranks(self, axis: Axis) -> list[tuple[int, ...]]:
        """Every group along one axis: ranks that differ only in that axis' index."""
        others = [a for a in AXES if a != axis]
        extent = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        groups = []
        for outer in range(extent[others[1]]):
            for inner in range(extent[others[0]]):
                fixed = {others[0]: inner, others[1]: outer}
                groups.append(tuple(self.rank_of(**{**fixed, axis: i}) for i in range(extent[axis])))
        return groups

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp}"


def resolve_layout(dp: int | str, tp: int, pp: int, world_size: int) -> MeshShape:
    """Fill in ``dp = "auto"`` and check that the grid covers the world exactly."""
    if dp == "auto":
        if world_size % (tp * pp):
            raise LayoutError(
                f"parallel.tp * parallel.pp = {tp}*{pp} = {tp * pp} does not divide the world size {world_size}"
            )
        dp = world_size // (tp * pp)
    shape = MeshShape(int(dp), tp, pp)
    if shape.size != world_size:
        raise LayoutError(
            f"parallel layout dp*tp*pp = {dp}*{tp}*{pp} = {shape.size} does not match the world size {world_size}"
        )
    return shape


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the grid, the process group of each axis it belongs to, and the device its share
    of the model lives on: the one owner of placement that every module allocates from (or from the tensors
    it is given)."""

    shape: MeshShape
    rank: int
    groups: dict[Axis, ProcessGroup]
    members: dict[Axis, tuple[int, ...]]
    device: torch.device
    timeout_s: float | None = None  # each group's collective timeout (None: the backend's default, 30 minutes)
    nodes: tuple[int, ...] = ()  # the node each global rank runs on, as its launcher says (empty: all on one)

    def index(self, axis: Axis) -> int:
        return self.shape.coords(self.rank)[axis]

    def size(self, axis: Axis) -> int:
        return len(self.members[axis])

    def group(self, axis: Axis) -> ProcessGroup:
        return self.groups[axis]


def build_mesh(shape: MeshShape, rank: int, device: torch.device | str = "cpu", timeout_s: float | None = None,
               node_rank: int | None = None) -> Mesh:
    """Create one process group per axis group; every rank must call this (collective). ``device``: the
    rank's (``World.device``); ``timeout_s``: each group's collective timeout (``parallel.timeout_s``): torch
    gives a new group the backend's 30 minutes, not the world's, so a hang in a TP or pipeline collective
    would otherwise go unnamed for half an hour. ``node_rank``: the node this rank runs on, as its launcher
    says (``RankInfo.node_rank``), gathered from every rank into ``Mesh.nodes``; None: one node."""
    import datetime

    import torch
    import torch.distributed as dist

    if shape.size != dist.get_world_size():
        raise LayoutError(f"mesh {shape} has {shape.size} ranks but the world has {dist.get_world_size()}")
    groups: dict[Axis, ProcessGroup] = {}
    members: dict[Axis, tuple[int, ...]] = {}
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    for axis in AXES:
        for ranks in shape.group_ranks(axis):
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                groups[axis], members[axis] = group, ranks
    nodes: list[int] = []
    if node_rank is not None:
        nodes = [0] * shape.size
        dist.all_gather_object(nodes, node_rank)
    return Mesh(shape=shape, rank=rank, groups=groups, members=members, device=torch.device(device),
                timeout_s=timeout_s, nodes=tuple(nodes))


def expert_group_ranks(shape: MeshShape, ep: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Expert-parallel groups carved out of each DP group: ``ep`` consecutive DP indices hold the experts
    between them; and each expert's replica groups: the DP ranks with the same index in their EP group."""
    if shape.dp % ep:
        raise LayoutError(f"parallel.ep={ep} does not divide dp={shape.dp} (EP groups are carved out of DP ranks)")
    ep_groups: list[tuple[int, ...]] = []
    replica_groups: list[tuple[int, ...]] = []
    for dp_ranks in shape.group_ranks("dp"):
        ep_groups += [dp_ranks[start:start + ep] for start in range(0, shape.dp, ep)]
        replica_groups += [dp_ranks[index::ep] for index in range(ep)]
    return ep_groups, replica_groups

"""The gradient exchange cut by node: fast and exact inside a node, compressed across nodes, every NIC busy.

A flat ring over every DP rank sends each hop through the codec and crosses each node boundary through
one rank's link. Inside a node the links are 10-50x faster (NVLink against the network), so the
hierarchical exchange (Horovod's hierarchical all-reduce; DeepSpeed ZeRO++'s qgZ) runs in three stages:

1. reduce-scatter inside the node, uncompressed: each local rank holds the node's sum of one shard of the
   bucket (the bucket padded to a multiple of the node's ranks). NCCL's own collective where it carries the
   tensors; on the host through the memory the node's ranks share (``parallel/node_memory.py``: Gloo would
   send each byte through a loopback socket), else our ring (parallel/ring.py) without a codec, since Gloo's
   reduce-scatter is an all-reduce and a copy (24.5 ms for 16 MB on 2 ranks where its all-reduce takes 14.2 and
   the ring's one exchange of halves 6.3);
2. the codec across nodes among the ranks holding the same shard (local rank i of every node: one ring
   per local rank, in parallel, each NIC carrying 1/g of the node's bytes), with its error feedback per
   shard, as the flat ring keeps it per bucket;
3. all-gather inside the node, uncompressed (NCCL's, or on the host as stage 1).

One rank per node makes stages 1 and 3 nothing and stage 2 the flat ring itself; one node makes stage 2
nothing: no codec runs where nothing crosses a node. Node membership is what the launcher says
(``RankInfo.node_rank``: Slurm's node id, mpirun's hosts), gathered once by ``build_mesh``. Torch has
no compressed stage, and the flat ring (``parallel/ring.py``) is what crosses the nodes here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpc.runtime.placement import moves_with_nccl
from parallel.compression.base import MomentumCorrection, Reducer, flatten, unflatten_into
from parallel.node_memory import NodeSharedMemory
from parallel.ring import ring_allgather, ring_reduce_scatter
from parallel.transport import Transport, make_transport

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hpc.runtime.mesh import Mesh

# torch 2.13's names for the one-tensor collectives, else the older ones (torch 2.11 on the GPU machine)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def split_by_node(group: Sequence[int], node_of: Sequence[int]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """``group``'s ranks on each node (in rank order, nodes in order of first appearance) and the cross-node
    groups: the i-th rank of every node. Raises ValueError when the nodes hold different numbers of them."""
    by_node: dict[int, list[int]] = {}
    for rank in group:
        by_node.setdefault(node_of[rank], []).append(rank)
    node_groups = [tuple(ranks) for ranks in by_node.values()]
    sizes = sorted({len(ranks) for ranks in node_groups})
    if len(sizes) > 1:
        spread = ", ".join(f"node {node}: {len(ranks)}" for node, ranks in by_node.items())
        raise ValueError(f"the DP group {list(group)} has different numbers of ranks on its nodes ({spread})")
    return node_groups, [tuple(ranks[i] for ranks in node_groups) for i in range(sizes[0])]


def resolve_scope(scope: str, compression: str, nodes: int) -> str:
    """``parallel.compression_scope``: ``auto`` is ``inter-node`` when the DP group spans several nodes and a
    codec is set, else ``flat``."""
    if scope == "auto":
        return "inter-node" if nodes > 1 and compression != "none" else "flat"
    return scope


def dp_nodes(mesh: Mesh) -> int:
    """The most nodes any DP group spans (the same number on every rank: every rank takes the same branch)."""
    if not mesh.nodes:
        return 1
    return max(len({mesh.nodes[rank] for rank in ranks}) for ranks in mesh.shape.group_ranks("dp"))


@dataclass(frozen=True)
class NodeGroups:
    """This rank's part of its DP group cut by node: its node's ranks (``node``) and the ranks holding the
    same shard on every node (``cross``): the node's process group and a transport over each."""

    node: ProcessGroup
    inside: Transport
    cross: Transport
    local_rank: int
    local_size: int
    nodes: int
    # per local rank l, the DP group's ranks (in it) of the cross-node group of the l-th ranks, in that group's
    # rank order (torch orders a group's ranks by their global rank)
    cross_members: tuple[tuple[int, ...], ...]


def build_node_groups(mesh: Mesh, transport: str = "torch") -> NodeGroups:
    """Collective over the world: every DP group's node groups, then its cross-node groups, created in the
    same order on every rank; this rank's. ``mesh.nodes`` says where each rank runs."""
    import datetime

    timeout = None if mesh.timeout_s is None else datetime.timedelta(seconds=mesh.timeout_s)
    mine: dict[str, tuple[ProcessGroup, tuple[int, ...]]] = {}
    cross_members: tuple[tuple[int, ...], ...] = ()
    for dp_ranks in mesh.shape.group_ranks("dp"):
        node_groups, cross_groups = split_by_node(dp_ranks, mesh.nodes)
        if mesh.rank in dp_ranks:
            cross_members = tuple(tuple(dp_ranks.index(rank) for rank in sorted(ranks)) for ranks in cross_groups)
        for kind, groups in (("node", node_groups), ("cross", cross_groups)):
            for ranks in groups:
                group = dist.new_group(list(ranks), timeout=timeout)
                if mesh.rank in ranks:
                    mine[kind] = (group, ranks)
    (node, node_ranks), (cross, cross_ranks) = mine["node"], mine["cross"]
    return NodeGroups(node, make_transport(transport, node), make_transport(transport, cross),
                      node_ranks.index(mesh.rank), len(node_ranks), len(cross_ranks), cross_members)


def _padded(flat: torch.Tensor, g: int) -> torch.Tensor:
    """``flat`` with zeros after it up to a multiple of ``g`` elements (itself where it is one)."""
    return flat if flat.numel() % g == 0 else torch.cat([flat, flat.new_zeros(g - flat.numel() % g)])


def owners(tensors: Sequence[torch.Tensor], g: int) -> list[int]:
    """The local rank that compresses each tensor across nodes: the largest first, each to the least loaded."""
    load, owner = [0] * g, [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].numel()):
        owner[i] = min(range(g), key=load.__getitem__)
        load[owner[i]] += tensors[i].numel()
    return owner


class HierarchicalReducer(Reducer):
    """``inner``'s codec across nodes only, on the shard this rank holds after the node's reduce-scatter (see
    the module); its state (residuals per shard) is ``inner``'s."""

    def __init__(self, inner: Reducer, groups: NodeGroups) -> None:
        self.inner, self.groups, self.name, self.nodes = inner, groups, inner.name, groups.nodes
        self.supports_reduce_scatter = inner.supports_reduce_scatter
        self._memory: NodeSharedMemory | None = None
        self._memory_tried = False

    def reduce_scatter(self, key: str, flat: torch.Tensor, transport: Transport, average: bool,
                       ) -> tuple[torch.Tensor, int]:
        """ZeRO stages 2 and 3 cut by node: ``flat`` in the flat ring's layout (n equal chunks, DP rank r's in
        chunk r + 1, as ``ZeroShards.flatten_by_owner`` makes it), its chunks reordered so that the node's
        uncompressed reduce-scatter leaves each local rank the node's sums of the chunks its counterparts on every
        node own, then the codec's reduce-scatter across nodes leaves it its own: this rank's reduced chunk, and
        the bytes it sent. No all-gather: what a rank does not own it drops."""
        g, nodes = self.groups.local_size, self.groups.nodes
        n = g * nodes  # the DP group's size
        chunks = flat.view(n, -1)
        # the cross ring leaves its rank k piece k + 1 of the shard; the node's ring leaves local rank l shard
        # l + 1 (NCCL's: shard l); each piece is the chunk of the rank it ends on, chunk r + 1 for DP rank r
        node_shift = 0 if self._native(flat) else 1
        order = [0] * n
        for local in range(g):
            for piece in range(nodes):
                owner = self.groups.cross_members[local][(piece - 1) % nodes]
                order[((local + node_shift) % g) * nodes + piece] = (owner + 1) % n
        arranged = chunks[order].reshape(-1)
        shard = self._reduce_scatter_in_node(arranged) if g > 1 else arranged
        sent = (g - 1) * shard.nbytes
        owned = shard
        if nodes > 1:
            owned, crossed = self.inner.reduce_scatter(f"{key}/node-shard", shard, self.groups.cross, average)
            sent += crossed
        if average and g > 1:
            owned.div_(g)
        return owned, sent

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        if self.inner.whole_tensors:
            return self._reduce_by_tensor(key, tensors, average)
        flat = flatten(tensors)
        g = self.groups.local_size
        padded = _padded(flat, g)
        shard = self._reduce_scatter_in_node(padded) if g > 1 else padded
        sent = (g - 1) * shard.nbytes
        if self.groups.nodes > 1:  # averaged over the nodes as the flat ring averages: one rank a node is that ring
            sent += self.inner.reduce(f"{key}/node-shard", [shard], self.groups.cross, average=average)
        if average and g > 1:
            shard.div_(g)
        if g > 1:
            self._all_gather_in_node(padded, shard)
            sent += (g - 1) * shard.nbytes
        if padded is not flat:
            flat.copy_(padded[: flat.numel()])
        unflatten_into(flat, tensors)
        return sent

    def _reduce_by_tensor(self, key: str, tensors: Sequence[torch.Tensor], average: bool) -> int:
        """A codec of whole matrices (PowerSGD): summed inside the node, each tensor compressed across nodes by
        one local rank (its share by size), then each tensor's result summed inside the node with zeros from the
        others, which copies it exactly."""
        flat = flatten(tensors)
        g, nbytes = self.groups.local_size, flat.nbytes
        self._all_reduce_in_node(flat)
        unflatten_into(flat, tensors)
        mine = [t for t, owner in zip(tensors, owners(tensors, g), strict=True) if owner == self.groups.local_rank]
        sent = 2 * (g - 1) * nbytes // g
        if self.groups.nodes > 1 and mine:
            sent += self.inner.reduce(key, mine, self.groups.cross, average=average)  # one rank a node: the flat one
        if g == 1:
            return sent
        for tensor in tensors:
            if not any(tensor is t for t in mine):
                tensor.zero_()
            elif average:
                tensor.div_(g)
        flat = flatten(tensors)
        self._all_reduce_in_node(flat)
        unflatten_into(flat, tensors)
        return sent + 2 * (g - 1) * nbytes // g

    def _native(self, tensor: torch.Tensor) -> bool:
        """Whether the node's stages are the backend's own collectives for ``tensor`` (NCCL's on a GPU; under the
        CPU harness of NCCL's rules too, so that its paths are proven there)."""
        return moves_with_nccl(self.groups.node, tensor.device)

    def _shared_memory(self, padded: torch.Tensor) -> NodeSharedMemory | None:
        """The node's shared memory for host tensors (``parallel/node_memory.py``), attached at the first
        exchange by every rank of the node at once; None for device tensors and where the ranks share none."""
        if padded.is_cuda or self.groups.local_size == 1 or self._native(padded):
            return None
        if not self._memory_tried:
            self._memory_tried = True
            self._memory = NodeSharedMemory.attach(self.groups.node, self.groups.local_rank, self.groups.local_size,
                                                   padded.nbytes)
        return self._memory

    def _reduce_scatter_in_node(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the node's sum: shard ``local_rank`` by NCCL, else ``local_rank + 1`` as the ring
        leaves it (a view into ``padded``), through the node's shared memory on the host; the same shard index on
        every node, so the cross-node groups pair alike."""
        if not self._native(padded):
            memory = self._shared_memory(padded)
            if memory is not None:
                return memory.reduce_scatter(padded)
            return ring_reduce_scatter(padded, self.groups.inside)
        shard = padded.new_empty(padded.numel() // self.groups.local_size)
        REDUCE_SCATTER(shard, padded, group=self.groups.node)
        return shard

    def _all_gather_in_node(self, padded: torch.Tensor, shard: torch.Tensor) -> None:
        """``padded`` made of every local rank's reduced shard, where :meth:`_reduce_scatter_in_node` put them."""
        if self._native(padded):
            ALL_GATHER(padded, shard, group=self.groups.node)
            return
        memory = self._shared_memory(padded)
        if memory is not None:
            memory.all_gather(padded, shard)
            return
        ring_allgather(shard, self.groups.inside, out=padded.view(self.groups.local_size, -1), shift=1)

    def _all_reduce_in_node(self, flat: torch.Tensor) -> None:
        """The node's sum in place: on the host through the node's shared memory (a reduce-scatter and an
        all-gather), else on the tensor itself where the backend takes its memory (NCCL on a GPU, Gloo on the
        host), else on a host copy (ranks sharing a GPU over Gloo, as the tests run them)."""
        memory = self._shared_memory(flat)
        if memory is not None:
            padded = _padded(flat, self.groups.local_size)
            memory.all_gather(padded, memory.reduce_scatter(padded))
            if padded is not flat:
                flat.copy_(padded[: flat.numel()])
            return
        if self._native(flat) or not flat.is_cuda:
            dist.all_reduce(flat, group=self.groups.node)
            return
        host = flat.cpu()
        dist.all_reduce(host, group=self.groups.node)
        flat.copy_(host)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(state)

    def momentum_correction(self, optimizer: torch.optim.Optimizer) -> MomentumCorrection | None:
        return self.inner.momentum_correction(optimizer)

"""Ring all-reduce over point-to-point messages, with compression inside the ring.

We write the ring ourselves (instead of calling ``all_reduce``) because a library
all-reduce can only sum what it is given: to compress gradients to int8 it must
fall back to all-gather. Owning each hop lets a codec decode, add and re-encode
(see ``parallel.compression``).

Algorithm: the flat buffer is cut into n chunks. Reduce-scatter: n-1 steps, each
rank sends one chunk to its right neighbour and adds the chunk from its left; after
it, rank r holds the full sum of chunk r+1. All-gather: n-1 steps forwarding the
finished chunks. Each rank sends 2(n-1)/n of the buffer, the bandwidth optimum.
The receive of step s+1 is posted before step s's chunk is reduced, so the network
works while the CPU adds.

Two transports: torch.distributed isend/irecv (Gloo or NCCL, any process group) and
mpi4py Isend/Irecv on the tensors' bytes (CPU only), because MPI's shared-memory and
InfiniBand transports beat Gloo's TCP on CPU clusters.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc.errors import LaunchEnvError
from parallel.compression import Codec

IDENTITY = Codec()


class Pending(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    name: str
    group: ProcessGroup | None

    def send(self, tensor: torch.Tensor, peer: int) -> Pending: ...

    def recv(self, tensor: torch.Tensor, peer: int) -> Pending: ...


class TorchTransport:
    """Point-to-point through torch.distributed; peers are ranks within ``group``."""

    name = "torch"

    def __init__(self, group: ProcessGroup | None = None):
        self.group = group

    def send(self, tensor: torch.Tensor, peer: int) -> Pending:
        return dist.isend(tensor, group=self.group, group_dst=peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> Pending:
        return dist.irecv(tensor, group=self.group, group_src=peer)


class MpiTransport:
    """Point-to-point through mpi4py on CPU tensors; peers are ranks within ``group``.

    Assumes MPI's world rank equals torch's global rank, which holds when both were
    set up by the same launcher (``hpc.init`` under mpirun or srun).
    """

    name = "mpi"

    def __init__(self, group: ProcessGroup | None = None):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        mpi_world, torch_world = (self.comm.Get_rank(), self.comm.Get_size()), (dist.get_rank(), dist.get_world_size())
        if mpi_world != torch_world:
            raise LaunchEnvError(
                f"parallel.transport='mpi' needs ranks started by mpirun or srun: MPI rank/size {mpi_world} "
                f"differ from torch's {torch_world}"
            )
        self.group = group

    def _peer(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def send(self, tensor: torch.Tensor, peer: int) -> Pending:
        return self.comm.Isend(tensor.view(torch.uint8).numpy(), dest=self._peer(peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> Pending:
        return self.comm.Irecv(tensor.view(torch.uint8).numpy(), source=self._peer(peer))


def make_transport(name: str, group: ProcessGroup | None) -> Transport:
    if name == "mpi":
        return MpiTransport(group)
    return TorchTransport(group)


def ring_allreduce(
    flat: torch.Tensor,
    transport: Transport,
    *,
    codec: Codec = IDENTITY,
    average: bool = False,
    error: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum (or average) a contiguous 1-D tensor across the group, in place; returns it.

    ``error``, if given (same shape, zeroed by the caller), receives the error this
    rank's encodes introduced; summed over ranks it is the exact error of the result.
    """
    n, rank = dist.get_world_size(transport.group), dist.get_rank(transport.group)
    if n == 1:
        return flat
    left, right = (rank - 1) % n, (rank + 1) % n
    chunks = list(flat.tensor_split(n))
    errors = list(error.tensor_split(n)) if error is not None and codec.lossy else None

    def encode(index: int, final: bool = False) -> torch.Tensor:
        payload = codec.encode(chunks[index])
        if codec.lossy and (errors is not None or final):  # decoding costs as much as encoding
            decoded = codec.decode(payload, chunks[index])
            if errors is not None:
                errors[index].add_(chunks[index] - decoded)
            if final:
                chunks[index].copy_(decoded)  # the owner keeps exactly what the others decode
        return payload

    def post_recv(index: int, in_place: bool = False) -> tuple[torch.Tensor, Pending | None]:
        buffer = chunks[index] if in_place else codec.empty_payload(chunks[index])
        return buffer, (transport.recv(buffer, left) if buffer.numel() else None)

    def post_send(payload: torch.Tensor) -> Pending | None:
        return transport.send(payload, right) if payload.numel() else None

    sends: list[Pending | None] = []
    # Reduce-scatter: at step s receive chunk (rank-s-1) and add our share to it.
    incoming = post_recv((rank - 1) % n)
    sends.append(post_send(encode(rank)))
    for step in range(n - 1):
        index = (rank - step - 1) % n
        buffer, pending = incoming
        if pending is not None:
            pending.wait()
        if step < n - 2:
            incoming = post_recv((rank - step - 2) % n)
        chunks[index].add_(codec.decode(buffer, chunks[index]))
        if step < n - 2:
            sends.append(post_send(encode(index)))
    _wait_all(sends)  # the chunks they read are overwritten below
    # All-gather: the owner encodes its finished chunk once; it is forwarded unchanged.
    # Uncompressed chunks are received straight into place.
    in_place = codec is IDENTITY
    owned = (rank + 1) % n
    incoming = post_recv(rank % n, in_place)
    sends.append(post_send(encode(owned, final=True)))
    for step in range(n - 1):
        index = (rank - step) % n
        buffer, pending = incoming
        if pending is not None:
            pending.wait()
        if step < n - 2:
            incoming = post_recv((rank - step - 1) % n, in_place)
            sends.append(post_send(buffer))
        if not in_place:
            chunks[index].copy_(codec.decode(buffer, chunks[index]))
    _wait_all(sends)
    if average:
        flat.div_(n)
    return flat


def _wait_all(pending: list[Pending | None]) -> None:
    for item in pending:
        if item is not None:
            item.wait()
    pending.clear()

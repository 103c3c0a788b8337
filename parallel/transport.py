"""How ranks move bytes: point-to-point batches over torch.distributed or mpi4py.

Two transports: torch.distributed isend/irecv (Gloo or NCCL, any process group) and
mpi4py Isend/Irecv on the tensors' bytes, because MPI's shared-memory and InfiniBand
transports beat Gloo's TCP on CPU clusters. CUDA tensors travel as they are where the
carrier takes device memory (NCCL, a CUDA-aware MPI), else through pinned host copies.

The ring (``parallel/ring.py``), the pipeline and expert parallelism's exchange all post their messages
through a ``Transport``, so a job picks its carrier once (``parallel.transport`` in the spec).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc.errors import LaunchEnvError
from hpc.runtime.placement import (
    Pending,
    StagedReceive,
    StagedSend,
    carries_cuda,
    host_staging_buffer,
    staged_copy_to_host,
)


@dataclass(frozen=True)
class PointToPoint:
    """One send or receive of a batch (``Transport.post``); ``peer`` is a rank within the transport's group."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class Transport(Protocol):
    name: str
    group: ProcessGroup | None

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending: ...

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending: ...

    def post(self, ops: Sequence[PointToPoint]) -> list[Pending]: ...

    def in_lockstep(self, device: torch.device) -> bool: ...


class TorchTransport:
    """Point-to-point through torch.distributed; peers are ranks within ``group``. CUDA tensors go as they are
    where the backend carries them (NCCL), else through pinned host copies (Gloo's send/recv take host
    memory only: several ranks sharing one GPU, ``hpc/runtime/placement.py``)."""

    name = "torch"

    def __init__(self, group: ProcessGroup | None = None):
        self.group = group
        self._direct: bool | None = None  # whether CUDA tensors go without staging; asked once

    def _carries_cuda(self) -> bool:
        if self._direct is None:
            self._direct = carries_cuda(self.group)
        return self._direct

    def _stages(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and not self._carries_cuda()

    def in_lockstep(self, device: torch.device) -> bool:
        """Whether messages of ``device``'s tensors go through NCCL (or a backend keeping its rules, as the CPU
        harness of tests/nccl_rules.py does), whose receives complete only within the batch that holds this
        rank's matching turn (see the module docstring)."""
        return self._carries_cuda()

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending:
        return self.post([PointToPoint(True, tensor, peer, tag)])[0]

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending:
        return self.post([PointToPoint(False, tensor, peer, tag)])[0]

    def post(self, ops: Sequence[PointToPoint]) -> list[Pending]:
        """One ``batch_isend_irecv``: a single launch where the backend coalesces (NCCL)."""
        if not ops:
            return []
        carried = [_host_side(op) if self._stages(op.tensor) else op for op in ops]
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, group=self.group, group_peer=op.peer,
                       tag=op.tag)
            for op in carried
        ])
        if len(works) != len(carried):  # a backend that coalesces (NCCL): one Work completes the whole batch
            (batch,) = works
            works = [batch] * len(carried)
        return [_staged(op, host.tensor, work) if host is not op else work
                for op, host, work in zip(ops, carried, works, strict=True)]


def _host_side(op: PointToPoint) -> PointToPoint:
    """The same message on a host buffer: a copy of a send's tensor, an empty buffer for a receive."""
    host = staged_copy_to_host(op.tensor) if op.is_send else host_staging_buffer(op.tensor)
    return PointToPoint(op.is_send, host, op.peer, op.tag)


def _staged(op: PointToPoint, host: torch.Tensor, work: Pending) -> Pending:
    return StagedSend(work, host) if op.is_send else StagedReceive(work, host, op.tensor)


def mpi_carries_cuda() -> bool:
    """Whether the MPI library says it takes CUDA memory (Open MPI's and MPICH's ``MPIX_Query_cuda_support``)."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # an MPI without the extension raises NotImplementedError or an MPI error
        return False


class MpiTransport:
    """Point-to-point through mpi4py; peers are ranks within ``group``. CUDA tensors go as they are when
    the MPI library is CUDA-aware, else through pinned host copies.

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
        self._cuda_aware: bool | None = None

    def _peer(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _buffer(self, tensor: torch.Tensor):
        """What mpi4py reads or writes: the bytes of a host tensor, or a CUDA tensor's own memory."""
        from mpi4py import MPI

        flat = tensor.view(torch.uint8)
        return flat.numpy() if not flat.is_cuda else [flat, MPI.BYTE]

    def _stages(self, tensor: torch.Tensor) -> bool:
        if not tensor.is_cuda:
            return False
        if self._cuda_aware is None:
            self._cuda_aware = mpi_carries_cuda()
        return not self._cuda_aware

    def in_lockstep(self, device: torch.device) -> bool:
        return False  # MPI moves a posted message whatever else this rank has posted

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending:
        if self._stages(tensor):
            host = staged_copy_to_host(tensor)
            return StagedSend(self._isend(host, peer, tag), host)
        return self._isend(tensor, peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending:
        if self._stages(tensor):
            host = host_staging_buffer(tensor)
            return StagedReceive(self._irecv(host, peer, tag), host, tensor)
        return self._irecv(tensor, peer, tag)

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()  # MPI reads the memory outside any stream
        return self.comm.Isend(self._buffer(tensor), dest=self._peer(peer), tag=tag)

    def _irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        return self.comm.Irecv(self._buffer(tensor), source=self._peer(peer), tag=tag)

    def post(self, ops: Sequence[PointToPoint]) -> list[Pending]:
        """Each posted at once: MPI moves a posted message inside the receiver's own MPI calls (shared
        memory: one copy when it waits), so no progress thread has to win a busy core first."""
        return [(self.send if op.is_send else self.recv)(op.tensor, op.peer, op.tag) for op in ops]


def make_transport(name: str, group: ProcessGroup | None) -> Transport:
    if name == "mpi":
        return MpiTransport(group)
    return TorchTransport(group)

"""``from parallel import horovod as hvd``: Horovod's PyTorch API on torch.distributed and our ring.

Horovod's last release no longer builds against torch 2.x; scripts written against
``horovod.torch`` run here with only their import line changed. Signatures, defaults
and in-place/out-of-place behaviour follow ``horovod.torch`` 0.28: ``allreduce``
returns a new tensor and is differentiable, ``allreduce_`` works in place, ``op``
defaults to Average, ``prescale_factor``/``postscale_factor`` multiply before and
after the reduction. Gradients go through ``parallel.optimizer`` (fused buckets
overlapped with backward) with any of our codecs.

Horovod's API is global by design (``hvd.rank()``); the global state used is
torch.distributed's default process group, which ``init`` creates through
``hpc.runtime.bootstrap`` (so torchrun, mpirun and srun all work), the launcher's
environment for local and cross ranks, and, as in Horovod, the timeline and each process
set's table of named operations. Handles are objects, not integers in a table.

Measured by Horovod 0.28.1's own ``test/parallel/test_torch.py`` (tests/test_horovod_suite.py).
As in Horovod: integers are scaled (Average, pre/postscale) in float64 and cast back; types
Gloo lacks (int16) travel as a wider one; the gradients of broadcast, allgather, reducescatter
and alltoall are Horovod's (averaged where Horovod averages); ``root_rank`` is a global rank,
also within a process set. Horovod's coordinator lives in ``parallel/horovod_coordinator.py``:
every collective called through this API first all-gathers a small signature, so that ranks
that disagree get a HorovodInternalError instead of a hang (``DistributedOptimizer``'s ring does
not pay it); ``*_async`` calls given a ``name=`` are matched by name, and a name still in flight
raises ValueError; the timeline records negotiations and operations.

``join`` works as Horovod's: joined ranks answer the others' allreduces with zeros until
all have joined (the join rounds ride on the same signature all-gather).

Differences, stated rather than hidden: Adasum is not implemented; there is no background
thread, so a named operation waiting for another rank advances at this rank's next call
through the API or its ``synchronize`` (``poll`` alone does not), and synchronous calls are
matched in program order (their ``name`` labels the timeline); sparse gradients cross
``DistributedOptimizer``'s ring dense (and come back sparse); process sets other than the
global one are created with ``add_process_set`` and map to torch groups.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import sys
import warnings

import torch
import torch.distributed as dist

from hpc.config import CODEC_NAMES
from hpc.runtime import bootstrap
from hpc.runtime.env import detect_rank_info
from parallel import horovod_coordinator as _coord
from parallel.compression.casts import WIRE_DTYPES
from parallel.compression.registry import make_reducer
from parallel.horovod_coordinator import (  # noqa: F401  (Horovod's API, re-exported)
    Adasum,
    Average,
    Handle,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    global_process_set,
    poll,
    synchronize,
)
from parallel.optimizer import DistributedOptimizerMixin, distributed_optimizer
from parallel.transport import TorchTransport


def add_process_set(ranks) -> ProcessSet:
    """Every rank must call this with the same ranks (``dist.new_group`` is collective)."""
    ranks = tuple(sorted(ranks.ranks if isinstance(ranks, ProcessSet) else ranks))
    return ProcessSet(ranks, dist.new_group(list(ranks)))


def remove_process_set(process_set: ProcessSet) -> bool:
    if process_set.group is not None:
        dist.destroy_process_group(process_set.group)
    return True


# ---- compression -------------------------------------------------------------------------------------


class Compressor:
    """Horovod's interface: ``compress`` returns (tensor, ctx), ``decompress`` undoes it.

    ``reducer`` names the codec the DistributedOptimizer uses for gradients, where
    our ring applies it at every hop (int8, top-k and PowerSGD have no tensor-local
    form, so ``hvd.allreduce`` with them sends uncompressed).
    """

    def __init__(self, reducer: str, wire_dtype: torch.dtype | None = None):
        self.reducer, self.wire_dtype = reducer, wire_dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if self.wire_dtype is not None and tensor.dtype.is_floating_point:
            return tensor.to(self.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx) if tensor.dtype != ctx else tensor


class Compression:
    """Horovod's ``none`` and ``fp16``, plus our in-ring codecs: ``Compression.<name>`` for every codec name."""


for _codec in CODEC_NAMES:  # the casts also cast what hvd.allreduce sends
    setattr(Compression, _codec, Compressor(_codec, WIRE_DTYPES.get(_codec)))


# ---- basics ------------------------------------------------------------------------------------------


def init(comm=None, process_sets=None) -> None:
    """Join the job (torchrun, mpirun or srun variables); calling it again is harmless."""
    if not dist.is_initialized():
        bootstrap.init("auto")


def shutdown() -> None:
    bootstrap.shutdown()


def is_initialized() -> bool:
    return dist.is_initialized()


def _require_init() -> None:
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def rank() -> int:
    _require_init()
    return dist.get_rank()


def size() -> int:
    _require_init()
    return dist.get_world_size()


def _placement():
    """This rank's node and local place, as its launcher exported them (hpc/runtime/env.py)."""
    _require_init()
    return detect_rank_info(os.environ)


def local_rank() -> int:
    return _placement().local_rank


def local_size() -> int:
    return _placement().local_size


def cross_rank() -> int:
    return _placement().node_rank


def cross_size() -> int:
    return _placement().num_nodes


def is_homogeneous() -> bool:
    return size() == local_size() * cross_size()


def mpi_built() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    return "mpi4py.MPI" in sys.modules


def mpi_threads_supported() -> bool:
    return mpi_enabled()


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return gloo_built()


def nccl_built() -> int:
    """Horovod's: the version code of the NCCL torch carries (NCCL's ``NCCL_VERSION_CODE``, 22809 for 2.28.9), 0
    without one. Horovod's own tests skip alltoall where it is below 2700: a bool True would read as version 1."""
    if not dist.is_nccl_available():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * (1000 if (major, minor) <= (2, 8) else 10000) + minor * 100 + patch


def cuda_built() -> bool:
    return torch.cuda.is_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return torch.version.hip is not None


def _op(op, average) -> str:
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError("hvd.Adasum is not implemented here; use hvd.Average or hvd.Sum")
    if op not in _coord.TORCH_OPS:
        raise ValueError(f"unknown reduction op {op!r}")
    return op


def _group(process_set: ProcessSet):
    return process_set.group


def _scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """In place; integers are scaled in float64 and cast back (truncated), as Horovod does."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.mul_(factor)
    return tensor.copy_((tensor.to(torch.float64) * factor).to(tensor.dtype))


def _allreduce_async_into(tensor, output, op, prescale_factor, postscale_factor, process_set, name=None,
                          label="allreduce", rows=None) -> Handle:
    """Negotiated (now, or by ``name`` later), then reduced in the background; ``rows`` (start, count)
    keeps only those rows of the result (reducescatter)."""

    def launch(_first_dims) -> Handle:
        if output is not tensor:
            output.copy_(tensor)
        _scale_(output, prescale_factor)
        wire = _coord.wire(output)
        work = dist.all_reduce(wire, op=_coord.TORCH_OPS[op], group=_group(process_set), async_op=True)
        scale = postscale_factor / (process_set.size() if op == Average else 1)

        def finish(result):
            if wire is not result:
                result.copy_(wire)
            _scale_(result, scale)
            return result if rows is None else result[rows[0] : rows[0] + rows[1]].clone()

        return Handle(output, work, finish)

    return _coord.submit("allreduce", tensor, process_set, launch, name, op=op, label=label)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:
    """With ``name``: matched by name, launched once every rank of the set has issued it (see the coordinator)."""
    op = _op(op, average)
    return _allreduce_async_into(tensor, tensor.new_empty(tensor.shape), op, prescale_factor, postscale_factor,
                                 process_set, name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:
    return _allreduce_async_into(tensor, tensor, _op(op, average), prescale_factor, postscale_factor, process_set,
                                 name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Synchronous calls are matched in program order (``name`` is not needed for that)."""
    return synchronize(_allreduce_async_into(tensor, tensor, _op(op, average), prescale_factor, postscale_factor,
                                             process_set, label=_label("allreduce", name)))


class _Allreduce(torch.autograd.Function):
    """forward: all-reduce (op, scale factors); backward: the same all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, process_set, label):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(_allreduce_async_into(tensor.detach(), tensor.new_empty(tensor.shape), op,
                                                 prescale_factor, postscale_factor, process_set, label=label))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, process_set = ctx.args
        grad = synchronize(allreduce_async(grad_output.contiguous(), None, None, op, pre, post, process_set))
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, _op(op, average), prescale_factor, postscale_factor, process_set,
                               _label("allreduce", name))
    return compression.decompress(reduced, ctx)


def _label(kind: str, name) -> str:
    """A synchronous call's row in the timeline: Horovod's ``<operation>.<name>``."""
    return kind if name is None else f"{kind}.{name}"


def _member_names(name, count: int) -> list:
    """A grouped operation's name for each of its tensors (each is matched by its own name)."""
    return [None if name is None else f"{name}_{i + 1}of{count}" for i in range(count)]


class _Together:
    """The work of a handle made of handles: complete when every part is (``finish`` synchronizes each)."""

    def __init__(self, handles):
        self.handles = handles

    def is_completed(self) -> bool:
        return all(handle.done() for handle in self.handles)

    def wait(self) -> None:
        pass


def _grouped(handles) -> Handle:
    return Handle(handles, _Together(handles), lambda hs: [synchronize(h) for h in hs])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    names = _member_names(name, len(tensors))
    return _grouped([allreduce_async(t, average, n, op, prescale_factor, postscale_factor, process_set)
                     for t, n in zip(tensors, names, strict=True)])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    names = _member_names(name, len(tensors))
    return _grouped([allreduce_async_(t, average, n, op, prescale_factor, postscale_factor, process_set)
                     for t, n in zip(tensors, names, strict=True)])


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
            for t in tensors]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, None, op, prescale_factor, postscale_factor,
                                                process_set))


# ---- gather, broadcast, alltoall, reducescatter ---------------------------------------------------------


def _gather_first_dims(tensor, process_set) -> list[int]:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(process_set.size())]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0] if tensor.dim() else 1]), group=_group(process_set))
    return [int(s) for s in sizes]


def _allgather_async(tensor, process_set, name=None, split=False) -> Handle:
    """Concatenation along dim 0 (``split``: every rank's rows apart); the first dimension may differ between
    ranks (padded on the wire). The shapes are negotiated first (they give every rank's first dimension),
    the rows travel in the background."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()

    def launch(firsts) -> Handle:
        padded = _coord.wire(tensor).new_zeros((max(firsts), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in firsts]
        work = dist.all_gather(parts, padded, group=_group(process_set), async_op=True)

        def finish(gathered):
            parts = [part[:first].to(tensor.dtype) for part, first in zip(gathered, firsts, strict=True)]
            return parts if split else torch.cat(parts)

        return Handle(parts, work, finish)

    return _coord.submit("allgather", tensor, process_set, launch, name)


def _allgather(tensor, process_set) -> torch.Tensor:
    return synchronize(_allgather_async(tensor, process_set))


class _Allgather(torch.autograd.Function):
    """forward: all-gather along dim 0; backward (as Horovod): average the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, process_set):
        ctx.process_set = process_set
        ctx.first = tensor.shape[0] if tensor.dim() else 1
        return _allgather(tensor.detach(), process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ctx.process_set))
        firsts = _gather_first_dims(torch.empty(ctx.first), ctx.process_set)
        start = sum(firsts[: ctx.process_set.rank()])
        return grad[start : start + ctx.first], None


def allgather(tensor, name=None, process_set=global_process_set):
    return _Allgather.apply(tensor, process_set)


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    return _allgather_async(tensor, process_set, name)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    names = _member_names(name, len(tensors))
    return _grouped([allgather_async(t, n, process_set) for t, n in zip(tensors, names, strict=True)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return [allgather(t, name, process_set) for t in tensors]


def _root(root_rank: int, process_set: ProcessSet) -> int:
    """Horovod's ``root_rank`` is a global rank, also within a process set; checked on every rank before any
    message (each raises alike: NCCL, unlike Gloo, would not name a root out of range)."""
    if process_set.ranks is not None and root_rank not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not in the process set {process_set.ranks}")
    if process_set.ranks is None and not 0 <= root_rank < dist.get_world_size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job (0 to {dist.get_world_size() - 1})")
    return root_rank


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return _broadcast_async_(tensor, root_rank, name, process_set)


def _broadcast_async_(tensor, root_rank, name, process_set, label="broadcast") -> Handle:
    _root(root_rank, process_set)

    def launch(_first_dims) -> Handle:
        wire = _coord.wire(tensor)
        work = dist.broadcast(wire, src=root_rank, group=_group(process_set), async_op=True)
        return Handle(tensor, work, None if wire is tensor else lambda out: out.copy_(wire))

    return _coord.submit("broadcast", tensor, process_set, launch, name, root=root_rank, label=label)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(_broadcast_async_(tensor, root_rank, None, process_set, _label("broadcast", name)))


class _Broadcast(torch.autograd.Function):
    """forward: broadcast from the root; backward (as Horovod): the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, None, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ctx.process_set))
        if dist.get_rank() != ctx.root_rank:
            grad.zero_()
        return grad, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return _Broadcast.apply(tensor, root_rank, process_set)


def _alltoall_async(tensor, send_splits: list[int], process_set, name=None) -> Handle:
    """The splits are exchanged when it is launched, the rows travel in the background;
    ``synchronize`` gives (received rows, received splits)."""
    tensor = tensor[: sum(send_splits)]  # rows past the splits stay home, as in Horovod

    def launch(_first_dims) -> Handle:
        sent = torch.tensor(send_splits, dtype=torch.int64)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=_group(process_set))
        recv_splits = received.tolist()
        wire = _coord.wire(tensor.contiguous())
        output = wire.new_empty((sum(recv_splits), *tensor.shape[1:]))
        work = dist.all_to_all_single(output, wire, recv_splits, send_splits, group=_group(process_set),
                                      async_op=True)
        return Handle(output, work, lambda out: (out.to(tensor.dtype), received.to(torch.int32)))

    return _coord.submit("alltoall", tensor, process_set, launch, name)


def _alltoall(tensor, send_splits: list[int], process_set) -> tuple[torch.Tensor, torch.Tensor]:
    return synchronize(_alltoall_async(tensor, send_splits, process_set))


class _Alltoall(torch.autograd.Function):
    """forward: rows ``splits[i]`` to rank i; backward: the gradient's rows sent back where they came from."""

    @staticmethod
    def forward(ctx, tensor, send_splits, process_set):
        output, received = _alltoall(tensor.detach(), send_splits, process_set)
        ctx.received, ctx.process_set = received.tolist(), process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        grad, _ = _alltoall(grad_output, ctx.received, ctx.process_set)
        return grad, None, None


def _send_splits(tensor, splits, n: int) -> list[int]:
    """Rows to send to each rank: ``splits``, or the first dimension divided evenly."""
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall: first dimension {tensor.shape[0]} is not divisible by {n} ranks")
        return [tensor.shape[0] // n] * n
    splits = torch.as_tensor(splits)
    if splits.dtype.is_floating_point or splits.dim() != 1 or len(splits) != n:
        raise ValueError(f"alltoall: splits must be {n} integers, not {splits.dtype} of shape {list(splits.shape)}")
    send_splits = [int(s) for s in splits.tolist()]
    if sum(send_splits) > tensor.shape[0]:
        raise ValueError(f"alltoall: the splits add up to {sum(send_splits)}, more than the {tensor.shape[0]} rows")
    return send_splits


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[i]`` go to rank i; returns the received rows (and their splits when ``splits`` is given)."""
    send_splits = _send_splits(tensor, splits, process_set.size())
    output, received = _Alltoall.apply(tensor, send_splits, process_set)
    return output if splits is None else (output, received)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """As Horovod: ``synchronize`` gives (received rows, received splits)."""
    return _alltoall_async(tensor, _send_splits(tensor, splits, process_set.size()), process_set, name)


def _my_rows(first: int, process_set: ProcessSet) -> tuple[int, int]:
    """This rank's rows of a reducescatter: as in Horovod, the first ranks get one row more when uneven."""
    n, me = process_set.size(), process_set.rank()
    base, extra = divmod(first, n)
    return me * base + min(me, extra), base + (1 if me < extra else 0)


class _Reducescatter(torch.autograd.Function):
    """forward: reduce, keep this rank's rows; backward (as Horovod): the gathered gradient, times size for Sum."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor * postscale_factor, process_set)
        reduced = synchronize(allreduce_async(tensor.detach(), None, None, op, prescale_factor, postscale_factor,
                                              process_set))
        start, rows = _my_rows(tensor.shape[0], process_set)
        return reduced[start : start + rows].clone()

    @staticmethod
    def backward(ctx, grad_output):
        op, scale, process_set = ctx.args
        grad = _allgather(grad_output, process_set)
        return _scale_(grad, scale * (process_set.size() if op == Sum else 1)), None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce, then keep this rank's rows (see ``_my_rows``)."""
    op = _reducescatter_op(tensor, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _reducescatter_op(tensor, op) -> str:
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    op = _op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=Average or op=Sum, not {op}")
    return op


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:
    """The reduction runs in the background; ``synchronize`` keeps this rank's rows."""
    op = _reducescatter_op(tensor, op)
    return _allreduce_async_into(tensor, tensor.new_empty(tensor.shape), op, prescale_factor, postscale_factor,
                                 process_set, name, label="reducescatter", rows=_my_rows(tensor.shape[0], process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
            for t in tensors]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    names = _member_names(name, len(tensors))
    return _grouped([reducescatter_async(t, n, op, process_set, prescale_factor, postscale_factor)
                     for t, n in zip(tensors, names, strict=True)])


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set) -> Handle:
    """As Horovod: gather every rank's indices and values (in the background); duplicates add up when the
    result is coalesced."""
    sparse = tensor.coalesce()
    parts = [_allgather_async(sparse.indices().transpose(0, 1).contiguous(), process_set),
             _allgather_async(sparse.values(), process_set)]

    def finish(handles):
        indices, values = (synchronize(h) for h in handles)
        if op == Average:
            values = values / process_set.size()
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, sparse.size())

    return Handle(parts, _Together(parts), finish)


def barrier(process_set=global_process_set) -> None:
    """The negotiation's all-gather is the barrier: a rank that issues something else meets an error, not a hang."""
    _coord.negotiate("barrier", torch.empty(0), process_set)


def join(device=-1) -> int:
    """Horovod's join: until every rank has joined, this rank takes part in the others' allreduces with
    zeros (averages still divide by the full size); returns the rank that joined last."""
    rounds = 0
    while True:
        rows = _coord.exchange("join", torch.empty(0), global_process_set, root=rounds)
        joined = rows[:, 0] == _coord.JOIN
        if bool(joined.all()):
            waited = rows[:, 3].tolist()  # the rounds each rank spent joined: the last one spent fewest
            return max(r for r, w in enumerate(waited) if w == min(waited))
        others = rows[~joined]
        if int(others[0, 0]) == _coord.KINDS.index("allreduce") and _coord.disagreement(others) is None:
            _coord.zeros_into_allreduce(others[0])
        rounds += 1


# ---- timeline, SyncBatchNorm --------------------------------------------------------------------------

def start_timeline(file_path, mark_cycles=False) -> None:
    """Horovod's dynamic timeline: from now on rank 0 writes each negotiation and operation to ``file_path``
    (a Chrome trace; ``mark_cycles`` adds an instant per negotiation round)."""
    _require_init()
    _coord.TIMELINE.start(file_path, mark_cycles)


def stop_timeline() -> None:
    _coord.TIMELINE.stop()


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization with the batch statistics of every rank of ``process_set`` (differentiable)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        if not self.training or size() == 1:
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        count = torch.full((1,), input.numel() / input.shape[1], dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(stats, op=Sum, process_set=self.process_set)
        n = total[-1]
        mean = total[: self.num_features] / n
        var = total[self.num_features : 2 * self.num_features] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * n / max(float(n) - 1, 1.0), alpha=m)
        shape = [1, self.num_features] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


# ---- objects, parameters, optimizer state --------------------------------------------------------------


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """As Horovod: the pickled object's length by a negotiated broadcast, then its bytes (every rank that
    passed the negotiation issues that broadcast next)."""
    mine = _pickled(obj) if dist.get_rank() == root_rank else None
    length = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64)
    broadcast_(length, root_rank, process_set=process_set)
    data = mine if mine is not None else torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(data, src=root_rank, group=_group(process_set))
    return obj if mine is not None else pickle.load(io.BytesIO(data.numpy().tobytes()))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """As Horovod: every rank's pickled object by one negotiated allgather (its negotiation gives the lengths)."""
    parts = synchronize(_allgather_async(_pickled(obj), process_set, split=True))
    return [pickle.loads(part.numpy().tobytes()) for part in parts]


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    """In place, from ``root_rank``: a ``state_dict()``, ``named_parameters()`` or a list of tensors."""
    items = params.items() if isinstance(params, dict) else params
    for item in items:
        tensor = item[1] if isinstance(item, tuple) else item
        if torch.is_tensor(tensor):
            with torch.no_grad():
                broadcast_(tensor.data, root_rank, process_set=process_set)


def broadcast_optimizer_state(optimizer, root_rank, process_set=global_process_set) -> None:
    """Root's optimizer state (tensors broadcast, the rest pickled once) loaded on every rank."""
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer)
    state = optimizer.state_dict() if dist.get_rank() == root_rank else None
    tensors: list[torch.Tensor] = []

    def strip(value):
        if torch.is_tensor(value):
            tensors.append(value)
            return ("__tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype).removeprefix("torch."),
                    value.device.type)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = broadcast_object(strip(state) if state is not None else None, root_rank, process_set=process_set)
    if state is None:
        def rebuild(value):
            if isinstance(value, tuple) and len(value) == 5 and value[0] == "__tensor__":
                # received where the root's is sent from (a GPU's over NCCL), then loaded onto the parameters'
                tensor = torch.empty(value[2], dtype=getattr(torch, value[3]), device=_coord.local_device(value[4]))
                tensors.append(tensor)
                return tensor
            if isinstance(value, dict):
                return {k: rebuild(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return type(value)(rebuild(v) for v in value)
            return value

        state = rebuild(skeleton)
    for tensor in tensors:
        broadcast_(tensor, root_rank, process_set=process_set)
    if dist.get_rank() != root_rank:
        optimizer.load_state_dict(state)


def _initialize_state(optimizer) -> None:
    """As Horovod: one step of the wrapped optimizer on zero gradients creates the state to broadcast."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    base = super(DistributedOptimizerMixin, optimizer) if isinstance(optimizer, DistributedOptimizerMixin) \
        else optimizer
    with torch.no_grad():
        base.step()


# ---- the optimizer -------------------------------------------------------------------------------------


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Horovod's wrapper: gradients reduced in fused buckets (``HOROVOD_FUSION_THRESHOLD``, default 64 MiB)
    while backward runs; ``num_groups`` splits them into that many buckets instead."""
    op = _op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=Average or op=Sum, not {op}")
    named = _check_names(optimizer, named_parameters)
    if not process_set.included():  # as in Horovod: outside the set, the optimizer steps on local gradients
        optimizer.synchronize, optimizer.skip_synchronize = lambda: None, contextlib.nullcontext
        optimizer._parameter_names = _parameter_names(optimizer, named)
        return optimizer
    params = [p for _, p in named] if named else [p for g in optimizer.param_groups for p in g["params"]]
    arrived_sparse = _densify_sparse_grads(params)  # before the ring's hooks: they run in this order
    bucket_bytes = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20))
    if num_groups:
        bucket_bytes = math.ceil(sum(p.numel() * p.element_size() for p in params) / num_groups)
    wrapped = distributed_optimizer(
        optimizer,
        TorchTransport(_group(process_set)),
        named_parameters=named,
        reducer=make_reducer(compression.reducer),
        bucket_bytes=max(1, bucket_bytes),
        backward_passes_per_step=backward_passes_per_step,
        average=op == Average,
    )
    wrapped._parameter_names = _parameter_names(optimizer, named)  # Horovod's attribute, read by its tests
    _resparsify_after_synchronize(wrapped, arrived_sparse)
    _warn_step_after_synchronize(wrapped)
    return wrapped


def _densify_sparse_grads(params) -> set:
    """Sparse gradients (``nn.Embedding(sparse=True)``) cross the ring dense; the set remembers which."""
    arrived_sparse: set = set()

    def densify(param) -> None:
        if param.grad is not None and param.grad.is_sparse:
            arrived_sparse.add(param)
            param.grad = param.grad.to_dense()

    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(densify)
    return arrived_sparse


def _resparsify_after_synchronize(optimizer, arrived_sparse: set) -> None:
    """The reduced gradients of those parameters go back to the optimizer sparse (SparseAdam needs them so)."""
    synchronize = optimizer.synchronize

    def synchronize_then_resparsify():
        synchronize()
        for param in arrived_sparse:
            if param.grad is not None and not param.grad.is_sparse:
                param.grad = param.grad.to_sparse()
        arrived_sparse.clear()

    optimizer.synchronize = synchronize_then_resparsify


def _warn_step_after_synchronize(optimizer) -> None:
    """Horovod warns when ``step()`` follows ``synchronize()`` outside ``skip_synchronize()`` (it reduces twice)."""
    synchronize, step = optimizer.synchronize, optimizer.step
    synchronized = [False]

    def explicit_synchronize():
        synchronize()
        synchronized[0] = True

    def checked_step(closure=None):
        if synchronized[0] and not optimizer._skip_sync:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown.", stacklevel=2)
        try:
            return step(closure)
        finally:
            synchronized[0] = False

    optimizer.synchronize, optimizer.step = explicit_synchronize, checked_step


def _check_names(optimizer, named_parameters) -> list | None:
    """Horovod's checks: names unique, and every parameter of the optimizer named."""
    if named_parameters is None:
        return None
    named = list(named_parameters)
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"named_parameters contains duplicate names: {twice}")
    covered = {id(p) for _, p in named}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in covered]
    if missing:
        raise ValueError(f"named_parameters was given but {len(missing)} parameter(s) of the optimizer are not in it")
    return named


def _parameter_names(optimizer, named) -> dict:
    if named is not None:
        return {p: name for name, p in named}
    return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(optimizer.param_groups)
            for j, p in enumerate(g["params"])}

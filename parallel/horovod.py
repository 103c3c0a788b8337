"""``from parallel import horovod as hvd``: Horovod's PyTorch API on torch.distributed and our ring.

Horovod's last release no longer builds against torch 2.x; scripts written against
``horovod.torch`` run here with only their import line changed. Signatures, defaults
and in-place/out-of-place behaviour follow ``horovod.torch`` 0.28: ``allreduce``
returns a new tensor and is differentiable, ``allreduce_`` works in place, ``op``
defaults to Average, ``prescale_factor``/``postscale_factor`` multiply before and
after the reduction. Gradients go through ``parallel.optimizer`` (fused buckets
overlapped with backward) with any of our codecs.

Horovod's API is global by design (``hvd.rank()``); the only global state used is
torch.distributed's default process group, which ``init`` creates through
``hpc.runtime.bootstrap`` (so torchrun, mpirun and srun all work), and the launcher's
environment for local and cross ranks. Handles are objects, not integers in a table.

Differences, stated rather than hidden: Adasum is not implemented; ``join`` is a
barrier that returns the last rank to arrive (ranks must issue the same collectives
before joining, Horovod lets joined ranks contribute zeros); process sets other
than the global one are created with ``add_process_set`` and map to torch groups.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpc.config import CODEC_NAMES
from hpc.runtime import bootstrap
from hpc.runtime.env import detect_rank_info
from parallel.compression.casts import WIRE_DTYPES
from parallel.compression.registry import make_reducer
from parallel.optimizer import distributed_optimizer
from parallel.ring import TorchTransport

Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
_TORCH_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


@dataclass(frozen=True, eq=False)
class ProcessSet:
    """A subset of ranks: ``ranks`` None means all of them (``global_process_set``)."""

    ranks: tuple[int, ...] | None = None
    group: Any = field(default=None, repr=False)

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def included(self) -> bool:
        return self.ranks is None or dist.get_rank() in self.ranks


global_process_set = ProcessSet()


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


def nccl_built() -> bool:
    return dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return torch.version.hip is not None


# ---- asynchronous handles ----------------------------------------------------------------------------


@dataclass
class Handle:
    """What ``*_async`` returns: ``synchronize(handle)`` gives the result, ``poll`` says if it is done."""

    output: Any
    work: Any = None
    finish: Any = None

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()


def poll(handle: Handle) -> bool:
    return handle.done()


def synchronize(handle: Handle):
    if handle.work is not None:
        handle.work.wait()
        handle.work = None
    if handle.finish is not None:
        handle.output = handle.finish(handle.output)
        handle.finish = None
    return handle.output


def _op(op, average) -> str:
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError("hvd.Adasum is not implemented here; use hvd.Average or hvd.Sum")
    if op not in _TORCH_OPS:
        raise ValueError(f"unknown reduction op {op!r}")
    return op


def _group(process_set: ProcessSet):
    return process_set.group


def _allreduce_async_into(tensor, output, op, prescale_factor, postscale_factor, process_set) -> Handle:
    if output is not tensor:
        output.copy_(tensor)
    if prescale_factor != 1.0:
        output.mul_(prescale_factor)
    work = dist.all_reduce(output, op=_TORCH_OPS[op], group=_group(process_set), async_op=True)
    scale = postscale_factor / (process_set.size() if op == Average else 1)

    def finish(result):
        return result.mul_(scale) if scale != 1.0 else result

    return Handle(output, work, finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:
    op = _op(op, average)
    return _allreduce_async_into(tensor, tensor.new_empty(tensor.shape), op, prescale_factor, postscale_factor,
                                 process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:
    return _allreduce_async_into(tensor, tensor, _op(op, average), prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """forward: all-reduce (op, scale factors); backward: the same all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor.detach(), None, None, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, process_set = ctx.args
        grad = synchronize(allreduce_async(grad_output.contiguous(), None, None, op, pre, post, process_set))
        return grad, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, _op(op, average), prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    handles = [allreduce_async(t, average, name, op, prescale_factor, postscale_factor, process_set)
               for t in tensors]
    return Handle(handles, None, lambda hs: [synchronize(h) for h in hs])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    handles = [allreduce_async_(t, average, name, op, prescale_factor, postscale_factor, process_set)
               for t in tensors]
    return Handle(handles, None, lambda hs: [synchronize(h) for h in hs])


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
            for t in tensors]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---- gather, broadcast, alltoall, reducescatter ---------------------------------------------------------


def _gather_first_dims(tensor, process_set) -> list[int]:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(process_set.size())]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0] if tensor.dim() else 1]), group=_group(process_set))
    return [int(s) for s in sizes]


def _allgather(tensor, process_set) -> torch.Tensor:
    """Concatenation along dim 0; the first dimension may differ between ranks (padded on the wire)."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    firsts = _gather_first_dims(tensor, process_set)
    longest = max(firsts)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in firsts]
    dist.all_gather(parts, padded, group=_group(process_set))
    return torch.cat([part[:first] for part, first in zip(parts, firsts, strict=True)])


class _Allgather(torch.autograd.Function):
    """forward: all-gather along dim 0; backward: sum the gradient over ranks, keep this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, process_set):
        ctx.process_set = process_set
        ctx.firsts = _gather_first_dims(tensor, process_set)
        return _allgather(tensor.detach(), process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=_group(ctx.process_set))
        start = sum(ctx.firsts[: ctx.process_set.rank()])
        return grad[start : start + ctx.firsts[ctx.process_set.rank()]], None


def allgather(tensor, name=None, process_set=global_process_set):
    return _Allgather.apply(tensor, process_set)


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    return Handle(_allgather(tensor, process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return [allgather(t, name, process_set) for t in tensors]


def _root(root_rank: int, process_set: ProcessSet) -> int:
    return root_rank if process_set.group is None else dist.get_global_rank(process_set.group, root_rank)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    work = dist.broadcast(tensor, src=_root(root_rank, process_set), group=_group(process_set), async_op=True)
    return Handle(tensor, work)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """forward: broadcast from the root; backward: gradients summed onto the root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, None, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=_group(ctx.process_set))
        if ctx.process_set.rank() != ctx.root_rank:
            grad.zero_()
        return grad, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return _Broadcast.apply(tensor, root_rank, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[i]`` go to rank i; returns the received rows (and their splits when ``splits`` is given)."""
    n = process_set.size()
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall: first dimension {tensor.shape[0]} is not divisible by {n} ranks")
        send_splits = [tensor.shape[0] // n] * n
    else:
        send_splits = [int(s) for s in torch.as_tensor(splits).tolist()]
    sent = torch.tensor(send_splits, dtype=torch.int64)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=_group(process_set))
    recv_splits = received.tolist()
    output = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.contiguous(), recv_splits, send_splits, group=_group(process_set))
    if splits is None:
        return output
    return output, received.to(torch.int32)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce, then keep this rank's rows; as in Horovod, the first ranks get one row more when uneven."""
    reduced = allreduce(tensor, None, name, compression, op, prescale_factor, postscale_factor, process_set)
    n, me = process_set.size(), process_set.rank()
    base, extra = divmod(tensor.shape[0], n)
    start = me * base + min(me, extra)
    return reduced[start : start + base + (1 if me < extra else 0)].clone()


def barrier(process_set=global_process_set) -> None:
    dist.barrier(group=_group(process_set))


def join(device=-1) -> int:
    """A barrier that returns the rank that reached it last (see the module docstring)."""
    store = dist.distributed_c10d._get_default_store()
    call = store.add(f"hvd/join/calls/{rank()}", 1)
    arrival = store.add(f"hvd/join/{call}", 1)
    last = torch.tensor([rank() if arrival == size() else -1])
    dist.all_reduce(last, op=dist.ReduceOp.MAX)
    return int(last)


# ---- objects, parameters, optimizer state --------------------------------------------------------------


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    holder = [obj]
    dist.broadcast_object_list(holder, src=_root(root_rank, process_set), group=_group(process_set))
    return holder[0]


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    gathered = [None] * process_set.size()
    dist.all_gather_object(gathered, obj, group=_group(process_set))
    return gathered


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
    state = optimizer.state_dict() if process_set.rank() == root_rank else None
    tensors: list[torch.Tensor] = []

    def strip(value):
        if torch.is_tensor(value):
            tensors.append(value)
            return ("__tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype).removeprefix("torch."))
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = broadcast_object(strip(state) if state is not None else None, root_rank, process_set=process_set)
    if state is None:
        def rebuild(value):
            if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
                tensor = torch.empty(value[2], dtype=getattr(torch, value[3]))
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
    if process_set.rank() != root_rank:
        optimizer.load_state_dict(state)


# ---- the optimizer -------------------------------------------------------------------------------------


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Horovod's wrapper: gradients reduced in fused buckets (``HOROVOD_FUSION_THRESHOLD``, default 64 MiB)
    while backward runs; ``num_groups`` splits them into that many buckets instead."""
    op = _op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=Average or op=Sum, not {op}")
    named = list(named_parameters) if named_parameters is not None else None
    bucket_bytes = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20))
    if num_groups:
        params = [p for _, p in named] if named else [p for g in optimizer.param_groups for p in g["params"]]
        bucket_bytes = math.ceil(sum(p.numel() * p.element_size() for p in params) / num_groups)
    return distributed_optimizer(
        optimizer,
        TorchTransport(_group(process_set)),
        named_parameters=named,
        reducer=make_reducer(compression.reducer),
        bucket_bytes=max(1, bucket_bytes),
        backward_passes_per_step=backward_passes_per_step,
        average=op == Average,
    )

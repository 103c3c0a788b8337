"""Gradient reducers: how a bucket of gradients is summed across the data-parallel group.

A reducer owns what must persist between steps for its codec: the error-feedback
residuals (per rank, per bucket) and PowerSGD's warm-start matrices. Both are
state a resumed run needs, hence ``state_dict``/``load_state_dict`` with plain
tensors keyed by name.

- ``RingReducer``: none/fp16/bf16/int8, compressed inside the ring.
- ``TopKReducer``: top-k entries all-gathered (sparse sums do not ring).
- ``PowerSGDReducer``: low-rank P and Q ring-all-reduced, vectors uncompressed.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from parallel.compression import ErrorFeedback, PowerSGD, TopK, make_codec
from parallel.ring import IDENTITY, Transport, ring_allgather, ring_allreduce

REDUCERS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")


class Reducer(Protocol):
    name: str

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        """Sum (or average) ``tensors`` across the group in place; returns the bytes this rank sent."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor over ``tensors``: a view of a single contiguous tensor (reduced in place), else a copy."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
        return  # flatten's view: already in place
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


class _WithFeedback:
    """Reducers whose codec is lossy keep the residuals of each bucket (or matrix) here."""

    def __init__(self) -> None:
        self.feedback = ErrorFeedback()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual/{k}": v for k, v in self.feedback.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.feedback.residuals = {
            k.removeprefix("residual/"): v.clone() for k, v in state.items() if k.startswith("residual/")
        }


def _ring_bytes(numel_bytes: float, n: int) -> int:
    return int(2 * (n - 1) / n * numel_bytes)


class RingReducer(_WithFeedback):
    """One flat buffer per bucket through the ring, the codec applied at every hop."""

    def __init__(self, codec_name: str = "none", error_feedback: bool = True):
        super().__init__()
        self.codec = make_codec(codec_name)
        self.name = self.codec.name
        self.error_feedback = error_feedback and self.codec.lossy

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        flat = flatten(tensors)
        error = None
        if self.error_feedback:
            self.feedback.compensate(key, flat)
            error = self.feedback.reusable(key, flat)
        ring_allreduce(flat, transport, codec=self.codec, average=average, error=error)
        if error is not None:
            self.feedback.store(key, error)
        unflatten_into(flat, tensors)
        n = dist.get_world_size(transport.group)
        return _ring_bytes(flat.numel() * flat.element_size() * self.codec.wire_ratio(flat.dtype), n)


class TopKReducer(_WithFeedback):
    """Each rank sends the k largest compensated entries of every tensor; all ranks sum them in rank order.

    Selection is per tensor (k proportional to its size), not over the whole bucket:
    otherwise the layers with the largest gradients take every slot and the others
    only move once their residual has grown large (the layer-wise rule of Deep
    Gradient Compression). One all-gather carries the whole bucket.
    """

    name = "topk"

    def __init__(self, fraction: float = 0.01):
        super().__init__()
        self.codec = TopK(fraction)

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        # In place, in buffers that persist across steps: on a 64 MiB gradient each fresh
        # allocation costs ~30 ms of page faults, more than the selection itself.
        payloads = []
        for i, tensor in enumerate(tensors):
            gradient = tensor.reshape(-1)
            compensated = self.feedback.residual(f"{key}/{i}", gradient)
            indices = self.codec.top_indices(compensated, plus=gradient)
            payloads.append(self.codec.pack(compensated, indices))
            compensated.index_fill_(0, indices, 0)  # what was not sent stays behind as the next step's residual
        gathered = ring_allgather(torch.cat(payloads), transport)
        n = gathered.shape[0]
        per_tensor = gathered.split([p.numel() for p in payloads], dim=1)
        for tensor, rows in zip(tensors, per_tensor, strict=True):
            flat = flatten([tensor])
            flat.zero_()
            for row in rows:  # the same order on every rank: identical sums
                if average:  # the k values, not the whole tensor: a pass over 64 MiB costs ~3 ms
                    row[4 * self.codec.k(flat.numel()) :].view(flat.dtype).div_(n)
                self.codec.add_decoded(row, flat)
            unflatten_into(flat, [tensor])
        return (n - 1) * gathered.shape[1]


class PowerSGDReducer(_WithFeedback):
    """Matrices as P Q^T (two ring all-reduces per bucket, of all P's then all Q's); vectors exact."""

    name = "powersgd"

    def __init__(self, rank: int = 4):
        super().__init__()
        self.codec = PowerSGD(rank)
        self.qs: dict[str, torch.Tensor] = {}

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        n = dist.get_world_size(transport.group)
        low_rank = [i for i, t in enumerate(tensors) if self.codec.compresses(t.shape)]
        exact = [t for i, t in enumerate(tensors) if i not in low_rank]
        sent = 0
        if exact:
            flat = flatten(exact)
            ring_allreduce(flat, transport, average=average)
            unflatten_into(flat, exact)
            sent += _ring_bytes(flat.numel() * flat.element_size(), n)
        if not low_rank:
            return sent
        keys = [f"{key}/{i}" for i in low_rank]
        matrices = []
        for name, i in zip(keys, low_rank, strict=True):
            matrix = self.codec.matrix(tensors[i]).clone()
            self.feedback.compensate(name, matrix)
            matrices.append(matrix)
        qs = [self._q(name, m.shape) for name, m in zip(keys, matrices, strict=True)]
        ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
        sent += self._allreduce(ps, transport)
        ps = [self.codec.orthonormalize(p) for p in ps]
        qs = [m.T @ p for m, p in zip(matrices, ps, strict=True)]
        local_qs = [q.clone() for q in qs]
        sent += self._allreduce(qs, transport)
        for name, i, matrix, p, q, local_q in zip(keys, low_rank, matrices, ps, qs, local_qs, strict=True):
            self.feedback.store(name, matrix - p @ local_q.T)
            self.qs[name] = q.clone()  # warm start: the summed Q of this step
            approx = p @ q.T
            tensors[i].copy_((approx / n if average else approx).view_as(tensors[i]))
        return sent

    def _q(self, name: str, shape: torch.Size) -> torch.Tensor:
        if name not in self.qs:
            self.qs[name] = self.codec.initial_q(shape, zlib.crc32(name.encode()))
        return self.qs[name]

    @staticmethod
    def _allreduce(matrices: list[torch.Tensor], transport: Transport) -> int:
        flat = flatten(matrices)
        ring_allreduce(flat, transport, codec=IDENTITY)
        unflatten_into(flat, matrices)
        return _ring_bytes(flat.numel() * flat.element_size(), dist.get_world_size(transport.group))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"q/{k}": v for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.qs = {k.removeprefix("q/"): v.clone() for k, v in state.items() if k.startswith("q/")}


def make_reducer(name: str, topk_fraction: float = 0.01, powersgd_rank: int = 4) -> Reducer:
    if name == "topk":
        return TopKReducer(topk_fraction)
    if name == "powersgd":
        return PowerSGDReducer(powersgd_rank)
    if name in REDUCERS:
        return RingReducer(name)
    raise ValueError(f"unknown gradient compression {name!r} (valid: {', '.join(REDUCERS)})")

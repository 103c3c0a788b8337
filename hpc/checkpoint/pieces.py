"""Pieces, the unit of a checkpoint, and the plan that decides which rank writes each one.

The library knows nothing of models or layouts: a rank holds pieces, each a block of
a named global tensor at some offsets. Tensor and pipeline parallelism only change
which blocks a rank holds, and data-parallel replicas hold the same blocks, so

- a block held by several ranks is written once, by one of its holders, chosen
  largest-first onto the least-loaded holder: every rank shares the I/O, and all
  ranks compute the same plan from the same gathered metadata without talking;
- the distinct blocks of a tensor must tile it exactly (no gap, no overlap), which
  is what lets any later layout read any block of it back.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc.checkpoint.format import (
    INDEX,
    CheckpointError,
    CheckpointIndex,
    PieceRecord,
    TensorRecord,
    check_name,
    shard_name,
    storage_dtype,
)

if TYPE_CHECKING:
    import torch

PieceKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # (name, offsets, shape)


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PieceMeta:
    """What the other ranks need to know about a piece: everything but its data."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_name(self.name)
        storage_dtype(self.dtype)
        ndim = len(self.global_shape)
        if len(self.offsets) != ndim or len(self.shape) != ndim:
            raise CheckpointError(
                f"piece of {self.name}: offsets {self.offsets} and shape {self.shape} must have "
                f"one entry per dimension of the global shape {self.global_shape}"
            )
        if any(o < 0 or o + n > g for o, n, g in zip(self.offsets, self.shape, self.global_shape, strict=True)):
            raise CheckpointError(
                f"piece of {self.name} at offsets {self.offsets} with shape {self.shape} "
                f"lies outside the global shape {self.global_shape}"
            )

    @property
    def key(self) -> PieceKey:
        return (self.name, self.offsets, self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * storage_dtype(self.dtype).itemsize

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "global_shape": list(self.global_shape),
                "offsets": list(self.offsets), "shape": list(self.shape)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PieceMeta:
        return cls(data["name"], data["dtype"], tuple(data["global_shape"]), tuple(data["offsets"]),
                   tuple(data["shape"]))


@dataclass(frozen=True)
class Piece:
    """The block of global tensor ``name`` that this rank holds, starting at ``offsets``."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> Piece:
        """A tensor this rank holds entirely (replicated or unsharded)."""
        return cls(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())

    def meta(self) -> PieceMeta:
        return PieceMeta(self.name, dtype_name(self.tensor), tuple(self.global_shape), tuple(self.offsets),
                         tuple(self.tensor.shape))


@dataclass(frozen=True)
class SavePlan:
    writers: Mapping[PieceKey, int]  # every distinct piece -> the one rank that writes it
    tensors: tuple[TensorRecord, ...]  # the index entries the plan produces

    def written_by(self, rank: int) -> set[PieceKey]:
        return {key for key, writer in self.writers.items() if writer == rank}


def plan_writes(per_rank: Sequence[Sequence[PieceMeta]]) -> SavePlan:
    """Check that the ranks' pieces describe consistent global tensors and pick one writer per piece."""
    holders: dict[PieceKey, list[int]] = defaultdict(list)
    metas: dict[PieceKey, PieceMeta] = {}
    for rank, pieces in enumerate(per_rank):
        for meta in pieces:
            seen = metas.setdefault(meta.key, meta)
            if seen != meta:
                raise CheckpointError(
                    f"ranks {holders[meta.key][0]} and {rank} hold the same piece of {meta.name} "
                    f"as {seen.dtype}{list(seen.global_shape)} and {meta.dtype}{list(meta.global_shape)}"
                )
            if rank in holders[meta.key]:
                raise CheckpointError(f"rank {rank} passed the piece of {meta.name} at {meta.offsets} twice")
            holders[meta.key].append(rank)
    by_name: dict[str, list[PieceMeta]] = defaultdict(list)
    for meta in metas.values():
        by_name[meta.name].append(meta)
    _check_names(by_name)
    for name, pieces in by_name.items():
        _check_tiling(name, pieces)
    loads = [0] * len(per_rank)
    writers: dict[PieceKey, int] = {}
    for key in sorted(metas, key=lambda k: (-metas[k].nbytes, k)):
        writer = min(holders[key], key=lambda r: (loads[r], r))
        loads[writer] += metas[key].nbytes
        writers[key] = writer
    tensors = tuple(
        TensorRecord(
            name=name,
            dtype=pieces[0].dtype,
            shape=pieces[0].global_shape,
            pieces=tuple(
                PieceRecord(shard_name(writers[p.key]), p.offsets, p.shape)
                for p in sorted(pieces, key=lambda p: p.offsets)
            ),
        )
        for name, pieces in sorted(by_name.items())
    )
    return SavePlan(writers=writers, tensors=tensors)


def _check_names(by_name: Mapping[str, Sequence[PieceMeta]]) -> None:
    """A name cannot also be a group: 'a' and 'a/b' would collide in HDF5."""
    for name in by_name:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            prefix = "/".join(parts[:depth])
            if prefix in by_name:
                raise CheckpointError(f"tensor names {prefix!r} and {name!r} collide: one is a prefix of the other")


def _check_tiling(name: str, pieces: Sequence[PieceMeta]) -> None:
    first = pieces[0]
    for other in pieces[1:]:
        if (other.dtype, other.global_shape) != (first.dtype, first.global_shape):
            raise CheckpointError(
                f"pieces of {name} disagree on the tensor: {first.dtype}{list(first.global_shape)} "
                f"and {other.dtype}{list(other.global_shape)}"
            )
    nonempty = [p for p in pieces if math.prod(p.shape)]
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1 :]:
            spans = zip(a.offsets, a.shape, b.offsets, b.shape, strict=True)
            if all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in spans):
                raise CheckpointError(f"pieces of {name} at {a.offsets} and {b.offsets} overlap")
    covered = sum(math.prod(p.shape) for p in pieces)
    total = math.prod(first.global_shape)
    if covered != total:
        raise CheckpointError(f"the pieces of {name} cover {covered} of its {total} elements")


def check_records(index: CheckpointIndex) -> None:
    """The index's pieces of each tensor tile it exactly, as the save checked: a damaged index may not."""
    for record in index.tensors.values():
        try:
            pieces = [PieceMeta(record.name, record.dtype, record.shape, p.offsets, p.shape) for p in record.pieces]
            if not pieces:
                raise CheckpointError("it has no pieces")
            _check_tiling(record.name, pieces)
        except CheckpointError as exc:
            path = str(index.path / INDEX)
            raise CheckpointError(f"{record.dataset} in {path} is inconsistent: {exc.message}", file=path,
                                  dataset=record.dataset) from exc

"""Loading: each rank reads exactly the blocks its own layout needs, from whichever shards hold them.

A rank asks for pieces (name, offsets, shape) of the global tensors, in any layout;
every stored piece that overlaps is read as a hyperslab straight into the
destination tensor when it is needed whole, so a resume in the same layout costs no
extra copy. Every stored piece read is checked against its hash, so one needed only
in part (after a change of dp, tp, pp or world size) is read whole into a buffer
first. Reads go to the shard datasets rather than through the index's virtual
datasets: a missing VDS source reads silently as fill values, and a direct read
names the file and dataset that fail. Completeness is checked before anything is
read: the marker, and every shard at its recorded size.
"""

from __future__ import annotations

import math
import stat
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import torch

from hpc.checkpoint.format import (
    COMPLETE,
    RANK_STATE,
    READ_ERRORS,
    STORAGE_DTYPES,
    CheckpointError,
    CheckpointIndex,
    PieceRecord,
    ShardRecord,
    TensorRecord,
    check_read,
    first_line,
    open_file,
    piece_problem,
    plain_dataset,
    rank_state_meta,
    read_index,
    shard_name,
    shard_problem,
    storage_offsets,
    storage_shape,
)
from hpc.checkpoint.pieces import Piece, check_records


def open_checkpoint(step_dir: str | Path) -> CheckpointIndex:
    """The index of a checkpoint that is complete: marker present, every shard there at full size."""
    index = read_index(step_dir)
    check_records(index)
    if not (index.path / COMPLETE).is_file():
        raise CheckpointError(f"{index.path} is incomplete: no {COMPLETE} marker", file=str(index.path / COMPLETE))
    for shard in index.shards.values():
        path = index.path / shard.file
        try:
            info = path.stat()
        except OSError as exc:
            raise CheckpointError(f"{path} is missing", file=str(path)) from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is not a regular file", file=str(path))
        if info.st_size != shard.size:
            raise CheckpointError(_size_mismatch(path, info.st_size, shard), file=str(path))
    return index


def _size_mismatch(path: Path, size: int, shard: ShardRecord) -> str:
    """A shard whose size is not the recorded one: cut short (naming the datasets lost), or larger (another file
    in its place, or one written to after the save)."""
    if size > shard.size:
        return (f"{path} is {size - shard.size} bytes larger than the index records ({size} of {shard.size} "
                "bytes): not the file this save wrote")
    lost = sorted(name for name, (_, end) in shard.extents.items() if end > size)
    return (f"{path} is truncated: {shard.size - size} bytes short ({size} of {shard.size} bytes); datasets cut "
            f"off: {', '.join(lost) or 'none, only HDF5 metadata'}")


@contextmanager
def open_shards(index: CheckpointIndex) -> Iterator[dict[str, h5py.File]]:
    """Shard files opened on first use and closed together."""
    files: dict[str, h5py.File] = {}
    try:
        yield files
    finally:
        for handle in files.values():
            handle.close()


def _shard(index: CheckpointIndex, files: dict[str, h5py.File], file: str) -> h5py.File:
    """A shard, opened once, after checking it belongs to this save: a shard from another step or run does not."""
    if file not in files:
        path = index.path / file
        handle = open_file(path)
        try:
            problem = shard_problem(handle, index, file)
        except READ_ERRORS as exc:
            problem = f"unreadable attributes: {first_line(exc)}"
        if problem:
            handle.close()
            raise CheckpointError(f"{path}: {problem}", file=str(path))
        files[file] = handle
    return files[file]


def _piece_dataset(
    index: CheckpointIndex, files: dict[str, h5py.File], record: TensorRecord, piece: PieceRecord
) -> h5py.Dataset:
    """The dataset holding ``piece``, if the shard's own record of it agrees with the index."""
    path = index.path / piece.file
    try:
        dataset = plain_dataset(_shard(index, files, piece.file), record.dataset)
        problem = piece_problem(dataset, record, piece)
    except READ_ERRORS as exc:
        raise CheckpointError(f"cannot open {record.dataset} in {path}: {first_line(exc)}", file=str(path),
                              dataset=record.dataset) from exc
    if problem:
        raise CheckpointError(f"{record.dataset} in {path} {problem}", file=str(path), dataset=record.dataset)
    return dataset


def _read_checked(dataset: h5py.Dataset, out: np.ndarray) -> None:
    """All of ``dataset`` into ``out`` (its shape, C-contiguous), then its hash checked."""
    try:
        dataset.read_direct(out)
        check_read(dataset, out)
    except READ_ERRORS as exc:
        file = dataset.file.filename
        raise CheckpointError(f"cannot read {dataset.name.lstrip('/')} from {file}: {first_line(exc)}",
                              file=file, dataset=dataset.name.lstrip("/")) from exc


def load_into(index: CheckpointIndex, pieces: Sequence[Piece]) -> None:
    """Fill each piece's tensor, in place, with its block of the checkpointed global tensor."""
    with open_shards(index) as files:
        for piece in pieces:
            _load_piece(index, files, piece)


def _load_piece(index: CheckpointIndex, files: dict[str, h5py.File], piece: Piece) -> None:
    record = index.tensors.get(piece.name)
    if record is None:
        raise CheckpointError(f"{index.path} has no tensor {piece.name}", dataset=piece.name)
    meta = piece.meta()
    if (meta.dtype, meta.global_shape) != (record.dtype, record.shape):
        raise CheckpointError(
            f"{piece.name} is {record.dtype}{list(record.shape)} in the checkpoint, "
            f"but the piece asks for {meta.dtype}{list(meta.global_shape)}",
            dataset=piece.name,
        )
    out, copy_back = _destination(piece.tensor)
    want_at, want = storage_offsets(meta.offsets), storage_shape(meta.shape)
    covered = 0
    for stored in record.pieces:
        have_at, have = storage_offsets(stored.offsets), storage_shape(stored.shape)
        low = [max(a, b) for a, b in zip(want_at, have_at, strict=True)]
        high = [min(a + n, b + m) for a, n, b, m in zip(want_at, want, have_at, have, strict=True)]
        if any(lo >= hi for lo, hi in zip(low, high, strict=True)):
            continue
        source = tuple(slice(lo - b, hi - b) for lo, hi, b in zip(low, high, have_at, strict=True))
        dest = tuple(slice(lo - a, hi - a) for lo, hi, a in zip(low, high, want_at, strict=True))
        dataset = _piece_dataset(index, files, record, stored)
        region = out[dest]
        if region.shape == have and region.flags.c_contiguous:
            _read_checked(dataset, region)
        else:
            whole = np.empty(have, dtype=out.dtype)
            _read_checked(dataset, whole)
            region[...] = whole[source]
        covered += math.prod(hi - lo for lo, hi in zip(low, high, strict=True))
    if covered != math.prod(want) and math.prod(meta.shape):
        raise CheckpointError(f"the stored pieces of {piece.name} do not cover the block at {meta.offsets}",
                              dataset=piece.name)
    if copy_back is not None:
        copy_back()


def _destination(tensor: torch.Tensor) -> tuple[np.ndarray, Callable[[], object] | None]:
    """A numpy array to read into: the tensor's own memory when possible, else a buffer copied back."""
    target = tensor.detach()
    if target.dtype == torch.bfloat16:
        target = target.view(torch.uint16)
    if target.device.type == "cpu" and target.is_contiguous():
        return target.numpy().reshape(storage_shape(tuple(target.shape))), None
    buffer = torch.empty(target.shape, dtype=target.dtype)
    return buffer.numpy().reshape(storage_shape(tuple(target.shape))), lambda: target.copy_(buffer)


def read_tensor(index: CheckpointIndex, name: str) -> torch.Tensor:
    """A whole global tensor, assembled from its pieces."""
    record = index.tensors.get(name)
    if record is None:
        raise CheckpointError(f"{index.path} has no tensor {name}", dataset=name)
    tensor = torch.empty(record.shape, dtype=torch_dtype(record.dtype))
    load_into(index, [Piece.whole(name, tensor)])
    return tensor


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an allow-listed name (``format.check_dtype`` checked it): no ``getattr`` on file data."""
    return TORCH_DTYPES[name]


TORCH_DTYPES = {name: getattr(torch, name) for name in STORAGE_DTYPES}


def load_rank_state(
    index: CheckpointIndex, rank: int, only: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """What ``rank`` saved as its own state (just the keys in ``only`` if given, those it has);
    empty when the checkpoint had no such rank."""
    state = {}
    file = shard_name(rank)
    with open_shards(index) as files:
        for path in index.rank_state_datasets(rank):
            if only is not None and path.removeprefix(f"{RANK_STATE}/") not in only:
                continue
            try:
                dataset = plain_dataset(_shard(index, files, file), path)
                dtype, shape = rank_state_meta(dataset)
            except READ_ERRORS as exc:
                raise CheckpointError(f"cannot open {path} in {index.path / file}: {first_line(exc)}",
                                      file=str(index.path / file), dataset=path) from exc
            start, end = index.shards[file].extents[path]
            if end - start != dataset.dtype.itemsize * math.prod(storage_shape(shape)):
                raise CheckpointError(f"{path} in {index.path / file} is not the size its manifest entry says",
                                      file=str(index.path / file), dataset=path)
            tensor = torch.empty(shape, dtype=torch_dtype(dtype))
            _read_checked(dataset, _destination(tensor)[0])
            state[path.removeprefix(f"{RANK_STATE}/")] = tensor
    return state

"""The on-disk format of a checkpoint: names, dtypes, dataset options and the index schema.

One step is a directory ``step-XXXXXXXX/`` holding one ``rank-XXXXX.h5`` per rank,
``index.h5`` and a ``COMPLETE`` marker (see docs/CHECKPOINT_FORMAT.md). This module is
the only place that knows how these are named and laid out; it needs numpy and h5py
but not torch, so ``hpc ckpt ls/show/verify`` start in a fraction of a second.

Files are written with HDF5's 1.10 format (``LIBVER``): the oldest that has virtual
datasets, and the first whose metadata (object headers, chunk indexes) carries its
own checksums; the Debian h5dump/h5ls (1.10) read it.

Data is stored contiguously with the XXH3-64 hash of its bytes as an attribute rather
than chunked through HDF5's Fletcher32 filter. The filter costs a copy and a checksum
at about 3.5 GB/s per chunk, which made a save CPU-bound at 0.6x of the disk on a
2-core node; a contiguous dataset is written by one ``pwrite`` straight from the
tensor's memory and XXH3 hashes at about 30 GB/s. HDF5 tools still read every dataset;
``hpc ckpt verify`` and every load check the hashes, and the manifest's byte ranges
let ``xxhsum -H3`` check a dataset without Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import xxhash

from hpc.errors import HpcError

FORMAT = "hpc-batch checkpoint"
FORMAT_VERSION = 2  # 1 chunked datasets through Fletcher32
LIBVER = ("v110", "v110")
INDEX = "index.h5"
COMPLETE = "COMPLETE"
LATEST = "latest"
TENSORS = "tensors"  # global tensors in the index, this rank's pieces in a shard
RANK_STATE = "rank"  # a shard's per-rank state (RNG, residuals, counters)
RANKS = "ranks"  # index: one external link per rank to that shard's RANK_STATE group
MANIFEST = "manifest"  # index: per shard, every dataset and the byte range of its data
CHECKSUM = "xxh3_64"  # attribute: the hex XXH3-64 of the bytes as stored (C order), as `xxhsum -H3` prints it
SLAB_BYTES = 64 << 20  # verify hashes datasets in slabs of about this size
RESERVED_ATTRS = frozenset({"format", "format_version", "step", "world_size", "created_unix"})

STEP_DIR = re.compile(r"step-(\d{8})")
TMP_DIR = re.compile(r"step-(\d{8})\.tmp-([0-9a-f]+)")  # a save in progress, or abandoned by a crash
RETIRED_DIR = re.compile(r"step-(\d{8})\.retired-([0-9a-f]+)")  # pruned or replaced, being deleted

# torch dtype name -> how it is stored; bfloat16 has no numpy/HDF5 type, so its bits go as uint16.
STORAGE_DTYPES = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "|i1", "uint8": "|u1", "bool": "|b1",
}


class CheckpointError(HpcError):
    """A checkpoint cannot be written, found, or read back intact; context names the file and dataset."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int, token: str) -> str:
    return f"{step_dir_name(step)}.tmp-{token}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def done_name(rank: int) -> str:
    return f"rank-{rank:05d}.done"


def failed_name(rank: int) -> str:
    return f"rank-{rank:05d}.failed"


def check_name(name: str) -> None:
    """Tensor names are HDF5 paths below /tensors: '/'-separated, no empty or dot parts."""
    parts = name.split("/")
    if not name or any(part in ("", ".", "..") for part in parts):
        raise CheckpointError(f"invalid tensor name {name!r}: use '/'-separated non-empty parts without '.' or '..'")


def storage_dtype(torch_dtype: str) -> np.dtype:
    try:
        return np.dtype(STORAGE_DTYPES[torch_dtype])
    except KeyError:
        valid = ", ".join(STORAGE_DTYPES)
        raise CheckpointError(f"cannot store dtype {torch_dtype} (supported: {valid})") from None


def storage_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """0-d tensors are stored with shape (1,): every dataset has a first dimension to slice."""
    return shape or (1,)


def write_checksummed(group: h5py.Group, path: str, data: np.ndarray) -> h5py.Dataset:
    """A contiguous dataset holding ``data`` (C-contiguous), its hash in the ``CHECKSUM`` attribute."""
    stored = data.reshape(storage_shape(data.shape))
    dataset = group.create_dataset(path, shape=stored.shape, dtype=stored.dtype)
    if stored.size:
        dataset.write_direct(stored)
    dataset.attrs[CHECKSUM] = xxhash.xxh3_64_hexdigest(stored)
    return dataset


def check_read(dataset: h5py.Dataset, data: np.ndarray) -> None:
    """``data``, just read whole from ``dataset``, is what was written; raises naming file and dataset."""
    problem = _checksum_problem(dataset, xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data)))
    if problem:
        file, name = dataset.file.filename, dataset.name.lstrip("/")
        raise CheckpointError(f"{name} in {file} is damaged: {problem}", file=file, dataset=name)


def dataset_problem(dataset: h5py.Dataset) -> str | None:
    """Why the stored dataset is not what was written, if it is not; hashed in slabs (never all in memory)."""
    hasher = xxhash.xxh3_64()
    rows = max(1, SLAB_BYTES // max(1, dataset.dtype.itemsize * math.prod(dataset.shape[1:])))
    for start in range(0, dataset.shape[0] if dataset.size else 0, rows):
        hasher.update(np.ascontiguousarray(dataset[start : start + rows]))
    return _checksum_problem(dataset, hasher.hexdigest())


def _checksum_problem(dataset: h5py.Dataset, actual: str) -> str | None:
    expected = dataset.attrs.get(CHECKSUM)
    if expected is None:
        return f"it has no {CHECKSUM} attribute"
    if _text(expected) != actual:
        return f"its data hashes to {actual}, its {CHECKSUM} attribute says {_text(expected)}"
    return None


def data_extent(dataset: h5py.Dataset) -> tuple[int, int]:
    """Byte range of a dataset's data in its file: a truncated file tells which datasets it lost."""
    offset = dataset.id.get_offset()
    return (0, 0) if offset is None else (offset, offset + dataset.id.get_storage_size())


@dataclass(frozen=True)
class PieceRecord:
    """One stored piece of a global tensor: which shard holds it and where it sits in the whole."""

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]  # global shape; () for a scalar
    pieces: tuple[PieceRecord, ...]

    @property
    def dataset(self) -> str:
        return f"{TENSORS}/{self.name}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * storage_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ShardRecord:
    """What the index expects of one shard file: its size and each dataset's data bytes."""

    file: str
    size: int
    extents: Mapping[str, tuple[int, int]]  # dataset path -> [start, end) of its data


@dataclass(frozen=True)
class CheckpointIndex:
    path: Path
    step: int
    world_size: int
    created_unix: float
    attrs: Mapping[str, Any]  # the caller's metadata (layout, job spec, ...)
    tensors: Mapping[str, TensorRecord]
    shards: Mapping[str, ShardRecord]

    @property
    def nbytes(self) -> int:
        return sum(shard.size for shard in self.shards.values())

    def rank_state_datasets(self, rank: int) -> list[str]:
        shard = self.shards.get(shard_name(rank))
        prefix = f"{RANK_STATE}/"
        return sorted(p for p in shard.extents if p.startswith(prefix)) if shard else []


def write_index(
    path: Path,
    step: int,
    world_size: int,
    created_unix: float,
    attrs: Mapping[str, Any],
    tensors: Iterable[TensorRecord],
    shards: Iterable[ShardRecord],
) -> None:
    """The index: every global tensor as a virtual dataset over its pieces, plus all metadata as attributes."""
    with h5py.File(path, "w", libver=LIBVER) as index:
        index.attrs.update(
            {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
             "created_unix": created_unix}
        )
        for key, value in attrs.items():
            index.attrs[key] = value
        for record in tensors:
            _write_virtual_tensor(index, record)
        for shard in shards:
            names = sorted(shard.extents)
            entry = np.dtype([("dataset", f"S{max(map(len, names), default=1)}"), ("start", "<i8"), ("end", "<i8")])
            rows = np.array([(p.encode(), *shard.extents[p]) for p in names], dtype=entry)
            write_checksummed(index, f"{MANIFEST}/{shard.file}", rows).attrs["size"] = shard.size
            if any(p.startswith(f"{RANK_STATE}/") for p in shard.extents):
                index[f"{RANKS}/{Path(shard.file).stem}"] = h5py.ExternalLink(shard.file, f"/{RANK_STATE}")


def _write_virtual_tensor(index: h5py.File, record: TensorRecord) -> None:
    dtype = storage_dtype(record.dtype)
    layout = h5py.VirtualLayout(storage_shape(record.shape), dtype)
    for piece in record.pieces:
        at, extent = storage_offsets(piece.offsets), storage_shape(piece.shape)
        region = tuple(slice(o, o + n) for o, n in zip(at, extent, strict=True))
        layout[region] = h5py.VirtualSource(piece.file, record.dataset, extent, dtype=dtype)
    dataset = index.create_virtual_dataset(record.dataset, layout, fillvalue=None)
    dataset.attrs.update(
        {
            "dtype": record.dtype,
            "shape": np.array(record.shape, dtype=np.int64),
            "piece_files": np.array([p.file for p in record.pieces], dtype=h5py.string_dtype()),
            "piece_offsets": np.array([storage_offsets(p.offsets) for p in record.pieces], dtype=np.int64),
            "piece_shapes": np.array([storage_shape(p.shape) for p in record.pieces], dtype=np.int64),
        }
    )


def storage_offsets(offsets: tuple[int, ...]) -> tuple[int, ...]:
    return offsets or (0,)


def read_index(step_dir: str | Path) -> CheckpointIndex:
    """Parse ``index.h5``; reads attributes only, no tensor data."""
    step_dir = Path(step_dir)
    path = step_dir / INDEX
    if not path.is_file():
        raise CheckpointError(f"{step_dir} is not a checkpoint: no {INDEX}", file=str(path))
    try:
        with h5py.File(path, "r") as index:
            return _parse_index(step_dir, index)
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {first_line(exc)}", file=str(path)) from exc


def _parse_index(step_dir: Path, index: h5py.File) -> CheckpointIndex:
    attrs = {key: _plain(value) for key, value in index.attrs.items()}
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir / INDEX} is not an {FORMAT} index", file=str(step_dir / INDEX))
    if attrs.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{step_dir / INDEX} is format version {attrs.get('format_version')}; this version "
                              f"of hpc-batch reads version {FORMAT_VERSION}", file=str(step_dir / INDEX))
    tensors: dict[str, TensorRecord] = {}

    def visit(path: str, item: h5py.HLObject) -> None:
        if isinstance(item, h5py.Dataset):
            tensors[path] = _tensor_record(path, item.attrs)

    if TENSORS in index:
        index[TENSORS].visititems(visit)
    shards = {}
    for file, listing in index.get(MANIFEST, {}).items():
        rows = listing[()]
        check_read(listing, rows)
        extents = {_text(row["dataset"]): (int(row["start"]), int(row["end"])) for row in rows}
        shards[file] = ShardRecord(file=file, size=int(listing.attrs["size"]), extents=extents)
    return CheckpointIndex(
        path=step_dir,
        step=int(attrs.pop("step")),
        world_size=int(attrs.pop("world_size")),
        created_unix=float(attrs.pop("created_unix")),
        attrs={k: v for k, v in attrs.items() if k not in RESERVED_ATTRS},
        tensors=tensors,
        shards=shards,
    )


def _tensor_record(name: str, attrs: h5py.AttributeManager) -> TensorRecord:
    shape = tuple(int(n) for n in attrs["shape"])
    ndim = len(shape)
    columns = (attrs["piece_files"], attrs["piece_offsets"], attrs["piece_shapes"])
    pieces = tuple(
        PieceRecord(_text(file), tuple(int(o) for o in offsets)[:ndim], tuple(int(n) for n in extent)[:ndim])
        for file, offsets, extent in zip(*columns, strict=True)
    )
    return TensorRecord(name=name, dtype=_text(attrs["dtype"]), shape=shape, pieces=pieces)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _plain(value: Any) -> Any:
    """Attribute values as JSON-friendly Python values."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

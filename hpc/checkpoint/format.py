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
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import xxhash

from hpc.errors import HpcError

FORMAT = "hpc-batch checkpoint"
FORMAT_VERSION = 3  # 1 chunked datasets through Fletcher32; 2 had no save id, no per-dataset record, heap strings
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
RESERVED_ATTRS = frozenset({"format", "format_version", "step", "world_size", "created_unix", "save_id"})
# Anything a damaged file can make h5py, numpy or a decoder raise while we read metadata.
READ_ERRORS = (OSError, KeyError, ValueError, TypeError, IndexError, RuntimeError, OverflowError, AttributeError)
SHARD_FILE = re.compile(r"rank-(\d{5})\.h5")

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
    save_id: str  # random, written into the index and every shard of one save: a shard from elsewhere differs
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


def text_attr(value: str) -> np.bytes_:
    """A string as a fixed-length attribute: it lives in the checksummed object header, not the unchecked heap."""
    return np.bytes_(value.encode())


def shard_attrs(step: int, rank: int, world_size: int, save_id: str) -> dict[str, Any]:
    """A shard's root attributes: what ties it to one save of one run (checked against the index on every read)."""
    return {"format": text_attr(FORMAT), "format_version": FORMAT_VERSION, "step": step, "rank": rank,
            "world_size": world_size, "save_id": text_attr(save_id)}


def piece_attrs(name: str, dtype: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
                shape: tuple[int, ...]) -> dict[str, Any]:
    """A shard dataset's own record of which block of which tensor it holds, cross-checked with the index."""
    return {"tensor": text_attr(name), "dtype": text_attr(dtype), "global_shape": _ints(global_shape),
            "offsets": _ints(offsets), "shape": _ints(shape)}


def _ints(values: Iterable[int]) -> np.ndarray:
    return np.asarray(tuple(values), dtype=np.int64)


def write_index(
    path: Path,
    header: Mapping[str, Any],
    attrs: Mapping[str, Any],
    tensors: Iterable[TensorRecord],
    shards: Iterable[ShardRecord],
) -> None:
    """The index: every global tensor as a virtual dataset over its pieces, plus all metadata as attributes.

    ``header`` holds step, world_size, created_unix and save_id.
    """
    with h5py.File(path, "w", libver=LIBVER) as index:
        index.attrs.update({"format": text_attr(FORMAT), "format_version": FORMAT_VERSION,
                            "step": header["step"], "world_size": header["world_size"],
                            "created_unix": header["created_unix"], "save_id": text_attr(header["save_id"])})
        for key, value in attrs.items():
            index.attrs[key] = text_attr(value) if isinstance(value, str) else value
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
            "dtype": text_attr(record.dtype),
            "shape": _ints(record.shape),
            "piece_files": np.array([p.file.encode() for p in record.pieces]),
            "piece_offsets": np.array([storage_offsets(p.offsets) for p in record.pieces], dtype=np.int64),
            "piece_shapes": np.array([storage_shape(p.shape) for p in record.pieces], dtype=np.int64),
        }
    )


def storage_offsets(offsets: tuple[int, ...]) -> tuple[int, ...]:
    return offsets or (0,)


def open_file(path: Path) -> h5py.File:
    """``path`` opened read-only, if it is a regular file: HDF5 would wait forever on a FIFO."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc.strerror or first_line(exc)}", file=str(path)) from exc
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file", file=str(path))
    try:
        return h5py.File(path, "r")
    except READ_ERRORS as exc:
        raise CheckpointError(f"{path} is not a readable HDF5 file: {first_line(exc)}", file=str(path)) from exc


def hard_get(group: h5py.Group, path: str) -> h5py.Group | h5py.Dataset:
    """``group[path]`` through hard links only: a soft or external link could lead anywhere, a FIFO included."""
    node: h5py.Group | h5py.Dataset = group
    file = group.file.filename
    for part in path.strip("/").split("/"):
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise CheckpointError(f"{path} is missing from {file}", file=file, dataset=path)
        if not isinstance(link, h5py.HardLink):
            raise CheckpointError(f"{path} in {file} is reached through a {type(link).__name__}, which is never "
                                  "followed", file=file, dataset=path)
        node = node[part]
    return node


def optional_group(group: h5py.Group, name: str) -> h5py.Group | None:
    """The group ``name`` under ``group`` if there is one (``name in group`` would follow an external link)."""
    if group.get(name, getlink=True) is None:
        return None
    node = hard_get(group, name)
    if not isinstance(node, h5py.Group):
        file = group.file.filename
        raise CheckpointError(f"{name} in {file} is not a group", file=file, dataset=name)
    return node


def plain_dataset(group: h5py.Group, path: str) -> h5py.Dataset:
    """A dataset whose bytes are in this file: not a group, not virtual, no external storage."""
    node = hard_get(group, path)
    if not isinstance(node, h5py.Dataset) or node.is_virtual or node.external:
        file = group.file.filename
        raise CheckpointError(f"{path} in {file} is not a plain dataset", file=file, dataset=path)
    return node


def read_index(step_dir: str | Path) -> CheckpointIndex:
    """Parse ``index.h5`` and check it against itself; reads attributes only, no tensor data."""
    step_dir = Path(step_dir)
    path = step_dir / INDEX
    if not os.path.lexists(step_dir):
        raise CheckpointError(f"no such directory: {step_dir}")
    if not os.path.lexists(path):
        raise CheckpointError(f"{step_dir} is not a checkpoint: no {INDEX}", file=str(path))
    try:
        with open_file(path) as index:
            return _parse_index(step_dir, index)
    except READ_ERRORS as exc:
        raise CheckpointError(f"cannot read {path}: {first_line(exc)}", file=str(path)) from exc


def _parse_index(step_dir: Path, index: h5py.File) -> CheckpointIndex:
    path = step_dir / INDEX
    attrs = {key: _plain(value) for key, value in index.attrs.items()}
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an {FORMAT} index", file=str(path))
    if attrs.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is format version {_short(attrs.get('format_version'))}; this version "
                              f"of hpc-batch reads version {FORMAT_VERSION}", file=str(path))
    tensors = _tensor_records(index)
    shards = {}
    for file in optional_group(index, MANIFEST) or ():
        listing = plain_dataset(index, f"{MANIFEST}/{file}")
        rows = listing[()]
        check_read(listing, rows)
        extents = {_text(row["dataset"]): (int(row["start"]), int(row["end"])) for row in rows}
        shards[file] = ShardRecord(file=file, size=int(listing.attrs["size"]), extents=extents)
    checked = CheckpointIndex(
        path=step_dir,
        step=int(attrs.pop("step")),
        world_size=int(attrs.pop("world_size")),
        created_unix=float(attrs.pop("created_unix")),
        save_id=str(attrs.pop("save_id")),
        attrs={k: v for k, v in attrs.items() if k not in RESERVED_ATTRS},
        tensors=tensors,
        shards=shards,
    )
    _check_index(checked)
    return checked


def _tensor_records(index: h5py.File) -> dict[str, TensorRecord]:
    """Every dataset under /tensors; a soft or external link there is refused, never followed."""
    tensors: dict[str, TensorRecord] = {}
    group = optional_group(index, TENSORS)
    if group is None:
        return tensors

    links: list[tuple[str, Any]] = []
    group.visititems_links(lambda name, link: links.append((name, link)))  # raising inside would break h5py
    for name, link in links:
        if not isinstance(link, h5py.HardLink):
            raise CheckpointError(f"{TENSORS}/{name} in {index.filename} is a {type(link).__name__}, which is "
                                  "never followed", file=index.filename, dataset=f"{TENSORS}/{name}")
        if h5py.h5o.get_info(group.id, name.encode()).type == h5py.h5o.TYPE_DATASET:
            tensors[name] = _tensor_record(index.filename, name, _attrs_of(group, name))
    return tensors


TENSOR_ATTRS = ("dtype", "shape", "piece_files", "piece_offsets", "piece_shapes")


def _attrs_of(group: h5py.Group, name: str) -> dict[str, Any]:
    """A virtual dataset's attributes, read without opening it: HDF5 crashes (SIGSEGV) opening one whose
    mapping, kept in the unchecked global heap, is damaged. A missing attribute is left out."""
    attrs = {}
    for key in TENSOR_ATTRS:
        if not h5py.h5a.exists(group.id, key.encode(), obj_name=name.encode()):
            continue
        attr = h5py.h5a.open(group.id, key.encode(), obj_name=name.encode())
        if attr.dtype.kind == "O":
            raise ValueError(f"attribute {key} is variable-length")
        value = np.empty(attr.shape, dtype=attr.dtype)
        attr.read(value)
        attrs[key] = value[()] if value.ndim == 0 else value
    return attrs


def _check_index(index: CheckpointIndex) -> None:
    """The index agrees with itself: known shard names, each piece listed in its shard's manifest at its size."""
    path = str(index.path / INDEX)
    for shard in index.shards.values():
        match = SHARD_FILE.fullmatch(shard.file)
        if not match or int(match[1]) >= index.world_size:
            raise CheckpointError(f"{path} lists a shard {shard.file!r} outside its world of {index.world_size}",
                                  file=path)
        if any(not 0 <= start <= end <= shard.size for start, end in shard.extents.values()):
            raise CheckpointError(f"{path} lists byte ranges past the end of {shard.file}", file=path)
    for record in index.tensors.values():
        files = [piece.file for piece in record.pieces]
        for piece in record.pieces:
            extent = index.shards[piece.file].extents.get(record.dataset) if piece.file in index.shards else None
            nbytes = math.prod(piece.shape) * storage_dtype(record.dtype).itemsize
            if extent is None or extent[1] - extent[0] != nbytes or files.count(piece.file) > 1:
                raise CheckpointError(f"{record.dataset} in {path} maps a piece to {piece.file}, whose manifest "
                                      f"does not list it once at {nbytes} bytes", file=path, dataset=record.dataset)


def _tensor_record(file: str, name: str, attrs: Mapping[str, Any]) -> TensorRecord:
    dataset = f"{TENSORS}/{name}"
    try:
        check_name(name)
        dtype = check_dtype(_plain(attrs["dtype"]), file, dataset)
        shape = _shape(attrs["shape"])
        ndim = len(shape)
        columns = (attrs["piece_files"], attrs["piece_offsets"], attrs["piece_shapes"])
        pieces = tuple(
            PieceRecord(_text(file), _shape(offsets)[:ndim], _shape(extent)[:ndim])
            for file, offsets, extent in zip(*columns, strict=True)
        )
    except READ_ERRORS as exc:
        raise CheckpointError(f"{dataset} in {file} has unreadable attributes: {first_line(exc)}", file=file,
                              dataset=dataset) from exc
    return TensorRecord(name=name, dtype=dtype, shape=shape, pieces=pieces)


def check_dtype(value: Any, file: str, dataset: str) -> str:
    """A dtype attribute, if it names one of the stored dtypes: never handed to ``getattr(torch, ...)`` otherwise."""
    if value not in STORAGE_DTYPES:
        raise CheckpointError(f"{dataset} in {file} has dtype {_short(value)}, not one of "
                              f"{', '.join(STORAGE_DTYPES)}", file=file, dataset=dataset)
    return value


def _shape(value: Any) -> tuple[int, ...]:
    """Non-negative integers (a shape or offsets), else ValueError."""
    values = np.asarray(value)
    if values.ndim != 1 or values.dtype.kind not in "iu" or (values < 0).any():
        raise ValueError(f"{_short(_plain(value))} is not a list of non-negative integers")
    return tuple(int(n) for n in values)


def shard_problem(handle: h5py.File, index: CheckpointIndex, file: str) -> str | None:
    """Why a shard is not part of this save, if it is not: one copied in from another step or run differs here."""
    rank = int(SHARD_FILE.fullmatch(file)[1])
    expected = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": index.step, "save_id": index.save_id,
                "rank": rank, "world_size": index.world_size}
    for key, want in expected.items():
        have = _plain(handle.attrs.get(key))
        if have != want:
            return f"not part of this checkpoint: its {key} is {_short(have)}, the index says {_short(want)}"
    return None


def piece_problem(dataset: h5py.Dataset, record: TensorRecord, piece: PieceRecord) -> str | None:
    """Why a shard's dataset is not the piece the index says it is, if it is not (its own record disagrees)."""
    claims = {"tensor": record.name, "dtype": record.dtype, "global_shape": list(record.shape),
              "offsets": list(piece.offsets), "shape": list(piece.shape)}
    for key, want in claims.items():
        have = _plain(dataset.attrs.get(key))
        if have != want:
            return f"disagrees with the index: its {key} is {_short(have)}, the index says {_short(want)}"
    return _storage_problem(dataset, record.dtype, piece.shape)


def rank_state_meta(dataset: h5py.Dataset) -> tuple[str, tuple[int, ...]]:
    """A rank-state dataset's dtype and shape, from its attributes, checked against how it is stored."""
    file, name = dataset.file.filename, dataset.name.lstrip("/")
    dtype = check_dtype(_plain(dataset.attrs.get("dtype")), file, name)
    try:
        shape = _shape(dataset.attrs.get("shape"))
    except READ_ERRORS as exc:
        raise CheckpointError(f"{name} in {file} has a bad shape: {first_line(exc)}", file=file,
                              dataset=name) from exc
    problem = _storage_problem(dataset, dtype, shape)
    if problem:
        raise CheckpointError(f"{name} in {file} {problem}", file=file, dataset=name)
    return dtype, shape


def _storage_problem(dataset: h5py.Dataset, dtype: str, shape: tuple[int, ...]) -> str | None:
    if dataset.dtype != storage_dtype(dtype) or dataset.shape != storage_shape(shape):
        return f"is stored as {dataset.dtype}{list(dataset.shape)}, not as {dtype}{list(shape)}"
    return None


def _short(value: Any) -> str:
    """A value from a possibly damaged file, for a one-line message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


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

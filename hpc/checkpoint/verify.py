"""``hpc ckpt verify``: is every byte a resume would read present and intact?

The index lists every shard with its size and every dataset in it; each check below
catches a failure that HDF5 alone would let through or report without a name:

- a missing shard: virtual datasets over it would read as fill values, silently;
- a truncated shard: HDF5 refuses the whole file; the recorded byte ranges name the
  datasets that were cut off;
- a flipped bit: every dataset is read and hashed against its ``xxh3_64`` attribute,
  and HDF5's own metadata checksums fail on the object that holds it;
- an index whose virtual datasets point at files or datasets the manifest lacks.
"""

from __future__ import annotations

import multiprocessing
import os
import stat
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import h5py

from hpc.checkpoint.format import (
    COMPLETE,
    INDEX,
    RANK_STATE,
    READ_ERRORS,
    CheckpointError,
    CheckpointIndex,
    PieceRecord,
    TensorRecord,
    dataset_problem,
    first_line,
    hard_get,
    open_file,
    piece_problem,
    plain_dataset,
    rank_state_meta,
    read_index,
    shard_problem,
)
from hpc.checkpoint.pieces import check_records


@dataclass(frozen=True)
class Problem:
    file: str
    dataset: str  # empty when the whole file is at fault
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.dataset}: {self.message}" if self.dataset else f"{self.file}: {self.message}"


@dataclass(frozen=True)
class Report:
    problems: tuple[Problem, ...]
    files: int
    datasets: int
    nbytes: int  # bytes of data read and checked

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(step_dir: str | Path) -> Report:
    step_dir = Path(step_dir)
    try:
        index = read_index(step_dir)
        check_records(index)
    except CheckpointError as exc:
        return Report((Problem(str(step_dir / INDEX), "", exc.message),), 0, 0, 0)
    problems = []
    if not (step_dir / COMPLETE).is_file():
        problems.append(Problem(str(step_dir), "", f"no {COMPLETE} marker: the save never finished"))
    problems += _check_virtual_sources(index)
    datasets = nbytes = 0
    for shard in index.shards.values():
        found, checked, read = _check_shard(index, shard.file)
        problems += found
        datasets += checked
        nbytes += read
    return Report(tuple(problems), len(index.shards), datasets, nbytes)


def _check_shard(index: CheckpointIndex, file: str) -> tuple[list[Problem], int, int]:
    path, shard = index.path / file, index.shards[file]
    try:
        info = path.stat()
    except OSError as exc:
        return [Problem(str(path), "", "missing" if not os.path.lexists(path) else exc.strerror)], 0, 0
    if not stat.S_ISREG(info.st_mode):
        return [Problem(str(path), "", "not a regular file")], 0, 0
    if info.st_size != shard.size:
        cut = [Problem(str(path), name, f"cut off: its data ends at byte {end}, the file at {info.st_size}")
               for name, (_, end) in sorted(shard.extents.items()) if end > info.st_size]
        return [Problem(str(path), "", f"size is {info.st_size} bytes, the index recorded {shard.size}"), *cut], 0, 0
    try:
        handle = open_file(path)
    except CheckpointError as exc:
        return [Problem(str(path), "", exc.message)], 0, 0
    with handle:
        try:
            problem = shard_problem(handle, index, file)
        except READ_ERRORS as exc:
            problem = f"unreadable attributes: {first_line(exc)}"
        if problem:
            return [Problem(str(path), "", problem)], 0, 0
        return _check_datasets(handle, index, file)


def _check_datasets(handle: h5py.File, index: CheckpointIndex, file: str) -> tuple[list[Problem], int, int]:
    """Every dataset the manifest lists: the shard's own record of it agrees with the index, and it hashes right."""
    path = str(index.path / file)
    pieces = _pieces_in(index, file)
    problems, checked, read = [], 0, 0
    for name in sorted(index.shards[file].extents):
        try:
            dataset = plain_dataset(handle, name)
            if name.startswith(f"{RANK_STATE}/"):
                rank_state_meta(dataset)
                mismatch = None
            else:
                mismatch = piece_problem(dataset, *pieces[name]) if name in pieces else "no tensor of the index maps it"
            if mismatch:
                problems.append(Problem(path, name, mismatch))
                continue
            damage = dataset_problem(dataset)
            read += dataset.nbytes
            checked += 1
            if damage:
                problems.append(Problem(path, name, f"damaged: {damage}"))
        except CheckpointError as exc:
            problems.append(Problem(path, name, exc.message))
        except READ_ERRORS as exc:
            problems.append(Problem(path, name, f"unreadable: {first_line(exc)}"))
    return problems, checked, read


def _pieces_in(index: CheckpointIndex, file: str) -> dict[str, tuple[TensorRecord, PieceRecord]]:
    """The pieces the index says ``file`` holds, by dataset."""
    return {record.dataset: (record, piece) for record in index.tensors.values()
            for piece in record.pieces if piece.file == file}


VIRTUAL_CHECK_TIMEOUT_S = 60.0


def _check_virtual_sources(index: CheckpointIndex) -> list[Problem]:
    """Every virtual dataset maps only datasets the manifest promises, checked in a forked child: HDF5
    crashes (SIGSEGV) opening a virtual dataset whose mapping, in the unchecked global heap, is damaged."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_virtual_problems, args=(index, send), daemon=True)
    child.start()
    send.close()
    try:
        problems = receive.recv() if receive.poll(VIRTUAL_CHECK_TIMEOUT_S) else None
    except EOFError:
        problems = None
    child.join(timeout=5)
    if child.is_alive():
        child.kill()
        child.join()
    if problems is None:
        return [Problem(str(index.path / INDEX), "", f"a virtual dataset's mapping is damaged: HDF5 failed reading "
                                                     f"it (exit code {child.exitcode})")]
    return problems


def _send_virtual_problems(index: CheckpointIndex, send: Connection) -> None:
    send.send(_virtual_problems(index))
    send.close()


def _virtual_problems(index: CheckpointIndex) -> list[Problem]:
    problems = []
    path = index.path / INDEX
    try:
        with open_file(path) as handle:
            for record in index.tensors.values():
                for source in _virtual(handle, record.dataset).virtual_sources():
                    shard = index.shards.get(source.file_name)
                    if shard is None or source.dset_name.lstrip("/") not in shard.extents:
                        problems.append(Problem(str(path), record.dataset,
                                                f"maps {source.file_name}:{source.dset_name}, which no shard lists"))
    except CheckpointError as exc:
        problems.append(Problem(str(path), "", exc.message))
    except READ_ERRORS as exc:
        problems.append(Problem(str(path), "", f"unreadable virtual dataset: {first_line(exc)}"))
    return problems


def _virtual(handle: h5py.File, name: str) -> h5py.Dataset:
    node = hard_get(handle, name)
    if not isinstance(node, h5py.Dataset) or not node.is_virtual:
        raise CheckpointError(f"{name} in {handle.filename} is not a virtual dataset", file=handle.filename,
                              dataset=name)
    return node

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

from dataclasses import dataclass
from pathlib import Path

import h5py

from hpc.checkpoint.format import (
    COMPLETE,
    INDEX,
    CheckpointError,
    CheckpointIndex,
    ShardRecord,
    dataset_problem,
    first_line,
    read_index,
)


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
    except CheckpointError as exc:
        return Report((Problem(str(step_dir / INDEX), "", exc.message),), 0, 0, 0)
    problems = []
    if not (step_dir / COMPLETE).is_file():
        problems.append(Problem(str(step_dir), "", f"no {COMPLETE} marker: the save never finished"))
    problems += _check_virtual_sources(index)
    datasets = nbytes = 0
    for shard in index.shards.values():
        found, checked, read = _check_shard(step_dir / shard.file, shard)
        problems += found
        datasets += checked
        nbytes += read
    return Report(tuple(problems), len(index.shards), datasets, nbytes)


def _check_shard(path: Path, shard: ShardRecord) -> tuple[list[Problem], int, int]:
    if not path.is_file():
        return [Problem(str(path), "", "missing")], 0, 0
    size = path.stat().st_size
    if size != shard.size:
        cut = [Problem(str(path), name, f"cut off: its data ends at byte {end}, the file at {size}")
               for name, (_, end) in sorted(shard.extents.items()) if end > size]
        return [Problem(str(path), "", f"size is {size} bytes, the index recorded {shard.size}"), *cut], 0, 0
    problems, checked, read = [], 0, 0
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        return [Problem(str(path), "", f"not a readable HDF5 file: {first_line(exc)}")], 0, 0
    with handle:
        for name in sorted(shard.extents):
            try:
                dataset = handle[name]
                problem = dataset_problem(dataset)
                read += dataset.nbytes
                checked += 1
                if problem:
                    problems.append(Problem(str(path), name, f"damaged: {problem}"))
            except (OSError, KeyError, RuntimeError) as exc:
                problems.append(Problem(str(path), name, f"unreadable: {first_line(exc)}"))
    return problems, checked, read


def _check_virtual_sources(index: CheckpointIndex) -> list[Problem]:
    """Every virtual dataset maps only datasets that the manifest promises."""
    problems = []
    path = index.path / INDEX
    with h5py.File(path, "r") as handle:
        for record in index.tensors.values():
            for source in handle[record.dataset].virtual_sources():
                shard = index.shards.get(source.file_name)
                if shard is None or source.dset_name.lstrip("/") not in shard.extents:
                    problems.append(Problem(str(path), record.dataset,
                                            f"maps {source.file_name}:{source.dset_name}, which no shard lists"))
    return problems

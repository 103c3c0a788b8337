"""Saving: every rank writes its own shard in parallel; rank 0 commits the step atomically.

Protocol for one step (all ranks, then rank 0 alone):

1. metadata agreement (the only collective): the first save, and any save where some
   rank's piece list changed, sends every rank's piece list and rank 0's random token
   through ``all_gather_object`` on the group the caller passes, and every rank computes
   the same write plan (``pieces.plan_writes``); the saves after it only all-reduce one
   flag, "did my pieces change?", and reuse that plan with the token of the agreement
   plus a count of saves since, which every rank keeps alike;
2. each rank writes ``rank-XXXXX.h5`` into ``step-XXXXXXXX.tmp-<token>/``, fsyncs it,
   and announces it with ``rank-XXXXX.done`` (a JSON manifest: size and the byte
   range of every dataset), or ``rank-XXXXX.failed`` with the error;
3. rank 0 waits for every rank's ``.done`` file, writes ``index.h5``, fsyncs it,
   writes ``COMPLETE``, fsyncs the directory, renames it to ``step-XXXXXXXX``,
   fsyncs the parent, then points ``latest`` at it and retires the checkpoints
   beyond ``keep`` (renamed at once, deleted in the background).

The "all ranks have written" barrier is made of files rather than a collective on
purpose: in asynchronous mode steps 2-3 run on a background thread while training
keeps using the same process group, and torch.distributed does not allow two
threads to issue collectives on one group concurrently. Only step 1 runs in the
caller; after it the background thread touches nothing but the file system.

Asynchronous mode copies this rank's share of the pieces into host buffers kept
between saves (:class:`HostStaging`; from a GPU into pinned memory, on a copy stream of
its own, with one wait at the end), and the training loop waits only for that copy,
measured against a bare copy into the same kind of memory by ``hpc bench checkpoint``;
it writes in the background, keeps at most one
save in flight, and raises a failed save's error at the next ``save`` or at
``finalize``. What the loop would otherwise wait for besides the copy, found by timing
each part of ``save`` on a loaded 2-core machine: the metadata exchange (two collectives
and pickling, 2-230 ms when the cores are busy) and starting a thread per save (0.2-650 ms:
``Thread.start`` waits until the new thread runs), and, once those were gone, the
other rank's writer: a rank done copying early wrote into the page cache at memory
speed while the slower rank still copied (async stall 0.6-1.9x of the bench's memcpy
row over 9 loaded runs, 0.2-1.2x over 8 once writers wait). So the flag's all-reduce travels while the copy runs
(the copy follows the agreed plan; the rare save whose flag says a piece list changed
agrees anew and copies again), one writer thread lives as long as the checkpointer,
woken through a queue, and it writes only after a barrier that the save posts and
never waits for.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.distributed as dist

from hpc.checkpoint.discovery import delete, publish, retire_old, write_latest
from hpc.checkpoint.format import (
    COMPLETE,
    INDEX,
    LIBVER,
    RANK_STATE,
    RESERVED_ATTRS,
    TENSORS,
    CheckpointError,
    ShardRecord,
    check_name,
    data_extent,
    done_name,
    failed_name,
    first_line,
    piece_attrs,
    shard_attrs,
    shard_name,
    text_attr,
    tmp_dir_name,
    write_checksummed,
    write_index,
)
from hpc.checkpoint.pieces import Piece, PieceMeta, SavePlan, dtype_name, plan_writes
from hpc.rundir import fsync_path, write_json

WRITEBACK_INTERVAL_S = 0.02


@dataclass(frozen=True)
class _Array:
    """One dataset to write: its path in the shard, its bytes (a numpy view of a tensor), its attributes."""

    path: str
    data: np.ndarray
    attrs: Mapping[str, Any]


@dataclass(frozen=True)
class _SaveJob:
    root: Path
    tmp: Path
    step: int
    save_id: str  # rank 0's random token: written into the index and every shard of this save
    rank: int
    world_size: int
    arrays: tuple[_Array, ...]
    plan: SavePlan
    attrs: Mapping[str, Any]
    created_unix: float  # rank 0's clock at the save: only rank 0's index records it
    keep: int
    commit_timeout_s: float


@dataclass(frozen=True)
class _Agreement:
    """What every rank learned at the last metadata exchange: reused while no rank's pieces change."""

    metas: list[PieceMeta]  # this rank's pieces then
    plan: SavePlan
    token: str  # rank 0's random token then; a save's token ends in the count of saves since

    def save_token(self, since: int) -> str:
        return f"{self.token[:-8]}{since:08x}"


class HostStaging:
    """Host copies of what an asynchronous save writes, in buffers kept per dataset path between saves.

    A buffer is allocated once, again only when its tensor's shape, dtype or kind of memory
    changes, and dropped once a save no longer writes its path. A GPU tensor goes into pinned
    memory, copied ``non_blocking`` on a stream of its device's own that first waits for the
    current stream (the kernels computing the tensor); :meth:`wait` returns once every copy
    issued since :meth:`begin` landed: that is the training loop's stall. A CPU tensor is
    copied at once into ordinary memory. Nobody may ``begin`` while a writer still reads the
    buffers: ``Checkpointer.save`` waits for the save in flight first.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, tuple[torch.Tensor, bool]] = {}  # path -> (buffer, pinned)
        self._used: set[str] = set()
        self._streams: dict[torch.device, Any] = {}  # device -> its torch.cuda.Stream of copies
        self._issued: set[torch.device] = set()  # devices with copies issued since begin

    def begin(self) -> None:
        self._used.clear()
        self._issued.clear()

    def copy(self, path: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s host copy (a GPU's still in flight until :meth:`wait`)."""
        buffer, pinned = self.buffers.get(path, (None, False))
        if buffer is None or (buffer.shape, buffer.dtype, pinned) != (tensor.shape, tensor.dtype, tensor.is_cuda):
            self.buffers.pop(path, None)  # the old one freed before its successor is allocated
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self.buffers[path] = (buffer, tensor.is_cuda)
        self._used.add(path)
        if not tensor.is_cuda:
            return buffer.copy_(tensor)
        with torch.cuda.stream(self._stream(tensor.device)):
            return buffer.copy_(tensor, non_blocking=True)

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        if device not in self._issued:
            stream.wait_stream(torch.cuda.current_stream(device))
            self._issued.add(device)
        return stream

    def wait(self) -> None:
        """Block until the copies issued since :meth:`begin` are in host memory; drop the buffers not used."""
        for device in self._issued:
            self._streams[device].synchronize()
        self._issued.clear()
        for path in set(self.buffers) - self._used:
            del self.buffers[path]


class Checkpointer:
    """Saves steps of a job into ``root``; every rank of ``group`` must call ``save`` for each step."""

    def __init__(
        self,
        root: str | Path,
        group: dist.ProcessGroup,
        *,
        keep: int = 3,
        async_save: bool = False,
        commit_timeout_s: float = 300.0,
    ) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.keep = keep
        self.async_save = async_save
        self.commit_timeout_s = commit_timeout_s
        self._staging = HostStaging()  # the asynchronous save's host buffers, reused between saves
        self._agreed: _Agreement | None = None
        self._since = 0  # saves since the last exchange, counted alike on every rank
        self._jobs: queue.SimpleQueue[tuple[_SaveJob, dist.Work]] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None  # started by the first asynchronous save
        self._written = threading.Event()  # set by the writer when the job in flight is done
        self._in_flight = False
        self._deleter: threading.Thread | None = None
        self._outcome: tuple[int, Path | None, BaseException | None] | None = None
        self._last: Path | None = None

    def save(
        self,
        step: int,
        pieces: Sequence[Piece],
        rank_state: Mapping[str, torch.Tensor] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint ``step``: this rank's pieces, its private ``rank_state``, and index ``attrs``.

        Collective over the group. Returns once the step is committed, or in
        asynchronous mode once the data is copied to host memory.
        """
        self.finalize()
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        attrs = dict(attrs or {})
        clash = RESERVED_ATTRS.intersection(attrs)
        if clash:
            raise CheckpointError(f"attrs {sorted(clash)} are reserved for the checkpoint itself")
        for key in rank_state or {}:
            check_name(key)
        metas = [piece.meta() for piece in pieces]
        arrays = self._agree_and_copy(pieces, metas, rank_state or {})
        token = self._agreed.save_token(self._since)
        job = _SaveJob(
            root=self.root, tmp=self.root / tmp_dir_name(step, token), step=step, save_id=token, rank=self.rank,
            world_size=self.world_size, arrays=tuple(arrays), plan=self._agreed.plan, attrs=attrs,
            created_unix=time.time(), keep=self.keep, commit_timeout_s=self.commit_timeout_s,
        )
        self._since += 1
        if self.async_save:
            self._hand_over(job)
            return
        self._run_and_agree(job)

    def _agree_and_copy(
        self, pieces: Sequence[Piece], metas: list[PieceMeta], rank_state: Mapping[str, torch.Tensor]
    ) -> list[_Array]:
        """The arrays this rank writes under a plan every rank agrees on; the copy overlaps the agreement."""
        if self._agreed is not None:
            changed = torch.tensor([int(metas != self._agreed.metas)], dtype=torch.int64)
            pending = dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            arrays = self._arrays(pieces, metas, self._agreed.plan, rank_state)
            pending.wait()
            if not changed.item():
                return arrays
        self._agreed, self._since = self._exchange(metas), 0
        return self._arrays(pieces, metas, self._agreed.plan, rank_state)

    def _arrays(
        self, pieces: Sequence[Piece], metas: list[PieceMeta], plan: SavePlan, rank_state: Mapping[str, torch.Tensor]
    ) -> list[_Array]:
        mine = plan.written_by(self.rank)
        self._staging.begin()
        arrays = [
            _Array(f"{TENSORS}/{meta.name}", self._host(f"{TENSORS}/{meta.name}", piece.tensor),
                   piece_attrs(meta.name, meta.dtype, meta.global_shape, meta.offsets, meta.shape))
            for piece, meta in zip(pieces, metas, strict=True)
            if meta.key in mine
        ]
        arrays += [
            _Array(f"{RANK_STATE}/{key}", self._host(f"{RANK_STATE}/{key}", tensor),
                   {"dtype": text_attr(dtype_name(tensor)), "shape": np.asarray(tensor.shape, dtype=np.int64)})
            for key, tensor in rank_state.items()
        ]
        self._staging.wait()  # the tensors are still referenced here: none freed while a copy reads it
        return arrays

    def _hand_over(self, job: _SaveJob) -> None:
        """To the writer thread, started once: a thread per save would cost a start-up the loop waits for.

        The writer starts once every rank has copied (a barrier this thread posts and does not
        wait for): a rank done early would otherwise write, at memory speed into the page cache,
        while a slower rank still copies, and slow that copy down."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_jobs, name="ckpt-writer", daemon=True)
            self._writer.start()
        self._written.clear()
        self._in_flight = True
        self._jobs.put((job, dist.barrier(group=self.group, async_op=True)))

    def _write_jobs(self) -> None:
        while True:
            job, copied = self._jobs.get()
            self._run_in_background(job, copied)
            self._written.set()

    def finalize(self) -> Path | None:
        """Wait for the save in flight, re-raise its error; returns the newest step directory committed here.

        Only rank 0 commits, so other ranks get None.
        """
        if self._in_flight:
            self._written.wait()
            self._in_flight = False
        if self._deleter is not None:
            self._deleter.join()
        self._deleter = None
        if self._outcome is not None:
            step, final, error = self._outcome
            self._outcome = None
            if error is not None:
                raise CheckpointError(f"background save of step {step} failed: {first_line(error)}") from error
            self._last = final or self._last
        return self._last

    def _exchange(self, metas: list[PieceMeta]) -> _Agreement:
        mine = {"pieces": [m.to_wire() for m in metas]}
        if self.rank == 0:
            mine["token"] = uuid.uuid4().hex
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        plan = plan_writes([[PieceMeta.from_wire(p) for p in g["pieces"]] for g in gathered])
        return _Agreement(metas, plan, gathered[0]["token"])

    def _host(self, path: str, tensor: torch.Tensor) -> np.ndarray:
        """The bytes to write: a view of the tensor itself when saving synchronously, else a host copy
        (from a GPU still in flight until ``self._staging.wait()``)."""
        tensor = tensor.detach()
        if self.async_save:
            tensor = self._staging.copy(path, tensor)
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.uint16)
        return np.ascontiguousarray(tensor.cpu().numpy())

    def _run_in_background(self, job: _SaveJob, copied: dist.Work) -> None:
        try:
            copied.wait()
            final, retired = _write_and_commit(job)
            delete(retired)
            self._outcome = (job.step, final, None)
        except BaseException as exc:  # handed to the training thread at its next save or finalize
            self._outcome = (job.step, None, exc)

    def _run_and_agree(self, job: _SaveJob) -> None:
        """Synchronous save: every rank learns whether the step was committed, and why not."""
        error = None
        try:
            final, retired = _write_and_commit(job)
            self._last = final or self._last
            if retired:
                self._deleter = threading.Thread(target=delete, args=(retired,), name="ckpt-prune", daemon=True)
                self._deleter.start()
        except Exception as exc:
            error = f"rank {self.rank}: {first_line(exc)}"
        outcomes: list[Any] = [None] * self.world_size
        dist.all_gather_object(outcomes, error, group=self.group)
        failures = [o for o in outcomes if o]
        if failures:
            raise CheckpointError(f"save of step {job.step} failed: {'; '.join(failures)}", dir=str(job.tmp))


def _write_and_commit(job: _SaveJob) -> tuple[Path | None, list[Path]]:
    """This rank's shard; on rank 0 also the commit. Returns (the published step, directories to delete)."""
    job.tmp.mkdir(parents=True, exist_ok=True)
    try:
        shard = _write_shard(job.tmp / shard_name(job.rank), job)
    except BaseException as exc:
        (job.tmp / failed_name(job.rank)).write_text(f"{type(exc).__name__}: {first_line(exc)}\n")
        raise
    write_json(job.tmp / done_name(job.rank), {"size": shard.size, "extents": shard.extents})
    return _commit(job) if job.rank == 0 else (None, [])


def _write_shard(path: Path, job: _SaveJob) -> ShardRecord:
    """This rank's file: its share of the pieces and its private state, each dataset checksummed."""
    extents = {}
    with h5py.File(path, "w", libver=LIBVER) as shard, writeback_while_writing(path):
        shard.attrs.update(shard_attrs(job.step, job.rank, job.world_size, job.save_id))
        for array in job.arrays:
            dataset = write_checksummed(shard, array.path, array.data)
            dataset.attrs.update(array.attrs)
            extents[array.path] = data_extent(dataset)
    fsync_path(path)
    return ShardRecord(file=path.name, size=path.stat().st_size, extents=extents)


@contextmanager
def writeback_while_writing(path: Path) -> Iterator[None]:
    """Push the file's dirty pages to the device while the rest is still being copied into the page cache.

    Left alone, the kernel starts writeback only past ``dirty_background_ratio`` (GBs)
    or after half a minute, so the final fsync would wait for the whole file after all
    the CPU work; flushing from a second thread overlaps the two (HDF5 releases the GIL).
    """
    stop = threading.Event()

    def flush() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while not stop.wait(WRITEBACK_INTERVAL_S):
                os.fdatasync(fd)
        finally:
            os.close(fd)

    flusher = threading.Thread(target=flush, name="ckpt-writeback", daemon=True)
    flusher.start()
    try:
        yield
    finally:
        stop.set()
        flusher.join()


def _commit(job: _SaveJob) -> tuple[Path, list[Path]]:
    """Rank 0, once every shard is written: index, marker, rename, ``latest``, retention."""
    shards = _wait_for_shards(job)
    header = {"step": job.step, "world_size": job.world_size, "created_unix": job.created_unix, "save_id": job.save_id}
    write_index(job.tmp / INDEX, header, job.attrs, job.plan.tensors, shards)
    fsync_path(job.tmp / INDEX)
    for rank in range(job.world_size):
        (job.tmp / done_name(rank)).unlink()
    write_json(job.tmp / COMPLETE, {"step": job.step, "files": len(shards)})
    fsync_path(job.tmp)
    final, replaced = publish(job.tmp, job.step)
    write_latest(job.root, final)
    return final, replaced + retire_old(job.root, job.keep, final)


def _wait_for_shards(job: _SaveJob) -> list[ShardRecord]:
    """The file barrier: every rank's manifest, a failed rank's error, or a timeout naming the missing."""
    shards: dict[int, ShardRecord] = {}
    deadline = time.monotonic() + job.commit_timeout_s
    pause = 0.001
    while len(shards) < job.world_size:
        for rank in range(job.world_size):
            if rank in shards:
                continue
            failed = job.tmp / failed_name(rank)
            if failed.exists():
                raise CheckpointError(f"rank {rank} could not write its shard: {failed.read_text().strip()}")
            done = job.tmp / done_name(rank)
            if done.exists():
                manifest = json.loads(done.read_text())
                extents = {path: tuple(extent) for path, extent in manifest["extents"].items()}
                shards[rank] = ShardRecord(shard_name(rank), manifest["size"], extents)
        if len(shards) < job.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(job.world_size)) - set(shards))
                raise CheckpointError(
                    f"ranks {missing} did not finish writing step {job.step} within {job.commit_timeout_s:g} s",
                    dir=str(job.tmp),
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
    return [shards[rank] for rank in range(job.world_size)]

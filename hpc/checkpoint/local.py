"""The node-local checkpoint tier: every few steps each rank writes its shard to its node's scratch and a copy to
one peer node; a restart loads the newest step every rank can get from some node, else the persistent checkpoint.

A persistent checkpoint on the shared filesystem costs a whole write of the model and optimizer to the slowest
storage of the cluster, so it is taken every N steps and a failure loses up to N steps. The local tier is what
Megatron's local checkpoints and NVIDIA's in-job restart pair with restarting inside the allocation: the node's
own disk, often every few steps, and a copy of each node's shards on the next node, so a node that is gone
(replaced by a spare) loses nothing. The files are the persistent tier's (hpc/checkpoint/format.py: sharded HDF5,
every dataset checksummed, a ``COMPLETE`` marker, renamed into place), in ``<scratch>/hpc-local/<run>/step-*/``
on each node, where scratch is ``$SLURM_TMPDIR`` or the temporary directory.

Why not the persistent tier's code as it is: its commit is a file barrier in one shared directory (rank 0 waits
for every rank's manifest), and no directory is shared here. So a save here commits through a collective: each
rank writes its shard, sends the file to the rank at its place on the next node (point to point on a Gloo group
beside the job's: NCCL carries only device memory), all ranks gather the manifests, and the first rank of each
node writes the index and the marker into its node's step and renames it into place. A restore agrees on the
newest step whose shards some node holds for every saved rank (newer than the persistent checkpoint), then
sends each node the files its ranks' pieces live in that it lacks (a spare has none), in one order every rank
follows, and loads from the node's own copy, verified as any checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc.checkpoint.discovery import delete, list_checkpoints, publish, retire_old
from hpc.checkpoint.format import (
    COMPLETE,
    INDEX,
    CheckpointError,
    CheckpointIndex,
    read_index,
    shard_name,
    step_dir_name,
    write_index,
)
from hpc.checkpoint.pieces import Piece, check_records
from hpc.checkpoint.save import Checkpointer, _SaveJob, _write_shard
from hpc.rundir import fsync_path, write_json
from hpc.runtime.abort import first_line


class LocalTier:
    """This rank's part of the local tier of a run (see the module); built collectively, by every rank at once."""

    def __init__(self, root: Path, node: int, keep: int = 2) -> None:
        self.root, self.rank, self.size = Path(root), dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")  # every rank creates it, in the same order
        nodes: list[Any] = [None] * self.size
        dist.all_gather_object(nodes, node, group=self.group)
        self.node_of = list(nodes)
        self.node_ranks = {n: [r for r in range(self.size) if self.node_of[r] == n] for n in sorted(set(nodes))}
        order = list(self.node_ranks)
        mine = self.node_ranks[node]
        self.leader = mine[0] == self.rank  # writes its node's index and marker, receives its node's files
        place = mine.index(self.rank)
        after = self.node_ranks[order[(order.index(node) + 1) % len(order)]]
        before = self.node_ranks[order[(order.index(node) - 1) % len(order)]]
        alone = len(order) == 1
        self.peer = None if alone or place >= len(after) else after[place]  # receives a copy of my shard
        self.copied_from = None if alone or place >= len(before) else before[place]
        self.checkpointer = _NodeCheckpointer(self.root, self.group, keep=keep, tier=self)

    def save(self, step: int, pieces: Sequence[Piece], private: dict[str, torch.Tensor], attrs: dict) -> None:
        """Collective: ``step`` into every node's local directory, each shard also on the next node."""
        self.checkpointer.save(step, pieces, private, attrs)

    def copy_to_peer(self, directory: Path | None) -> None:
        """My shard to my peer and the previous node's to me, as one batch (a ring of nodes); ``directory`` None:
        my shard failed, so my peer gets nothing (the save fails on every rank after)."""
        sends = [] if self.peer is None or directory is None else [_file_bytes(directory / shard_name(self.rank))]
        received = self._exchange(sends, self.peer, self.copied_from)
        if received is not None and directory is not None:
            _write_bytes(directory / shard_name(self.copied_from), received)

    def _exchange(self, sends: list[torch.Tensor], to: int | None, source: int | None) -> torch.Tensor | None:
        """Send ``sends[0]`` (nothing: an empty file) to ``to`` while receiving from ``source``: the sizes first,
        then the bytes where there are any. Returns what came, None for nothing."""
        size_out, size_in = torch.tensor([sends[0].numel() if sends else 0]), torch.zeros(1, dtype=torch.int64)
        self._batch([(size_out, to, True), (size_in if source is not None else None, source, False)])
        data_in = torch.empty(int(size_in.item()), dtype=torch.uint8) if source is not None and size_in.item() else None
        self._batch([(sends[0] if sends and sends[0].numel() else None, to, True), (data_in, source, False)])
        return data_in

    def _batch(self, ops: list[tuple[torch.Tensor | None, int | None, bool]]) -> None:
        posted = [dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, group=self.group)
                  for tensor, peer, send in ops if tensor is not None and peer is not None]
        for work in dist.batch_isend_irecv(posted) if posted else []:
            work.wait()

    def restore(self, newer_than: int | None, needed: Any) -> CheckpointIndex | None:
        """Collective: the index, in this node's directory, of the newest local step (above ``newer_than``) that
        some node holds every shard of, with the files ``needed(index)`` names fetched from the nodes that have
        them and checked at their full size (a node holds its ranks' shards and copies, not all of them, so the
        persistent tier's check of every shard does not apply); None when there is none."""
        held = _inventory(self.root)
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, (self.node_of[self.rank], held), group=self.group)
        step = _newest_restorable(gathered, -1 if newer_than is None else newer_than)
        if step is None:
            return None
        name = step_dir_name(step)
        have = {node: set(files.get(step, {}).get("files", ())) for node, files in gathered}
        self._fetch(name, [(INDEX, node) for node in self.node_ranks if INDEX not in have.get(node, set())], have)
        index = read_index(self.root / name)
        check_records(index)
        mine = needed(index)
        wants: list[Any] = [None] * self.size
        dist.all_gather_object(wants, sorted(mine), group=self.group)
        missing = sorted({(file, self.node_of[rank]) for rank, files in enumerate(wants) for file in files
                          if file not in have[self.node_of[rank]]})
        self._fetch(name, missing, have)
        for file in mine:
            path, shard = index.path / file, index.shards.get(file)
            if shard is None or not path.is_file() or path.stat().st_size != shard.size:
                raise CheckpointError(f"{path} is missing or not the size the index says", file=str(path))
        return index

    def _fetch(self, name: str, missing: list[tuple[str, int]], have: dict[int, set[str]]) -> None:
        """Each (file, node) in turn: the first rank of a node that has it sends it to the node's first rank."""
        for file, node in missing:
            source = self.node_ranks[min(n for n, files in have.items() if file in files)][0]
            target = self.node_ranks[node][0]
            if self.rank == source:
                self._exchange([_file_bytes(self.root / name / file)], target, None)
            elif self.rank == target:
                (self.root / name).mkdir(parents=True, exist_ok=True)
                _write_bytes(self.root / name / file, self._exchange([], None, source))
            have[node].add(file)
        dist.barrier(group=self.group)


class _NodeCheckpointer(Checkpointer):
    """The persistent tier's writer, committed per node through a collective instead of a shared-file barrier."""

    def __init__(self, root: Path, group: Any, *, keep: int, tier: LocalTier) -> None:
        super().__init__(root, group, keep=keep)
        self.tier = tier

    def _run_and_agree(self, job: _SaveJob) -> None:
        error, shard = None, None
        try:
            job.tmp.mkdir(parents=True, exist_ok=True)
            shard = _write_shard(job.tmp / shard_name(job.rank), job)
        except Exception as exc:
            error = f"rank {self.rank}: {first_line(exc)}"
        self.tier.copy_to_peer(job.tmp if error is None else None)
        outcomes: list[Any] = [None] * self.world_size
        dist.all_gather_object(outcomes, (error, shard), group=self.group)
        failures = [failed for failed, _ in outcomes if failed]
        if failures:
            shutil.rmtree(job.tmp, ignore_errors=True)
            raise CheckpointError(f"local save of step {job.step} failed: {'; '.join(failures)}", dir=str(job.tmp))
        if self.tier.leader:
            header = {"step": job.step, "world_size": job.world_size, "created_unix": job.created_unix,
                      "save_id": job.save_id}
            write_index(job.tmp / INDEX, header, job.attrs, job.plan.tensors, [s for _, s in outcomes])
            fsync_path(job.tmp / INDEX)
            write_json(job.tmp / COMPLETE, {"step": job.step, "files": self.world_size})
            fsync_path(job.tmp)
            final, replaced = publish(job.tmp, job.step)
            delete(replaced + retire_old(self.root, job.keep, final))


def _inventory(root: Path) -> dict[int, dict[str, Any]]:
    """This node's complete local steps: step -> the saved world size and the files there."""
    held = {}
    for entry in list_checkpoints(root) if root.is_dir() else []:
        if entry.complete:
            try:
                world_size = read_index(entry.path).world_size
            except (CheckpointError, OSError):
                continue
            held[entry.step] = {"world_size": world_size, "files": sorted(p.name for p in entry.path.iterdir())}
    return held


def _newest_restorable(gathered: list[tuple[int, dict]], newer_than: int) -> int | None:
    """The newest step, above ``newer_than``, some node holds each saved rank's shard of."""
    steps = sorted({step for _, held in gathered for step in held if step > newer_than}, reverse=True)
    for step in steps:
        files = {file for _, held in gathered for file in held.get(step, {}).get("files", ())}
        world_size = next(held[step]["world_size"] for _, held in gathered if step in held)
        if all(shard_name(rank) in files for rank in range(world_size)):
            return step
    return None


def _file_bytes(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def _write_bytes(path: Path, data: torch.Tensor) -> None:
    partial = path.with_name(path.name + ".part")
    data.numpy().tofile(partial)
    fsync_path(partial)
    os.replace(partial, path)


def needed_files(index: Any, pieces: Sequence[Piece], rank: int) -> set[str]:
    """The shard files ``pieces`` are read from (every stored piece overlapping one), and ``rank``'s own."""
    files = {shard_name(rank)} if rank < index.world_size else set()
    for piece in pieces:
        record = index.tensors.get(piece.name)
        if record is None:
            continue
        meta = piece.meta()
        for stored in record.pieces:
            if all(a < b + m and b < a + n for a, n, b, m in zip(meta.offsets, meta.shape, stored.offsets,
                                                                  stored.shape, strict=True)):  # a scalar: all()
                files.add(stored.file)
    return files

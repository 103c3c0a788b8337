"""``hpc bench checkpoint``: one training state saved and loaded by each implementation, in one run.

- ``hdf5``: this package, synchronous; ``hdf5-async``: the training loop waits only
  for the copy to host memory (``stall_s``), ``time_s`` runs until the step is committed;
- ``torch.save``: rank 0 writes the full state dict (what data-parallel jobs do), every
  rank ``torch.load``s it (``weights_only``);
- ``dcp``: ``torch.distributed.checkpoint``, which also writes replicated tensors once;
- ``disk``: every rank writes its share of the bytes in 16 MiB blocks, with the same
  early writeback as our shards, then reads all of them back: the file system's
  sequential rate through the page cache, the physical limit of that path;
- ``memcpy`` (save only): every rank copies the pieces the write plan gives it into
  host buffers kept between rounds, all ranks at once: the copy an asynchronous save
  makes the training loop wait for, with nothing else, so the floor of ``stall_s``
  as ``disk`` is the floor of a save's ``time_s``; ``stall_of_memcpy`` is a save's stall
  over the memcpy row's, of the same run.

With ``--device cuda`` (the default where a GPU is visible) the state lives on each rank's
GPU: ``memcpy`` is then the device-to-host copy into pinned buffers (what the asynchronous
save stages into), and ``memcpy-pageable`` the same copy into ordinary host memory, each
timed up to a ``torch.cuda.synchronize``; the ``hdf5`` row copies through pageable memory.

The state is replicated on every rank (data parallelism): parameters plus Adam's two
moments, random float32. Every save is fsynced before its clock stops (DCP fsyncs by
itself), so no row is timed against the page cache; loads read what was just written,
through the page cache, alike for all. Files are deleted and ``sync``ed between
measurements, untimed. Rounds interleave the implementations so that a noisy machine
hurts them alike; a time is the slowest rank's, a row the median round after one
warm-up round. MBps is the state's bytes over the time (each rank loads all of it).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hpc import text
from hpc.checkpoint.load import load_into, open_checkpoint
from hpc.checkpoint.pieces import Piece, plan_writes
from hpc.checkpoint.save import Checkpointer, writeback_while_writing
from hpc.rundir import fsync_path
from jobs.bench.options import resolve_device

IMPLS = ("hdf5", "hdf5-async", "torch.save", "dcp", "disk", "memcpy")
CUDA_IMPLS = (*IMPLS, "memcpy-pageable")  # memcpy: into pinned memory
COLUMNS = ("impl", "op", "device", "bytes", "ranks", "time_s", "MBps", "stall_s", "stall_of_memcpy", "of_disk")
HEADER = ("impl", "op", "device", "bytes", "ranks", "time(s)", "MB/s", "stall(s)", "of memcpy", "of disk")
BLOCK = 16 << 20
WIDTH = 1024


def training_state(nbytes: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    """``tensors`` weight matrices and their Adam moments, ``nbytes`` in all."""
    rows = max(1, -(-nbytes // (3 * tensors * WIDTH * 4)))
    generator = torch.Generator().manual_seed(0)
    state = {}
    for i in range(tensors):
        for name in (f"model/layer{i}.weight", f"optim/layer{i}.weight/exp_avg", f"optim/layer{i}.weight/exp_avg_sq"):
            state[name] = torch.randn(rows, WIDTH, generator=generator)
    return state


def _slowest(seconds: float, group: dist.ProcessGroup) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()


def _timed(fn: Callable[[], object], group: dist.ProcessGroup, cuda: bool = False) -> float:
    """The slowest rank's seconds for ``fn``; with ``cuda``, from an idle GPU until its work is done."""
    dist.barrier(group=group)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return _slowest(time.perf_counter() - start, group)


class _Bench:
    """Each implementation's save and load of ``state``; HDF5 savers persist, as in a training job."""

    def __init__(self, root: Path, state: dict[str, torch.Tensor], group: dist.ProcessGroup) -> None:
        self.root, self.state, self.group = root, state, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.cuda = any(t.is_cuda for t in state.values())
        self.impls = CUDA_IMPLS if self.cuda else IMPLS
        self.into = {name: torch.empty_like(t) for name, t in state.items()}
        self.savers = {mode: Checkpointer(root / mode, group, keep=1, async_save=mode == "hdf5-async")
                       for mode in ("hdf5", "hdf5-async")}
        metas = [Piece.whole(name, t).meta() for name, t in state.items()]
        mine = plan_writes([metas] * self.size).written_by(self.rank)
        share = [t for meta, t in zip(metas, state.values(), strict=True) if meta.key in mine]
        self.shares = {"memcpy": [(t, torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)) for t in share]}
        if self.cuda:
            self.shares["memcpy-pageable"] = [(t, torch.empty(t.shape, dtype=t.dtype)) for t in share]

    def timed(self, fn: Callable[[], object]) -> float:
        return _timed(fn, self.group, self.cuda)

    def run(self, impl: str, step: int) -> tuple[float, float, float | None]:
        """(save seconds, stall seconds, load seconds or None), then the files are removed."""
        if impl in self.savers:
            measured = self.hdf5(self.savers[impl], step)
        elif impl in self.shares:
            copy = self.timed(lambda: self.copy_share(impl))
            measured = (copy, copy, None)
        else:
            save, load = {"torch.save": self.torch_save, "dcp": self.dcp, "disk": self.disk}[impl]()
            measured = (save, save, load)
        dist.barrier(group=self.group)
        if self.rank == 0:
            for child in self.root.iterdir():
                shutil.rmtree(child / f"step-{step:08d}" if child.name in self.savers else child, ignore_errors=True)
            os.sync()  # with `-o discard` the freed blocks are trimmed at the next journal commit: not in a timed one
        dist.barrier(group=self.group)
        return measured

    def copy_share(self, impl: str) -> None:
        """Into host buffers kept between rounds; from a GPU into pinned ones without blocking each copy."""
        for tensor, buffer in self.shares[impl]:
            buffer.copy_(tensor, non_blocking=self.cuda and impl == "memcpy")

    def hdf5(self, saver: Checkpointer, step: int) -> tuple[float, float, float]:
        pieces = [Piece.whole(name, t) for name, t in self.state.items()]
        stalls = []

        def save() -> None:
            started = time.perf_counter()
            saver.save(step, pieces)
            stalls.append(time.perf_counter() - started)
            saver.finalize()

        elapsed = self.timed(save)
        stall = _slowest(stalls[0], self.group)
        step_dir = saver.root / f"step-{step:08d}"

        def load() -> None:
            load_into(open_checkpoint(step_dir), [Piece.whole(n, t) for n, t in self.into.items()])

        return elapsed, stall, self.timed(load)

    def torch_save(self) -> tuple[float, float]:
        path = self.root / "torch" / "state.pt"
        path.parent.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            if self.rank == 0:
                torch.save(self.state, path)
                fsync_path(path)

        elapsed = self.timed(save)
        return elapsed, self.timed(lambda: torch.load(path, weights_only=True))

    def dcp(self) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp

        path = self.root / "dcp"
        elapsed = self.timed(lambda: dcp.save(self.state, checkpoint_id=path, process_group=self.group))
        return elapsed, self.timed(lambda: dcp.load(self.into, checkpoint_id=path, process_group=self.group))

    def disk(self) -> tuple[float, float]:
        nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        share = -(-nbytes // self.size)
        block = memoryview(os.urandom(BLOCK))
        paths = [self.root / "disk" / f"rank-{r}.bin" for r in range(self.size)]
        paths[0].parent.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            fd = os.open(paths[self.rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                with writeback_while_writing(paths[self.rank]):
                    for offset in range(0, share, BLOCK):
                        os.write(fd, block[: min(BLOCK, share - offset)])
                os.fsync(fd)
            finally:
                os.close(fd)

        def load() -> None:
            buffer = bytearray(BLOCK)
            for path in paths:
                with open(path, "rb", buffering=0) as handle:
                    while handle.readinto(buffer):
                        pass

        elapsed = self.timed(save)
        return elapsed, self.timed(load)


def bench_checkpoint(
    directory: Path, nbytes: int, iters: int, group: dist.ProcessGroup, device: str = "auto"
) -> list[dict]:
    """Rows of ``COLUMNS``, the same on every rank; ``directory`` is this run's alone; the state on
    ``device`` (:data:`~jobs.bench.options.DEVICES`; a GPU is the rank's current one)."""
    device = resolve_device(device)
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    state = {name: t.to(where) for name, t in training_state(nbytes).items()}
    total = sum(t.numel() * t.element_size() for t in state.values())
    bench = _Bench(directory, state, group)
    samples: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    for step in range(iters + 1):  # step 0 warms up (and allocates the async host buffers)
        for impl in bench.impls:
            save, stall, load = bench.run(impl, step)
            if step:
                samples.setdefault((impl, "save"), []).append((save, stall))
                if load is not None:
                    samples.setdefault((impl, "load"), []).append((load, None))
    return _rows(samples, total, dist.get_world_size(group), device)


def _rows(
    samples: dict[tuple[str, str], list[tuple[float, float | None]]], nbytes: int, ranks: int, device: str = "cpu"
) -> list[dict]:
    rows = []
    for (impl, op), runs in samples.items():
        seconds = statistics.median(t for t, _ in runs)
        stalls = [s for _, s in runs if s is not None]
        rows.append({"impl": impl, "op": op, "device": device, "bytes": nbytes, "ranks": ranks, "time_s": seconds,
                     "MBps": nbytes / seconds / 1e6, "stall_s": statistics.median(stalls) if stalls else None})
    disk = {row["op"]: row["MBps"] for row in rows if row["impl"] == "disk"}
    floor = next(row["stall_s"] for row in rows if row["impl"] == "memcpy")
    for row in rows:
        row["stall_of_memcpy"] = None if row["stall_s"] is None else row["stall_s"] / floor
        row["of_disk"] = row["MBps"] / disk[row["op"]]
    return [{key: row[key] for key in COLUMNS}
            for row in sorted(rows, key=lambda r: (r["op"] != "save", CUDA_IMPLS.index(r["impl"])))]


def format_table(rows: list[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    stall, of_memcpy = ("-", "-") if r["stall_s"] is None else (f"{r['stall_s']:.3f}", f"{r['stall_of_memcpy']:.2f}x")
    return (r["impl"], r["op"], r["device"], r["bytes"], r["ranks"], f"{r['time_s']:.3f}", f"{r['MBps']:.0f}", stall,
            of_memcpy, f"{r['of_disk']:.2f}x")

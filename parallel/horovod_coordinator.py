"""Horovod's coordinator for ``parallel.horovod``, without a background thread.

Why: Horovod negotiates every operation across ranks before it runs, so that ranks that disagree
get an error instead of a hang, and it matches operations by name. Here each call through the API
all-gathers a small signature right before its collective: one int64 row per rank (operation,
dtype, shape, root, op, and how many named operations wait on that rank). An ``*_async`` call
given ``name=`` is not issued at once: it waits in its process set's table until every rank of
the set has issued that name, which the next negotiation on the set finds out (a second
all-gather, of the waiting names, only in rounds where some rank has one waiting); then every rank
launches the ready ones in the same (sorted) order. A name issued while an operation of that name
is still outstanding on this rank raises ValueError, as in Horovod. Unnamed operations are matched
in program order, so the common path pays one tiny all-gather and nothing more.

The timeline (``start_timeline``) records each negotiation and each operation, on rank 0, as a
Chrome trace in Horovod's format (one row per operation name).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
TORCH_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
_GLOO_WIDER = {torch.int16: torch.int32}  # what Gloo cannot reduce, sent as the next wider type

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "join", "barrier", "synchronize")
DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool, torch.complex64, torch.complex128)
OPS = (Average, Sum, Min, Max, Product)
DEVICES = ("cpu", "cuda")
FIELDS = ("operation", "data type", "number of dimensions", "root rank", "reduction op", "device")
DEVICE = FIELDS.index("device")
SHAPE = len(FIELDS)  # the column where the shape starts
MAX_DIMS = 8
WAITING = SHAPE + MAX_DIMS  # the column: how many named operations wait on this rank
JOIN = KINDS.index("join")
_PRUNE_AT = 256  # finished named operations kept for the duplicate check before they are dropped


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed on some rank (elastic training catches it)."""


@dataclass(frozen=True, eq=False)
class ProcessSet:
    """A subset of ranks: ``ranks`` None means all of them (``global_process_set``).

    ``waiting`` holds its named operations not yet issued on every rank, ``running`` the launched
    ones (for Horovod's duplicate-name check)."""

    ranks: tuple[int, ...] | None = None
    group: Any = field(default=None, repr=False)
    waiting: dict = field(default_factory=dict, repr=False)
    running: dict = field(default_factory=dict, repr=False)

    def size(self) -> int:
        """The set's size, on every rank (also outside the set)."""
        return dist.get_world_size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This rank's place in the set; -1 outside it."""
        if self.ranks is None:
            return dist.get_rank()
        return self.ranks.index(dist.get_rank()) if dist.get_rank() in self.ranks else -1

    def included(self) -> bool:
        return self.ranks is None or dist.get_rank() in self.ranks


global_process_set = ProcessSet()


@dataclass
class _Pending:
    """A named operation waiting for the other ranks: its signature and what launches it."""

    key: str
    signature: torch.Tensor
    launch: Any
    process_set: ProcessSet
    since: float = field(default_factory=time.monotonic)
    warned: bool = False


@dataclass
class Handle:
    """What ``*_async`` returns: ``synchronize(handle)`` gives the result, ``poll`` says if it is done."""

    output: Any
    work: Any = None
    finish: Any = None
    pending: _Pending | None = None
    error: Exception | None = None
    label: str = ""  # for the timeline
    started: float = 0.0

    def done(self) -> bool:
        return self.pending is None and (self.work is None or self.work.is_completed())

    def take(self, launched: Handle) -> None:
        """Become the launched operation (the caller keeps this object)."""
        self.output, self.work, self.finish, self.pending = launched.output, launched.work, launched.finish, None

    def __call__(self):
        """Horovod's ``sparse_allreduce_async`` hands back a callable: calling it synchronizes."""
        return synchronize(self)


def poll(handle: Handle) -> bool:
    """False while the operation runs, or waits for a rank that has not issued its name yet."""
    return handle.done()


def synchronize(handle: Handle):
    if handle.pending is not None:
        _flush(handle)
    if handle.error is not None:
        raise handle.error
    if handle.work is not None:
        handle.work.wait()
        handle.work = None
    if handle.finish is not None:
        handle.output = handle.finish(handle.output)
        handle.finish = None
    if handle.started:
        TIMELINE.record(handle.label, handle.label.split(".")[0].upper(), handle.started)
        handle.started = 0.0
    return handle.output


def _flush(handle: Handle) -> None:
    """``synchronize`` on a named operation still waiting: one negotiation round (every rank that has
    issued it synchronizes too); if a rank has not issued it, Horovod would wait forever: an error."""
    pending = handle.pending
    negotiate("synchronize", torch.empty(0), pending.process_set)
    if handle.pending is not None:
        pending.process_set.waiting.pop(pending.key, None)
        handle.pending = None
        handle.error = HorovodInternalError(
            f"{pending.key}: synchronize() while some rank of the set has not issued an operation of that name")


def wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor Gloo sends: types it lacks (int16) travel as a wider one."""
    wider = _GLOO_WIDER.get(tensor.dtype)
    return tensor if wider is None else tensor.to(wider)


# ---- signatures and their negotiation --------------------------------------------------------------------


def signature(kind: str, tensor: torch.Tensor, root: int = -1, op: str = "") -> torch.Tensor:
    """This rank's row: operation, dtype, dimensions, root, op, device type, shape (padded), waiting count (0).
    The device type tells a joined rank where the others' tensors are (its zeros go there, through the same
    backend), and a CPU/GPU mix between ranks is a disagreement, not a hang of two backends."""
    shape = list(tensor.shape) or [1]
    dtype = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else len(DTYPES)
    device = DEVICES.index(tensor.device.type) if tensor.device.type in DEVICES else len(DEVICES)
    header = [KINDS.index(kind), dtype, tensor.dim(), root, OPS.index(op) if op in OPS else -1, device]
    return torch.tensor(header + (shape + [-1] * MAX_DIMS)[:MAX_DIMS] + [0], dtype=torch.int64)


def _require_member(kind: str, process_set: ProcessSet) -> None:
    if not process_set.included():  # torch would return at once and leave the output unwritten
        raise ValueError(f"{kind} on process set {process_set.ranks}, which rank {dist.get_rank()} is not in")


def exchange(kind: str, tensor: torch.Tensor, process_set: ProcessSet, root: int = -1, op: str = ""):
    """Every rank's signature of the operation it issues (one small all-gather); named operations
    that every rank has issued by now are launched on the way."""
    _require_member(kind, process_set)
    mine = signature(kind, tensor, root, op)
    mine[WAITING] = len(process_set.waiting)
    started = TIMELINE.now()
    every = [torch.empty_like(mine) for _ in range(process_set.size())]
    dist.all_gather(every, mine, group=process_set.group)
    rows = torch.stack(every)
    if bool(rows[:, WAITING].any()):
        _launch_ready(rows, process_set)
    TIMELINE.cycle(started)
    return rows


def disagreement(rows: torch.Tensor) -> str | None:
    """What the ranks' signatures disagree on, if anything (allgather and alltoall may differ in dim 0)."""
    kind = KINDS[int(rows[0, 0])]
    for col in range(WAITING):
        if (col != SHAPE or kind in ("allreduce", "broadcast")) and bool((rows[:, col] != rows[0, col]).any()):
            what = FIELDS[col] if col < SHAPE else f"dimension {col - SHAPE} of the shape"
            return f"{kind}: the ranks disagree on the {what}: {[_describe(col, int(v)) for v in rows[:, col]]}"
    return None


def _describe(col: int, value: int):
    if col == 0:
        return KINDS[value]
    if col == 1:
        return str(DTYPES[value]) if value < len(DTYPES) else "other"
    if col == DEVICE:
        return DEVICES[value] if value < len(DEVICES) else "other"
    if col == FIELDS.index("reduction op"):
        return OPS[value] if 0 <= value < len(OPS) else "none"
    return value


def negotiate(kind: str, tensor: torch.Tensor, process_set: ProcessSet, root: int = -1, op: str = "",
              label: str = "") -> list[int]:
    """Check that the ranks of the set issue the same operation (like Horovod's coordinator): a mismatch
    raises HorovodInternalError on every rank instead of a hang or garbage. Ranks that have joined
    (``join``) take part in allreduce with zeros; other operations fail while a rank has joined.
    Returns every rank's first dimension (allgather and alltoall may differ there)."""
    started = TIMELINE.now()
    rows = exchange(kind, tensor, process_set, root, op)
    joined = rows[:, 0] == JOIN
    if bool(joined.any()):
        if kind not in ("allreduce", "synchronize"):
            raise HorovodInternalError(f"{kind} while rank(s) {joined.nonzero().flatten().tolist()} have joined: "
                                       "only allreduce goes on after hvd.join(), as in Horovod")
        rows = rows[~joined]
    problem = disagreement(rows)
    if problem:
        raise HorovodInternalError(problem)
    TIMELINE.record(label or kind, f"NEGOTIATE_{kind.upper()}", started)
    return rows[:, SHAPE].tolist()


def local_device(device_type: str) -> torch.device | None:
    """Where this rank keeps a tensor that others keep on ``device_type``: its current GPU for "cuda", else the
    default (None)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None


def zeros_into_allreduce(row: torch.Tensor) -> None:
    """A joined rank's part in an allreduce the others issue: zeros of their dtype and shape, on their device type
    (this rank's GPU when theirs are on GPUs)."""
    dims = int(row[2])
    if dims > MAX_DIMS:
        raise HorovodInternalError(f"allreduce of {dims} dimensions while a rank has joined (at most {MAX_DIMS})")
    shape = [int(d) for d in row[SHAPE : SHAPE + dims]]
    zeros = wire(torch.zeros(shape, dtype=DTYPES[int(row[1])], device=local_device(DEVICES[int(row[DEVICE])])))
    dist.all_reduce(zeros, op=TORCH_OPS[OPS[int(row[4])]])


# ---- operations matched by name --------------------------------------------------------------------------


def submit(kind: str, tensor: torch.Tensor, process_set: ProcessSet, launch, name: str | None = None,
           root: int = -1, op: str = "", label: str = "") -> Handle:
    """Negotiate and launch now (``launch(first_dims) -> Handle``), or, for an operation with a name,
    enter it in the set's table, to be launched when every rank of the set has issued that name."""
    label = label or kind
    if name is None:
        started = TIMELINE.now()
        handle = launch(negotiate(kind, tensor, process_set, root, op, label))
        handle.label, handle.started = label, started
        return handle
    key = f"{label}.{name}"
    _require_member(kind, process_set)
    running = process_set.running.get(key)
    if key in process_set.waiting or (running is not None and not running.done()):
        raise ValueError(f"Requested to {label} a tensor with the same name as another tensor that is currently "
                         f"being processed ({key!r}). If you want to request another tensor, use a different "
                         "tensor name.")
    handle = Handle(None, pending=_Pending(key, signature(kind, tensor, root, op), launch, process_set),
                    label=key, started=TIMELINE.now())
    process_set.waiting[key] = handle
    return handle


def _launch_ready(rows: torch.Tensor, process_set: ProcessSet) -> None:
    """Launch, in sorted order on every rank, the named operations that every rank not joined has issued."""
    mine = {key: handle.pending.signature.tolist() for key, handle in process_set.waiting.items()}
    tables: list[Any] = [None] * process_set.size()
    dist.all_gather_object(tables, mine, group=process_set.group)
    joined = (rows[:, 0] == JOIN).tolist()
    active = [table for table, j in zip(tables, joined, strict=True) if not j]
    if not active:
        return
    for key in sorted(set(active[0]).intersection(*active[1:])):
        signatures = torch.tensor([table[key] for table in active], dtype=torch.int64)
        _launch_named(key, signatures, any(joined), joined[process_set.rank()], process_set)
    _warn_stalled(process_set, tables)


def _warn_stalled(process_set: ProcessSet, tables: list) -> None:
    """Horovod's stall check: a warning (once per operation) when a named operation has waited longer than
    ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (default 60) for ranks that have not issued it."""
    limit = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", 60))
    for key, handle in process_set.waiting.items():
        pending = handle.pending
        if not pending.warned and time.monotonic() - pending.since >= limit:
            pending.warned = True
            missing = [r for r, table in enumerate(tables) if key not in table]
            warnings.warn(f"{key} has waited {time.monotonic() - pending.since:.0f} s for rank(s) {missing} of the "
                          "process set, which have not issued an operation of that name", stacklevel=2)


def _launch_named(key: str, signatures: torch.Tensor, someone_joined: bool, i_joined: bool,
                  process_set: ProcessSet) -> None:
    problem = disagreement(signatures)
    if problem is None and someone_joined and int(signatures[0, 0]) != KINDS.index("allreduce"):
        problem = f"{key} while a rank has joined: only allreduce goes on after hvd.join(), as in Horovod"
    if i_joined:
        if problem is None:
            zeros_into_allreduce(signatures[0])
        return
    handle = process_set.waiting.pop(key)
    TIMELINE.record(key, f"NEGOTIATE_{KINDS[int(signatures[0, 0])].upper()}", handle.started)
    if problem is not None:
        handle.pending, handle.error = None, HorovodInternalError(problem)
        return
    try:  # an error here (a root outside the set) is the same on every rank: it goes to the handle
        handle.take(handle.pending.launch(signatures[:, SHAPE].tolist()))
    except (ValueError, RuntimeError) as exc:
        handle.pending, handle.error = None, exc
        return
    handle.started = TIMELINE.now()
    if len(process_set.running) >= _PRUNE_AT:
        for done in [k for k, h in process_set.running.items() if h.done()]:
            del process_set.running[done]
    process_set.running[key] = handle


# ---- the timeline --------------------------------------------------------------------------------------


class Timeline:
    """Horovod's timeline: a Chrome trace (``chrome://tracing``, Perfetto), one row per operation name,
    written by rank 0 as the events happen; ``mark_cycles`` adds an instant per negotiation round."""

    def __init__(self):
        self.file, self.rows, self.t0, self.mark_cycles = None, {}, 0.0, False

    def now(self) -> float:
        return time.perf_counter() if self.file is not None else 0.0

    def start(self, path, mark_cycles: bool) -> None:
        self.stop()
        if dist.get_rank() != 0:
            return
        self.file, self.rows, self.t0, self.mark_cycles = open(path, "w"), {}, time.perf_counter(), mark_cycles
        self.file.write("[\n")
        self._write({"name": "start_time_since_epoch_in_micros", "ph": "M", "pid": 0,
                     "args": {"start_time_since_epoch_in_micros": int(time.time() * 1e6)}})

    def stop(self) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"name": "stop_timeline", "ph": "i", "ts": self._us(time.perf_counter()),
                                        "pid": 0, "s": "g"}) + "\n]\n")
            self.file.close()
            self.file = None

    def record(self, label: str, activity: str, started: float) -> None:
        """One complete event ``activity`` on the row of ``label`` (from ``started`` to now)."""
        if self.file is None or not started:
            return
        if label not in self.rows:
            self.rows[label] = len(self.rows) + 1
            self._write({"name": "process_name", "ph": "M", "pid": self.rows[label], "args": {"name": label}})
        end = time.perf_counter()
        self._write({"name": activity, "ph": "X", "pid": self.rows[label], "tid": 0, "ts": self._us(started),
                     "dur": self._us(end) - self._us(started)})

    def cycle(self, started: float) -> None:
        if self.file is not None and self.mark_cycles and started:
            self._write({"name": "CYCLE_START", "ph": "i", "ts": self._us(started), "pid": 0, "s": "g"})

    def _us(self, t: float) -> int:
        return int((t - self.t0) * 1e6)

    def _write(self, event: dict) -> None:
        self.file.write(json.dumps(event) + ",\n")


TIMELINE = Timeline()  # Horovod's timeline is per process, like its API

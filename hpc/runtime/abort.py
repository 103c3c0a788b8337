"""An unhandled exception on one rank ends the whole job, never leaves the others waiting in a collective.

Under MPI we call ``MPI_Abort`` (mpirun then kills every rank); otherwise we exit at once
without tearing down the process group (which can itself block on dead peers) and the
launcher (ours, srun's --kill-on-bad-exit) stops the rest.

Before that, a rank whose entry point knows its run directory records why it failed there
(``failures/rank-XXXXX.json`` and the traceback beside it, hpc/rundir.py), and whether the
error was only the symptom of a peer vanishing (Gloo's "Connection closed by peer", NCCL's
aborted communicator, a timeout): ``hpc status``, ``hpc logs`` and ``hpc run`` then name the
first rank that failed for a reason of its own instead of the N-1 that lost it.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hpc.errors import HpcError

# What a rank sees when another one died: the symptom, not the cause.
PEER_LOST = re.compile(
    r"connection closed by peer|connection reset|broken pipe|connection refused|communicator was aborted"
    r"|remote process exited|timed out|timeout|failed to recv|recvvalue|no route to host", re.IGNORECASE)
PEER_LOST_TYPES = ("DistNetworkError", "DistStoreError", "ConnectionError", "ConnectionResetError",
                   "ConnectionAbortedError", "BrokenPipeError", "TimeoutError")
MESSAGE_CHARS = 500


@dataclass
class FailureSite:
    """Where a failing rank records why: its run directory, once the entry point has read the spec."""

    run_path: Path | None = None


def _rank_label() -> str:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def abort_job(exc: BaseException, run_path: Path | None = None) -> NoReturn:
    """Report the failure on this rank (and record it in ``run_path``) and take every other rank down with it."""
    label = _rank_label()
    if run_path is not None:
        record_failure(run_path, exc)  # first: the launcher is stopping the other ranks, and soon this one
    # sys.exit(3) on one rank: the job still ends (the others would wait for it), with the code the user gave
    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) and 0 < exc.code < 256 else 1
    if isinstance(exc, SystemExit):
        print(f"hpc-rank: rank {label}: exited with code {exc.code} (sys.exit): stopping the job", file=sys.stderr,
              flush=True)
    else:
        if not isinstance(exc, HpcError):
            traceback.print_exception(exc, file=sys.stderr)
        print(f"hpc-rank: rank {label}: error: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)


def run_as_rank(body: Callable[[], int | None], site: FailureSite | None = None) -> int:
    """Run a rank's work and return its exit status; any failure (a clean exit aside) aborts the whole job,
    recorded in ``site``'s run directory when it is known by then."""
    try:
        return body() or 0
    except BaseException as exc:  # any failure must take the whole job down
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        abort_job(exc, site.run_path if site is not None else None)


def record_failure(run_path: Path, exc: BaseException, step: int | None = None,
                   traceback_text: str | None = None, blamed_hosts: list[str] | None = None) -> None:
    """This rank's failure record in the run directory; never raises (the job must still be taken down).
    ``step`` and ``traceback_text``: for an exception never raised through the loop (the stall inspector's
    report, with the blocked thread's stack); ``blamed_hosts``: where the peers it waited for were (what a
    restart excludes, slurm/restart.py)."""
    from hpc.rundir import write_failure

    try:
        rank, world_size, job_id = _where()
        record = {"job_id": job_id, "world_size": world_size, "host": this_host(), "step": step or failed_step(exc),
                  "type": type(exc).__name__, "message": first_line(exc), "peer_lost": is_peer_lost(exc),
                  "time": time.time(), "pid": os.getpid(), "restart": os.environ.get("SLURM_RESTART_COUNT"),
                  **({"blamed_hosts": blamed_hosts} if blamed_hosts else {})}
        write_failure(run_path, rank, record, traceback_text or "".join(traceback.format_exception(exc)))
    except Exception as error:  # a record is a courtesy, the abort is the duty
        print(f"hpc-rank: could not record the failure in {run_path}: {error}", file=sys.stderr, flush=True)


def _where() -> tuple[int, int | None, str | None]:
    """(rank, world size, job id) as the launcher's variables say."""
    from hpc.runtime.env import detect_rank_info

    try:
        info = detect_rank_info(os.environ)
    except HpcError:
        label = _rank_label()
        return (int(label) if label.isdigit() else 0), None, os.environ.get("HPC_JOB_ID")
    return info.rank, info.world_size, info.job_id


def this_host() -> str:
    """This node's name as Slurm calls it (SLURMD_NODENAME), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def first_line(exc: BaseException) -> str:
    """The exception's message, its first non-empty line, cut to MESSAGE_CHARS."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def is_peer_lost(exc: BaseException) -> bool:
    """Whether the error is what a rank sees when a peer vanished (its cause is elsewhere); our own typed errors
    (hpc/errors.py) say their cause themselves."""
    if isinstance(exc, HpcError):
        return False
    names = {kind.__name__ for kind in type(exc).__mro__}
    return bool(names & set(PEER_LOST_TYPES)) or bool(PEER_LOST.search(str(exc)))


def failed_step(exc: BaseException) -> int | None:
    """The training step the failure interrupted: the step the training loop last gave its probe
    (hpc/observe/probe.py ``set_step``), read from the frames the exception passed through; None before the first."""
    probe = sys.modules.get("hpc.observe.probe")
    if probe is None:
        return None
    step, tb = None, exc.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, probe.Probe):
                step = value.step
        tb = tb.tb_next
    return step or None

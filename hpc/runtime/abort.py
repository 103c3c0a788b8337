"""An unhandled exception on one rank ends the whole job, never leaves the others waiting in a collective.

Under MPI we call ``MPI_Abort`` (mpirun then kills every rank); otherwise we exit at once
without tearing down the process group (which can itself block on dead peers) and the
launcher (ours, srun's --kill-on-bad-exit) stops the rest.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from hpc.errors import HpcError


def _rank_label() -> str:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def abort_job(exc: BaseException) -> NoReturn:
    """Report the failure on this rank and take every other rank down with it."""
    label = _rank_label()
    if not isinstance(exc, HpcError):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"hpc-rank: rank {label}: error: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(1)
    os._exit(1)


def run_as_rank(body: Callable[[], int | None]) -> int:
    """Run a rank's work and return its exit status; any failure (a clean exit aside) aborts the whole job."""
    try:
        return body() or 0
    except BaseException as exc:  # any failure must take the whole job down
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        abort_job(exc)

"""``hpc-rank``: what every launcher starts on every rank.

An unhandled exception on one rank must end the whole job, never leave the others
waiting in a collective: under MPI we call ``MPI_Abort`` (mpirun then kills every
rank); otherwise we exit at once without tearing down the process group (which can
itself block on dead peers) and the launcher (ours, srun's --kill-on-bad-exit)
stops the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from hpc.errors import HpcError


def _rank_label() -> str:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def abort_job(exc: BaseException) -> None:
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


def run_as_rank(body: Callable[[], None]) -> int:
    """Run a rank's work; any failure (a clean exit aside) aborts the whole job."""
    try:
        body()
    except BaseException as exc:  # any failure must take the whole job down
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        abort_job(exc)
    return 0


def summary_line(result, world, shape, metrics_path) -> str:
    return (
        f"summary: {result.steps} steps in {result.wall_s:.1f} s | final loss {result.final_loss:.4f} | "
        f"test accuracy {result.test_accuracy:.1%} | {result.samples_per_s:,.0f} samples/s | "
        f"{world.size} ranks ({shape}) {world.backend} via {world.info.launcher.value} | metrics {metrics_path}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rank", description="Run one rank of a job spec.")
    parser.add_argument("spec", help="job spec (TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    def train_job() -> None:
        import torch

        from hpc import bootstrap
        from hpc.config import load_spec
        from hpc.env import detect_rank_info
        from hpc.launch import threads_per_rank
        from hpc.mesh import build_mesh, resolve_layout
        from hpc.progress import progress_mode
        from jobs.train import train

        spec = load_spec(args.spec, args.overrides)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads_per_rank(detect_rank_info(os.environ).local_size))
        world = bootstrap.init(spec.parallel.backend, spec.parallel.init_timeout_s, spec.parallel.timeout_s)
        shape = resolve_layout(spec.parallel.dp, spec.parallel.tp, spec.parallel.pp, world.size)
        mesh = build_mesh(shape, world.rank)
        result, _ = train(spec, world, mesh, progress_mode())
        if world.rank == 0:
            print(summary_line(result, world, shape, spec.run_path / "metrics.jsonl"), flush=True)
        bootstrap.shutdown()

    return run_as_rank(train_job)


if __name__ == "__main__":
    sys.exit(main())

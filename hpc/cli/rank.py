"""``hpc-rank``: what every launcher starts on every rank (a failure aborts the job: hpc/runtime/abort.py)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc.rundir import METRICS_FILE, RESULT_FILE, enable_flight_recorder
from hpc.runtime.abort import FailureSite, run_as_rank

# The evaluation measures the summary shows (all of them go to result.json): a generalization figure per model.
SUMMARY_MEASURES = {"held_out_loss": "held-out loss {:.4f}", "held_out_accuracy": "held-out accuracy {:.1%}"}


def summary_line(result, world, shape, metrics_path) -> str:
    measures = "".join(f"{form.format(result.evaluation[name])} | " for name, form in SUMMARY_MEASURES.items()
                       if name in result.evaluation)
    return (
        f"summary: {_ran_and_loss(result)} | "
        f"{measures}{result.throughput:,.0f} {result.unit}/s | {_device_measures(result)}"
        f"{world.size} ranks ({shape}) {world.backend} via {world.info.launcher.value} | metrics {metrics_path}"
    )


def _device_measures(result) -> str:
    """MFU and peak memory where the device's peak is known (a GPU), else nothing."""
    if result.mfu is None:
        return ""
    from hpc.text import human_bytes

    return f"MFU {result.mfu:.1%} | peak memory {human_bytes(result.peak_memory_bytes)} | "


def _ran_and_loss(result) -> str:
    """The steps this run took and its final loss; a resume with no steps left reports its checkpoint's loss."""
    if result.start_step < result.steps:
        ran = (f"{result.steps} steps" if not result.start_step
               else f"steps {result.start_step + 1}-{result.steps} (resumed)")
        return f"{ran} in {result.wall_s:.1f} s | final loss {result.final_loss:.4f}"
    ran = f"no steps left (resumed at step {result.start_step} of {result.steps}) in {result.wall_s:.1f} s"
    if result.final_loss is None:
        return f"{ran} | final loss unknown (the checkpoint predates recording it)"
    return f"{ran} | final loss {result.final_loss:.4f} (the checkpoint's)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rank", description="Run one rank of a job spec.")
    parser.add_argument("spec", help="job spec (TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    site = FailureSite()  # a failure records itself in the run directory once train_rank knows it

    def train_job() -> int:
        from hpc.runtime import preemption

        watcher = preemption.watch(os.environ)  # first: a warning signal during start-up must not kill the rank
        with watcher or contextlib.nullcontext():
            return train_rank(args.spec, args.overrides, watcher, site)

    return run_as_rank(train_job, site)


def train_rank(spec_path: str, overrides: Sequence[str], watcher, site: FailureSite | None = None) -> int:
    """One rank of the job; PREEMPTED_EXIT when a signal stopped it at a checkpoint (hpc/runtime/preemption.py)."""
    import torch
    import torch.distributed as dist

    from hpc.config import load_spec
    from hpc.observe.progress import progress_mode
    from hpc.runtime import bootstrap, preemption
    from hpc.runtime.launch import rank_threads
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    spec = load_spec(spec_path, overrides)
    make_run_dir(spec.run_path)
    enable_flight_recorder(spec.run_path, os.environ)
    if site is not None:
        site.run_path = spec.run_path
    if "OMP_NUM_THREADS" not in os.environ:  # else torch follows it: the user's, or what our launchers set
        torch.set_num_threads(rank_threads(os.environ))
    par = spec.parallel
    world = bootstrap.init(par.backend, par.init_timeout_s, par.timeout_s, device=par.device)
    shape = resolve_layout(par.dp, par.tp, par.pp, world.size)
    mesh = build_mesh(shape, world.rank, world.device, par.timeout_s)
    try:
        result, _ = train(spec, world, mesh, progress_mode(), watcher)
    except preemption.Preempted as stop:
        preemption.conclude(stop, world.rank, dist.group.WORLD, os.environ, spec.slurm.max_requeues)
        bootstrap.shutdown()
        return preemption.PREEMPTED_EXIT
    if world.rank == 0:
        write_result(spec.run_path / RESULT_FILE, result, world)
        print(summary_line(result, world, shape, spec.run_path / METRICS_FILE), flush=True)
    bootstrap.shutdown()
    return 0


def make_run_dir(path: Path) -> None:
    """job.run_dir on this host, or one line that says which directory and where (a node's private /tmp?)."""
    import socket

    from hpc.errors import HpcError

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HpcError(f"cannot create the run directory {path} on {socket.gethostname()}: {exc.strerror}; "
                       "job.run_dir must be writable, and shared by every node") from None


def write_result(path: Path, result, world) -> None:
    """The run's TrainResult as flat JSON (evaluation measures at the top level), replaced atomically."""
    from hpc.rundir import write_json

    record: dict[str, object] = {}
    for key, value in dataclasses.asdict(result).items():
        record.update(value if isinstance(value, Mapping) else {key: value})
    write_json(path, {**record, "world_size": world.size, "job_id": world.info.job_id})


if __name__ == "__main__":
    sys.exit(main())


def run_in_slurm_task(argv: list[str]) -> None:
    """What every srun task of ``hpc submit`` runs (submitit pickles a reference to it): ``hpc-rank ARGV``."""
    status = main(argv)
    if status:
        raise SystemExit(status)  # past submitit's error handling: the task ends with this status

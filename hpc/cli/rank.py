"""``hpc-rank``: what every launcher starts on every rank (a failure aborts the job: hpc/runtime/abort.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hpc.rundir import METRICS_FILE
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
    where = (f" of {result.steps}" if result.start_step == result.steps
             else f", past train.steps = {result.steps}")  # train.steps lowered below the checkpoint
    ran = f"no steps left (resumed at step {result.start_step}{where}) in {result.wall_s:.1f} s"
    if result.final_loss is None:
        return f"{ran} | final loss unknown (the checkpoint predates recording it)"
    return f"{ran} | final loss {result.final_loss:.4f} (the checkpoint's)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rank", description="Run one rank of a job spec.")
    parser.add_argument("spec", help="job spec (TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    site = FailureSite()  # a failure records itself in the run directory once train_rank knows it
    return run_as_rank(lambda: train_rank(args.spec, args.overrides, site), site)


def train_rank(spec_path: str, overrides: Sequence[str], site: FailureSite | None = None) -> int:
    """One rank of the job in its run session (hpc/run_session.py); PREEMPTED_EXIT when a signal stopped it at a
    checkpoint (hpc/runtime/preemption.py)."""
    from hpc import run_session
    from hpc.config import load_spec
    from hpc.observe.progress import progress_mode
    from hpc.runtime import preemption
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    spec = load_spec(spec_path, overrides)
    if site is not None:
        site.run_path = spec.run_path
    par = spec.parallel
    run = run_session.start(spec.run_path, backend=par.backend, init_timeout_s=par.init_timeout_s,
                            timeout_s=par.timeout_s, device=par.device, **run_session.spec_options(spec))
    shape = resolve_layout(par.dp, par.tp, par.pp, run.size)
    mesh = build_mesh(shape, run.rank, run.device, par.timeout_s, run.world.info.node_rank)
    try:
        result, _ = train(spec, run.world, mesh, progress_mode(), run)
    except preemption.Preempted as stop:
        run.stop(stop)
        run.close()
        return preemption.PREEMPTED_EXIT
    run.finish(result.as_record())
    if run.rank == 0:
        print(summary_line(result, run.world, shape, spec.run_path / METRICS_FILE), flush=True)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def run_in_slurm_task(argv: list[str]) -> None:
    """What every srun task of ``hpc submit`` runs (submitit pickles a reference to it): ``hpc-rank ARGV``."""
    status = main(argv)
    if status:
        raise SystemExit(status)  # past submitit's error handling: the task ends with this status

"""``hpc submit``, ``status``, ``logs``, ``cancel`` and ``sweep``: job specs on Slurm, sweeps also on local ranks.

Your own training script goes the same way (``hpc submit train.py -- ARGS``, a sweep whose base is
a script): hpc/cli/script.py gives its resources and what its srun tasks run.

Nothing heavy at module level (``hpc --help`` stays instant): slurm.* and submitit are
imported by the handlers. Every check that can fail (the spec, the resources, the layout,
each config of a sweep) runs before anything is submitted.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from hpc.cli import script
from hpc.cli.rank import run_in_slurm_task
from hpc.errors import ConfigError
from hpc.text import format_table

# (option, type, help): each overrides the spec's slurm.<option>.
RESOURCES = (
    ("nodes", int, "nodes"),
    ("ntasks_per_node", int, "ranks per node"),
    ("gpus_per_node", int, "GPUs per node"),
    ("gpus_per_task", int, "GPUs per rank, each rank bound to its own"),
    ("cpus_per_task", int, "CPUs per rank"),
    ("mem", str, "memory per node, e.g. 64G"),
    ("partition", str, "partition"),
    ("time", str, "time limit, e.g. 02:00:00 or 1-00:00:00"),
    ("account", str, "account to charge"),
    ("qos", str, "quality of service"),
    ("constraint", str, "node features, e.g. a100"),
    ("max_restarts", int, "times a failed job step runs again inside the allocation"),
    ("spare_nodes", int, "nodes allocated beyond --nodes, to replace a failed one"),
)
JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")
SWEEP_VIEWS = ("status", "results")


def add_parser(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser(
        "submit", help="submit a job spec, or your own script, to Slurm (sbatch via submitit, one task per rank)",
        usage="hpc submit SPEC.toml [options]\n       hpc submit SCRIPT.py [--resources FILE] [options] [-- ARGS]")
    submit.add_argument("spec", help="job spec (TOML), whose [slurm] section gives the resources; or a Python "
                                     "script followed by -- and its own arguments")
    submit.add_argument("--resources", metavar="FILE",
                        help="a script's resources: a TOML of only [slurm] and [job] (name, run_dir)")
    for name, kind, what in RESOURCES:
        submit.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{what} (default: slurm.{name})")
    submit.add_argument("--elastic", action="store_true", default=None,
                        help="with no spare node left, restart on the nodes that remain (default: slurm.elastic)")
    submit.add_argument("--setup", action="append", metavar="LINE",
                        help="a command run before the ranks start, e.g. 'module load cuda/12' (repeatable; "
                             "replaces slurm.setup; arguments are literal: no $VAR, ';' or pipes)")
    _add_run_options(submit, "print the sbatch script and submit nothing")
    submit.set_defaults(handler=cmd_submit)

    status = commands.add_parser("status", help="state, elapsed time, nodes, last step and loss of submitted jobs")
    status.add_argument("job", nargs="?", help="a job id, or A_T for one array task (default: recent jobs)")
    status.set_defaults(handler=cmd_status)

    logs = commands.add_parser("logs", help="print a rank's log of a submitted job")
    logs.add_argument("job", help="job id, or A_T for one array task")
    logs.add_argument("--rank", type=int, help="which rank's log (default 0, after a line naming the rank that "
                                                "failed first and why, when one did)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    logs.set_defaults(handler=cmd_logs)

    cancel = commands.add_parser("cancel", help="cancel a Slurm job (scancel)")
    cancel.add_argument("job", help="job id, or A_T for one array task")
    cancel.set_defaults(handler=cmd_cancel)

    sweep = commands.add_parser(
        "sweep", help="run a sweep as one Slurm job array or on local ranks; show its status or results",
        usage="hpc sweep SWEEP.toml [--executor slurm|local] [--set KEY=VALUE] [--dry-run] [-- SCRIPT ARGS]\n"
              "       hpc sweep status DIR\n       hpc sweep results DIR [--plot [PATH]]")
    sweep.add_argument("target", metavar="SWEEP.toml|status|results", help="a sweep file to run, or a view")
    sweep.add_argument("dir", nargs="?", help="with status or results: the sweep directory")
    sweep.add_argument("--executor", choices=("slurm", "local"),
                       help="slurm: one job array (default); local: one config after the other on local ranks")
    sweep.add_argument("--plot", nargs="?", const="", metavar="PATH",
                       help="with results: also plot the metric against each swept key (default DIR/results.png)")
    _add_run_options(sweep, "print the sbatch script (or the local command lines) and run nothing")
    sweep.set_defaults(handler=cmd_sweep)


def _add_run_options(parser: argparse.ArgumentParser, dry_run_help: str) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec value, e.g. --set train.lr=3e-4 (repeatable; hpc spec lists every key)")
    parser.add_argument("--dry-run", action="store_true", help=dry_run_help)


def _with_resources(spec, args: argparse.Namespace):
    """The spec with the resource options applied, checked like the spec itself."""
    from slurm.submit import with_resources

    given = {name: getattr(args, name) for name in [*(name for name, _, _ in RESOURCES), "elastic"]
             if getattr(args, name) is not None}
    return with_resources(spec, given if args.setup is None else {**given, "setup": args.setup}, "hpc submit options")


def _submission(args: argparse.Namespace):
    """(resources, the srun task function, its argument, whether it is a job spec), every check passed but
    Slurm's: a script (hpc/cli/script.py) or a job spec."""
    from hpc.config import load_spec
    from slurm import submit

    if script.is_script(args.spec) or args.script_args:
        path, spec = script.submission(args.spec, args.resources, args.overrides)
        spec = _with_resources(spec, args)
        return spec, script.run_script_in_slurm_task, script.task_argv(spec.run_path, spec.slurm.max_requeues, path,
                                                                        args.script_args), False
    if args.resources is not None:
        raise ConfigError("--resources gives a script's resources; a job spec has its own [slurm] section")
    spec = _with_resources(load_spec(args.spec, args.overrides), args)
    return spec, run_in_slurm_task, submit.rank_argv(args.spec, args.overrides), True


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs.train.layout import check_layout
    from slurm import job_registry, restart, submit

    spec, entry, argv, is_spec = _submission(args)
    ranks = submit.job_ranks(spec.slurm)
    if not args.dry_run:  # what the cluster offers first: --nodes 3 on two nodes is that, not the batch split
        submit.check_resources(spec.slurm)
    if is_spec:
        check_layout(spec, ranks)
    folder = spec.run_path.absolute() / "slurm"
    restart_loop = restart.step_loop(spec.slurm, spec.run_path.absolute(), folder)
    executor = submit.make_executor(folder, spec.slurm, spec.job.name, restart_loop=restart_loop)
    if args.dry_run:
        print(submit.sbatch_script(executor), end="")
        return 0
    job_id = submit.submit(executor, entry, argv)
    if is_spec and not spec.checkpoint.every_steps:
        print("note: checkpoint.every_steps = 0: if Slurm stops this job early, it starts again from step 0",
              file=sys.stderr)
    job_registry.Registry.default().add(job_registry.JobRecord(job_id, spec.job.name, ranks, str(folder),
                                                               (str(spec.run_path.absolute()),)))
    nodes = spec.slurm.nodes
    spares = f" and {spec.slurm.spare_nodes} spare" if spec.slurm.spare_nodes else ""
    print(f"submitted job {job_id}: {spec.job.name}, {ranks} rank{'s' * (ranks > 1)} on {nodes} "
          f"node{'s' * (nodes > 1)}{spares}")
    last = f" ... {submit.log_path(folder, job_id, ranks - 1).name} (one per rank)" if ranks > 1 else ""
    print(f"logs: {submit.log_path(folder, job_id, 0)}{last}")
    print(f"then: hpc status {job_id} | hpc logs {job_id} --follow | hpc cancel {job_id}")
    return 0


def _job_id(text: str) -> str:
    if not JOB_ID.fullmatch(text):
        raise ConfigError(f"{text!r} is not a job id (digits, or A_T for an array task)")
    return text


def cmd_status(args: argparse.Namespace) -> int:
    from slurm import job_registry

    registry = job_registry.Registry.default()
    report = job_registry.status_report(registry, _job_id(args.job) if args.job else None)
    if report is None:
        print(f"no jobs submitted from here yet (records go to {registry.root})")
        return 0
    for line in report[0]:  # first: which rank failed, and why
        print(line)
    print(format_table(job_registry.STATUS_HEADER, report[1]))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from slurm import job_registry, submit

    job_id = _job_id(args.job)
    record = job_registry.Registry.default().get(job_id)
    run_path = record.run_path(job_id)  # an array needs a task, a plain job none
    rank = 0 if args.rank is None else args.rank
    if not 0 <= rank < record.ranks:
        raise ConfigError(f"--rank {rank}: job {job_id} has ranks 0 to {record.ranks - 1}")
    path = submit.log_path(Path(record.log_dir), job_id, rank)
    failure = None if args.rank is not None else job_registry.failure_line(job_id, run_path, log_dir=record.log_dir)
    if failure:  # first, and again after the log (whose end is where a reader looks)
        print(failure, flush=True)
    if args.follow:
        job_registry.follow(path, lambda: job_registry.ended(job_id))
        failure = None if args.rank is not None else job_registry.failure_line(job_id, run_path, log_dir=record.log_dir)
    elif path.exists():
        sys.stdout.write(path.read_text(errors="replace"))
    else:
        raise job_registry.JobLookupError(job_registry.no_log_reason(job_id, path))
    if failure:
        print(failure)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from slurm import job_registry

    job_id = _job_id(args.job)
    job_registry.slurm_command(["scancel", job_id])
    print(f"cancelled job {job_id}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.plot is not None and args.target != "results":
        raise ConfigError("--plot applies to hpc sweep results DIR")
    if args.target in SWEEP_VIEWS:
        if args.dir is None:
            raise ConfigError(f"hpc sweep {args.target} needs the sweep directory")
        if args.executor or args.overrides or args.dry_run or args.script_args:
            raise ConfigError("--executor, --set, --dry-run and a script's options apply to running a sweep, not to "
                              "viewing one")
        from hpc.observe.plots import check_png_path

        directory = Path(args.dir)
        plot = None if args.plot is None else check_png_path(args.plot or directory / "results.png")
        code = show_sweep(directory, ranked=args.target == "results")
        if plot is not None:
            plot_sweep(directory, plot)
        return code
    if args.dir is not None:
        raise ConfigError(f"unexpected argument {args.dir!r}: hpc sweep SWEEP.toml takes no directory")
    return run_sweep(args)


def run_sweep(args: argparse.Namespace) -> int:
    from slurm import sweep as sweeps

    sweep = sweeps.load_sweep(args.target)
    on_slurm = (args.executor or "slurm") == "slurm"
    ask_slurm = on_slurm and not args.dry_run
    if sweep.script:
        run = script.sweep_run(sweep, args.overrides, args.script_args, ask_slurm)
    else:
        from jobs.train.layout import check_layout

        if args.script_args:
            raise ConfigError(f"{sweep.label}: options after -- go to a script, and sweep.base "
                              f"{sweep.settings.base} is a job spec")
        run = sweeps.spec_run(sweep, args.overrides, run_in_slurm_task, check_layout, ask_slurm)
    if not args.dry_run:
        sweeps.check_fresh(run.directory)
    if on_slurm:
        return _submit_sweep(run, args.dry_run)
    return _run_sweep_locally(run, args.dry_run)


def _submit_sweep(run, dry_run: bool) -> int:
    from slurm import submit
    from slurm import sweep as sweeps

    executor = sweeps.array_executor(run)
    if dry_run:
        print(submit.sbatch_script(executor, array_size=len(run.tasks)), end="")
        print(f"\n# array tasks ({'run path, max requeues, script and its' if run.sweep.script else 'hpc-rank'} "
              "arguments):")
        print("\n".join(f"# {task.index}: {shlex.join(argv)}" for task, argv in zip(run.tasks, run.argvs,
                                                                                      strict=True)))
        return 0
    job_id = sweeps.submit_sweep(run, executor)
    print(f"submitted sweep {run.sweep.name}: {len(run.tasks)} configs as job array {job_id} "
          f"(at most {run.sweep.settings.max_concurrent} at once, {run.ranks} rank{'s' * (run.ranks > 1)} each)")
    print(f"then: hpc sweep status {run.directory} | hpc sweep results {run.directory}")
    return 0


def _run_sweep_locally(run, dry_run: bool) -> int:
    """One config after the other, each on the sweep's ranks on this machine, as ``hpc run --launcher local``."""
    from slurm import sweep as sweeps

    name, ranks, count = run.sweep.name, run.ranks, len(run.tasks)
    if dry_run:
        for task, argv in zip(run.tasks, run.commands, strict=True):
            print(f"# task {task.index}: {ranks} local rank{'s' * (ranks > 1)} of")
            print(shlex.join(argv))
        return 0
    sweeps.run_locally(
        run, lambda task: print(f"sweep {name}: task {task.index + 1}/{count}: {sweeps.describe(task)}", flush=True),
        lambda task, exc: print(f"sweep {name}: task {task.index} failed: {exc}", file=sys.stderr, flush=True))
    return show_sweep(run.directory, ranked=True)


def plot_sweep(directory: Path, path: Path) -> None:
    """The metric against each swept key, over the tasks that have a result (show_sweep checked they hold it)."""
    from hpc.observe.plots import save_png, sweep_figure
    from slurm import sweep as sweeps

    points, label = sweeps.metric_points(directory)
    save_png(sweep_figure(points, label), path)
    print(f"wrote {path}")


def show_sweep(directory: Path, ranked: bool) -> int:
    """Print the sweep's table; non-zero when a task failed, so scripts notice."""
    from slurm import sweep as sweeps

    report = sweeps.report(directory, ranked)
    print("\n".join([report.title, format_table(report.header, report.rows), *report.failures]))
    return 1 if report.failed else 0

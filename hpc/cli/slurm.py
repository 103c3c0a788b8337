"""``hpc submit``, ``status``, ``logs``, ``cancel`` and ``sweep``: job specs on Slurm, sweeps also on local ranks.

Your own training script goes the same way (``hpc submit train.py -- ARGS``, a sweep whose base is
a script): hpc/cli/script.py gives its resources and what its srun tasks run.

Nothing heavy at module level (``hpc --help`` stays instant): slurm.* and submitit are
imported by the handlers. Every check that can fail (the spec, the resources, the layout,
each config of a sweep) runs before anything is submitted.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from hpc.cli import script
from hpc.cli.rank import run_in_slurm_task
from hpc.errors import ConfigError, RankFailedError
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


def _rank_argv(spec_path: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """hpc-rank's arguments: the spec by absolute path (the job may start in another directory)."""
    return [os.path.abspath(spec_path), *(arg for override in overrides for arg in ("--set", override))]


def _with_resources(spec, args: argparse.Namespace):
    """The spec with the resource options applied, checked like the spec itself."""
    from hpc.config import spec_from_dict, spec_to_dict

    given = {name: getattr(args, name) for name, _, _ in RESOURCES if getattr(args, name) is not None}
    if args.setup is not None:
        given["setup"] = args.setup
    if not given:
        return spec
    data = spec_to_dict(spec)
    data["slurm"].update(given)
    return spec_from_dict(data, "hpc submit options")


def _ranks(spec) -> int:
    return spec.slurm.nodes * spec.slurm.tasks_per_node


def _submission(args: argparse.Namespace):
    """(resources, the srun task function, its argument, whether it is a job spec), every check passed but
    Slurm's: a script (hpc/cli/script.py) or a job spec."""
    from hpc.config import load_spec

    if script.is_script(args.spec) or args.script_args:
        path, spec = script.submission(args.spec, args.resources, args.overrides)
        spec = _with_resources(spec, args)
        return spec, script.run_script_in_slurm_task, script.task_argv(spec.run_path, spec.slurm.max_requeues, path,
                                                                        args.script_args), False
    if args.resources is not None:
        raise ConfigError("--resources gives a script's resources; a job spec has its own [slurm] section")
    spec = _with_resources(load_spec(args.spec, args.overrides), args)
    return spec, run_in_slurm_task, _rank_argv(args.spec, args.overrides), True


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs.train.layout import check_layout
    from slurm import job_registry, submit

    spec, entry, argv, is_spec = _submission(args)
    ranks = _ranks(spec)
    if not args.dry_run:  # what the cluster offers first: --nodes 3 on two nodes is that, not the batch split
        submit.check_resources(spec.slurm)
    if is_spec:
        check_layout(spec, ranks)
    folder = spec.run_path.absolute() / "slurm"
    executor = submit.make_executor(folder, spec.slurm, spec.job.name)
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
    print(f"submitted job {job_id}: {spec.job.name}, {ranks} rank{'s' * (ranks > 1)} on {nodes} "
          f"node{'s' * (nodes > 1)}")
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
    records = [registry.get(_job_id(args.job))] if args.job else registry.recent()
    if not records:
        print(f"no jobs submitted from here yet (records go to {registry.root})")
        return 0
    rows = job_registry.status_rows(records, job_registry.sacct_states(r.job_id for r in records))
    only = args.job if args.job and "_" in args.job else None
    if only:
        rows = [row for row in rows if row[0] == only]
    for line in job_registry.failure_lines(records, only):  # first: which rank failed, and why
        print(line)
    print(format_table(job_registry.STATUS_HEADER, rows))
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
        job_registry.follow(
            path, lambda: job_registry.sacct_states([job_id]).get(job_id, {}).get("State") in job_registry.DONE_STATES)
        failure = None if args.rank is not None else job_registry.failure_line(job_id, run_path, log_dir=record.log_dir)
    elif path.exists():
        sys.stdout.write(path.read_text(errors="replace"))
    else:
        raise job_registry.JobLookupError(_no_log(job_id, path))
    if failure:
        print(failure)
    return 0


def _no_log(job_id: str, path: Path) -> str:
    """Why a job has no log: not started yet, or ended without one (Slurm could not open it on the node)."""
    from slurm import job_registry

    fields = job_registry.sacct_states([job_id]).get(job_id, {})
    if fields.get("State") not in job_registry.DONE_STATES:
        return f"no log yet: {path} (has job {job_id} started? hpc status {job_id})"
    private = " (/tmp is private to each node)" if path.is_relative_to("/tmp") else ""
    return (f"job {job_id} ended {fields['State']} (exit code {fields.get('ExitCode', '?')}) on "
            f"{fields.get('NodeList', '?')} without writing {path}: Slurm could not create it on the node, so that "
            f"rank never started; job.run_dir must be a directory every node shares{private}")


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
        directory, tasks, spec = _plan_script_sweep(sweep, args, ask_slurm)
        entry = script.run_script_in_slurm_task
        argvs = [script.task_argv(t.run_path, spec.slurm.max_requeues, sweep.base, t.args) for t in tasks]
        local = [script.local_argv(t.run_path, sweep.base, t.args) for t in tasks]
    else:
        if args.script_args:
            raise ConfigError(f"{sweep.label}: options after -- go to a script, and sweep.base "
                              f"{sweep.settings.base} is a job spec")
        directory, tasks, spec = _plan_spec_sweep(sweep, args.overrides, ask_slurm)
        entry = run_in_slurm_task
        argvs = [_rank_argv(str(sweep.base), task.overrides) for task in tasks]
        local = [(sys.executable, "-m", "hpc.cli.rank", *argv) for argv in argvs]
    if (directory / sweeps.MANIFEST).exists() and not args.dry_run:
        raise ConfigError(f"{directory} already holds a sweep: remove it, or give this one another sweep.name or "
                          "sweep.dir")
    if on_slurm:
        return _submit_sweep(sweep, directory, tasks, entry, argvs, spec, args.dry_run)
    return _run_sweep_locally(sweep, directory, tasks, local, _ranks(spec), args.dry_run)


def _plan_spec_sweep(sweep, overrides: list[str], ask_slurm: bool):
    """(directory, tasks, the resources every task shares): each config checked against the spec and the layout."""
    from jobs.train.layout import check_layout
    from slurm import sweep as sweeps

    directory, planned = sweeps.plan(sweep, overrides)
    ranks = _ranks(planned[0][1])  # slurm.* is never swept: every task has the same resources
    if ask_slurm:
        from slurm import submit

        submit.check_resources(planned[0][1].slurm)
    for task, spec in planned:
        try:
            check_layout(spec, ranks)
        except ConfigError as exc:
            raise type(exc)(f"{sweep.label}: config {task.index}: {exc}") from None
    return directory, [task for task, _ in planned], planned[0][1]


def _plan_script_sweep(sweep, args: argparse.Namespace, ask_slurm: bool):
    """(directory, tasks, resources) of a sweep over a script's options: the script, its declared options,
    the sweep file's [slurm] and [job] with --set on them."""
    from slurm import sweep as sweeps

    try:
        path = script.check_script(str(sweep.base))
    except ConfigError as exc:
        raise ConfigError(f"{sweep.label}: sweep.base: {exc}") from None
    spec = script.resources(sweep.resources, sweep.label, args.overrides, sweep.name, job_keys=("run_dir",))
    directory, tasks = sweeps.plan_script(sweep, spec.job.run_dir, sweeps.script_options(path), args.script_args)
    if ask_slurm:
        from slurm import submit

        submit.check_resources(spec.slurm)
    return directory, tasks, spec


def _submit_sweep(sweep, directory: Path, tasks, entry, argvs, spec, dry_run: bool) -> int:
    from slurm import job_registry, submit
    from slurm import sweep as sweeps

    folder = directory / "slurm"
    executor = submit.make_executor(folder, spec.slurm, sweep.name, array_parallelism=sweep.settings.max_concurrent)
    if dry_run:
        print(submit.sbatch_script(executor, array_size=len(tasks)), end="")
        print(f"\n# array tasks ({'run path, max requeues, script and its' if sweep.script else 'hpc-rank'} "
              "arguments):")
        print("\n".join(f"# {task.index}: {shlex.join(argv)}" for task, argv in zip(tasks, argvs, strict=True)))
        return 0
    job_id = submit.submit_array(executor, entry, argvs)
    ranks = _ranks(spec)
    sweeps.write_manifest(directory, sweep, tasks, "slurm", ranks, job_id)
    job_registry.Registry.default().add(job_registry.JobRecord(job_id, sweep.name, ranks, str(folder),
                                                               tuple(str(t.run_path) for t in tasks), array=True))
    print(f"submitted sweep {sweep.name}: {len(tasks)} configs as job array {job_id} "
          f"(at most {sweep.settings.max_concurrent} at once, {ranks} rank{'s' * (ranks > 1)} each)")
    print(f"then: hpc sweep status {directory} | hpc sweep results {directory}")
    return 0


def _run_sweep_locally(sweep, directory: Path, tasks, commands, ranks: int, dry_run: bool) -> int:
    """One config after the other, each on ``ranks`` local ranks exactly as ``hpc run --launcher local``."""
    from hpc.runtime.launch import launch_ranks
    from slurm import sweep as sweeps

    if dry_run:
        for task, argv in zip(tasks, commands, strict=True):
            print(f"# task {task.index}: {ranks} local rank{'s' * (ranks > 1)} of")
            print(shlex.join(argv))
        return 0
    sweeps.write_manifest(directory, sweep, tasks, "local", ranks)
    for task, argv in zip(tasks, commands, strict=True):
        print(f"sweep {sweep.name}: task {task.index + 1}/{len(tasks)}: "
              f"{' '.join(task.args or sweeps.as_overrides(task.params))}", flush=True)
        try:
            launch_ranks(ranks, argv, "local", [], None, "plain", False, task.run_path)
        except RankFailedError as exc:
            sweeps.record_outcome(directory, task.index, "FAILED", str(exc))
            print(f"sweep {sweep.name}: task {task.index} failed: {exc}", file=sys.stderr, flush=True)
        else:
            sweeps.record_outcome(directory, task.index, "COMPLETED")
    return show_sweep(directory, ranked=True)


def plot_sweep(directory: Path, path: Path) -> None:
    """The metric against each swept key, over the tasks that have a result (show_sweep checked they hold it)."""
    from hpc.observe.plots import save_png, sweep_figure
    from hpc.rundir import read_result
    from slurm import sweep as sweeps

    manifest = sweeps.read_manifest(directory)
    metric, goal = manifest["settings"]["metric"], manifest["settings"]["goal"]
    points = [(task["params"], result[metric]) for task in manifest["tasks"]
              if (result := read_result(Path(task["run_path"]))) is not None]
    if not points:
        raise ConfigError(f"{directory}: no task has a result yet: nothing to plot")
    save_png(sweep_figure(points, f"{metric} ({goal})"), path)
    print(f"wrote {path}")


def show_sweep(directory: Path, ranked: bool) -> int:
    """Print the sweep's table; non-zero when a task failed, so scripts notice."""
    from slurm import job_registry
    from slurm import sweep as sweeps

    manifest = sweeps.read_manifest(directory)
    sacct = job_registry.sacct_states([manifest["job_id"]]) if manifest["job_id"] else {}
    states = sweeps.task_states(manifest, sacct)
    header, rows = sweeps.table(manifest, states, ranked)
    counts = ", ".join(f"{states.count(state)} {state.lower()}" for state in dict.fromkeys(states))
    where = f"job array {manifest['job_id']}" if manifest["job_id"] else "local ranks"
    print(f"sweep {manifest['name']} ({where}): {counts}")
    print(format_table(header, rows))
    for line in sweeps.failure_lines(manifest, states):
        print(line)
    return 1 if any(state in job_registry.FAILED_STATES for state in states) else 0

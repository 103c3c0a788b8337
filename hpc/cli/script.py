"""Your own training script on Slurm: ``hpc submit train.py -- ARGS`` and sweeps over its options.

A script (hpc/script.py) has no job spec; what a submission needs of one is its resources and
where its run lives. They come from ``--resources FILE``, a TOML holding only ``[slurm]`` and
optionally ``[job]`` (``name``, ``run_dir``), or, for a sweep, the sweep file's own ``[slurm]`` and
``[job]`` (``run_dir``) tables; then ``--set slurm.KEY=VALUE`` / ``--set job.KEY=VALUE``, then the
resource flags. They are checked as a job spec's sections are (hpc/config.py), so a bad value is
the same one line. ``job.name`` defaults to the script's name; the run directory is
``<job.run_dir>/<job.name>`` (a sweep's task ``<sweep dir>/task-i``).

Every srun task runs :func:`run_script_in_slurm_task` (submitit pickles a reference to it),
which exports ``HPC_RUN_PATH`` and ``HPC_MAX_REQUEUES`` and replaces itself with
``python -u SCRIPT ARGS`` (exec): the script runs as ``__main__`` in the task itself, and the
warning signals that ``env --block-signal`` blocked stay blocked, pending, until the script's
``hpc.session()`` installs its handlers. Nothing heavy is imported here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.config import JobSpec, read_toml, show_path, show_text, show_value, spec_from_dict
from hpc.errors import ConfigError
from hpc.script import MAX_REQUEUES_ENV, RUN_PATH_ENV

if TYPE_CHECKING:
    from slurm.sweep import Sweep, SweepRun

SECTIONS = ("slurm", "job")
JOB_KEYS = ("name", "run_dir")  # what [job] means to a script: no seed, the script seeds itself


def is_script(target: str) -> bool:
    return target.endswith(".py")


def check_script(path: str) -> Path:
    """The script by absolute path, or one line: not a .py file, missing, not a regular file."""
    shown = show_path(path)
    if not is_script(path):
        raise ConfigError(f"{shown}: not a Python script (.py): options after -- go to a script; a job spec "
                          "takes --set KEY=VALUE")
    if not os.path.lexists(path):
        raise ConfigError(f"script {shown}: no such file")
    if not os.path.isfile(path):
        raise ConfigError(f"script {shown}: not a regular file")
    return Path(os.path.abspath(path))


def resources(
    data: Mapping[str, Any], source: str, overrides: Sequence[str], name: str, job_keys: Sequence[str] = JOB_KEYS
) -> JobSpec:
    """A script's resources as a job spec of only ``[job]`` and ``[slurm]``, checked like one.

    ``data``: the tables read from ``source``; ``overrides``: ``--set`` on job or slurm keys only.
    """
    for table in SECTIONS:
        if not isinstance(data.get(table, {}), dict):
            raise ConfigError(f"{source}: {table} must be a table, got {show_value(data[table])}")
    extra = sorted(set(data.get("job", {})) - set(job_keys))
    if extra:
        raise ConfigError(f"{source}: job.{show_text(extra[0])}: a script's [job] holds only "
                          f"{', '.join(job_keys)} here (the script reads its own seed and options)")
    for override in overrides:
        key = override.partition("=")[0].strip()
        if not (key.startswith("slurm.") or key in (f"job.{k}" for k in job_keys)):
            raise ConfigError(f"--set {show_text(override)}: a script takes only "
                              f"{', '.join(f'job.{k}' for k in job_keys)} and slurm.* settings; "
                              "pass its own options after --")
    return spec_from_dict({"job": {"name": name, **data.get("job", {})}, "slurm": data.get("slurm", {})},
                          source, overrides)


def submission(spec_arg: str, resources_file: str | None, overrides: Sequence[str]) -> tuple[Path, JobSpec]:
    """``hpc submit SCRIPT``: the script and its resources (before the resource flags)."""
    script = check_script(spec_arg)
    data: dict[str, Any] = {}
    source = show_path(spec_arg)
    if resources_file is not None:
        source = show_path(resources_file)
        data = read_toml(resources_file, "resources file")
        other = sorted(set(data) - set(SECTIONS))
        if other:
            raise ConfigError(f"{source}: a script's resources file holds only [slurm] and [job], not "
                              f"[{show_text(other[0])}]")
    return script, resources(data, source, overrides, script.stem)


def task_argv(run_path: Path, max_requeues: int, script: Path, args: Sequence[str]) -> list[str]:
    """What :func:`run_script_in_slurm_task` gets: the run directory, the requeue bound, the script, its arguments."""
    return [str(run_path.absolute()), str(max_requeues), str(script), *args]


def local_argv(run_path: Path, script: Path, args: Sequence[str]) -> tuple[str, ...]:
    """A sweep task on local ranks: the script with its run directory exported."""
    return ("env", f"{RUN_PATH_ENV}={run_path}", sys.executable, "-u", str(script), *args)


def sweep_run(sweep: Sweep, overrides: Sequence[str], args: Sequence[str], ask_slurm: bool) -> SweepRun:
    """A sweep over a script's options (slurm/sweep.py), every check passed but Slurm's submission: the script, its
    declared options, the sweep file's [slurm] and [job] with ``overrides`` on them (Slurm's verdict on them when
    ``ask_slurm``); ``args`` (``hpc sweep ... -- ARGS``) go to every task."""
    from slurm import submit
    from slurm import sweep as sweeps

    try:
        path = check_script(str(sweep.base))
    except ConfigError as exc:
        raise ConfigError(f"{sweep.label}: sweep.base: {exc}") from None
    spec = resources(sweep.resources, sweep.label, overrides, sweep.name, job_keys=("run_dir",))
    directory, tasks = sweeps.plan_script(sweep, spec.job.run_dir, sweeps.script_options(path), args)
    if ask_slurm:
        submit.check_resources(spec.slurm)
    return sweeps.SweepRun(sweep, directory, tasks, spec, run_script_in_slurm_task,
                           [task_argv(t.run_path, spec.slurm.max_requeues, sweep.base, t.args) for t in tasks],
                           [local_argv(t.run_path, sweep.base, t.args) for t in tasks])


def run_script_in_slurm_task(argv: list[str]) -> None:
    """What every srun task of ``hpc submit SCRIPT`` runs: the script, in place of this process (see the module)."""
    run_path, max_requeues, script, *args = argv
    os.environ[RUN_PATH_ENV] = run_path
    os.environ[MAX_REQUEUES_ENV] = max_requeues
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", script, *args])

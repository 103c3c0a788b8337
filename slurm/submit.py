"""A job spec's ``[slurm]`` section as an sbatch script, through submitit; one srun task per rank.

submitit writes the script (``#SBATCH`` lines from the parameters, the setup lines, then
``srun ... python -m submitit.core._submit FOLDER``), submits it with sbatch, and in every
task unpickles and calls the entry point the CLI passes in (``hpc-rank SPEC --set ...``
in-process, ``hpc.cli.rank.run_in_slurm_task``), which
joins through ``hpc.init`` from the SLURM_* variables srun sets, exactly as ``srun hpc-rank``
does. Each rank logs stdout and stderr to one file, ``FOLDER/<job>_<rank>_log.out``
(``<array job>_<task>`` in place of ``<job>`` for array tasks); appended to, so a requeued
job continues its logs.

Quoting: submitit quotes the ``#SBATCH`` values and paths; the rank's arguments travel in
the pickle, not in the script. Setup lines are shell written by users, so each is split into
words and joined back quoted (shlex): a line runs as one command with literal arguments, and
``$(...)``, backticks, ``;``, pipes, globs or ``$VAR`` in it are plain text. Anything fancier
belongs in a script that a setup line sources. Nothing from the submitting environment is
written into the script (sbatch passes it on by itself).

Signals (hpc/runtime/preemption.py): every srun task starts under ``env --block-signal``, so a
warning signal during a rank's start-up waits until the rank's handlers are installed instead
of killing it. The batch script traps USR1 and USR2 (``scancel --full`` or ``--batch`` signal
the script itself; bash's default would kill it): before srun starts, no rank can checkpoint,
so the script requeues the job (within ``slurm.max_requeues``) and exits; once srun runs, the
ranks handle the signal and the trap does nothing. A signal that reaches a task in the instant
between slurmstepd starting it and ``env`` blocking the signal kills that rank: srun then exits
128 + the signal's number, and the script requeues the job as before srun.

Runs on login nodes: nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc.config import JobSpec, SlurmConfig, spec_from_dict, spec_to_dict
from hpc.errors import ConfigError, HpcError
from hpc.runtime.preemption import BLOCKED_AT_START, PREEMPTED_EXIT

# srun: one dead rank ends the step at once instead of leaving the others in a collective.
SRUN_ARGS = ("--kill-on-bad-exit=1",)
WARNING_SIGNAL = "USR1"  # see hpc/runtime/preemption.py


class SubmitError(HpcError):
    """sbatch refused the job, or Slurm is not there to ask."""


def time_minutes(limit: str) -> int:
    """A Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in whole minutes, rounded up.

    submitit computes with ``time`` as minutes, so it gets a number rather than Slurm's text.
    """
    days, dash, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if dash:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = [*parts, 0, 0][:3]
        hours += 24 * int(days)
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    else:  # MM, MM:SS
        hours, (minutes, seconds) = 0, [*parts, 0][:2]
    return math.ceil((hours * 3600 + minutes * 60 + seconds) / 60)


def quote_setup(lines: Sequence[str]) -> list[str]:
    """Each setup line as one command with literal, quoted arguments (see the module docs)."""
    quoted = []
    for line in lines:
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise ConfigError(f"slurm.setup line {line!r}: {exc}") from None
        if words:
            quoted.append(shlex.join(words))
    return quoted


def signal_trap(max_requeues: int) -> list[str]:
    """The batch script's first lines: a warning signal before srun starts, or one that killed a rank
    before its handlers existed, requeues the job (see the module docs).

    submitit exports SUBMITIT_EXECUTOR on the line before srun: from there on the ranks own the signal.
    A rank killed by USR1 or USR2 makes srun exit 128 + that signal's number (checked on Slurm 23):
    a rank that handled it exits 75 instead, so only the signal's race with ``env --block-signal``
    (between slurmstepd's fork of the task and the block) ends that way.
    """
    return [
        "unset SUBMITIT_EXECUTOR  # set just before srun: from then on the ranks handle USR1 and USR2",
        "hpc_requeue() {",
        "    local restarts=${SLURM_RESTART_COUNT:-0}",
        f'    if [ "$restarts" -ge {max_requeues} ]; then',
        '        echo "preempted: $1; not requeued: job $SLURM_JOB_ID was requeued $restarts times '
        f'(slurm.max_requeues = {max_requeues})"',
        "    else",
        '        echo "preempted: $1; requeued job $SLURM_JOB_ID '
        f'(requeue $((restarts + 1)) of at most {max_requeues})"',
        '        scontrol requeue "$SLURM_JOB_ID"',
        "    fi",
        f"    exit {PREEMPTED_EXIT}",
        "}",
        "hpc_early_signal() {",
        '    [ -n "${SUBMITIT_EXECUTOR:-}" ] && return',
        '    hpc_requeue "SIG$1 before the ranks started"',
        "}",
        "hpc_ranks_ended() {",
        "    local status=$? signal",
        "    for signal in USR1 USR2; do",
        '        if [ "$status" -eq $((128 + $(kill -l $signal))) ]; then',
        '            hpc_requeue "SIG$signal killed a rank before it could handle it"',
        "        fi",
        "    done",
        "}",
        *(f"trap 'hpc_early_signal {name}' {name}" for name in ("USR1", "USR2")),
        "trap hpc_ranks_ended EXIT",
    ]


def task_python() -> str:
    """The interpreter each srun task runs, with the warning signals blocked from its first instruction."""
    return f"env --block-signal={BLOCKED_AT_START} {shlex.quote(sys.executable)}"


def executor_parameters(slurm: SlurmConfig, name: str, array_parallelism: int | None = None,
                        restart_loop: Sequence[str] = ()) -> dict[str, Any]:
    """submitit's ``update_parameters`` for a spec's resources; unset optional resources stay out of the script.
    ``restart_loop``: the lines of slurm/restart.py's ``srun`` function, set up last (a job, not an array)."""
    params: dict[str, Any] = {
        "job_name": name,
        "nodes": slurm.nodes + slurm.spare_nodes,
        "ntasks_per_node": slurm.tasks_per_node,
        "cpus_per_task": slurm.cpus_per_task,
        "time": time_minutes(slurm.time),
        "signal_delay_s": slurm.signal_delay_s,
        "stderr_to_stdout": True,
        "srun_args": list(SRUN_ARGS),
        "wckey": None,  # submitit's default tags every job "submitit"
        # Ours, not submitit's USR2; requeue: also after a node failure.
        "additional_parameters": {"signal": f"{WARNING_SIGNAL}@{slurm.signal_delay_s}", "requeue": True},
    }
    if slurm.spare_nodes or slurm.elastic:  # a failed node leaves the job running: a spare takes its place
        params["additional_parameters"]["no_kill"] = True
    optional = {"gpus_per_node": slurm.gpus_per_node or None, "gpus_per_task": slurm.gpus_per_task or None,
                "mem": slurm.mem, "partition": slurm.partition,
                "account": slurm.account, "qos": slurm.qos, "constraint": slurm.constraint}
    params.update({key: value for key, value in optional.items() if value})
    setup = quote_setup(slurm.setup)
    params["setup"] = signal_trap(slurm.max_requeues)
    if setup:
        params["setup"] += ["set -e  # a failed setup line ends the job", *setup]
    params["setup"] += list(restart_loop)
    if array_parallelism is not None:
        params["array_parallelism"] = array_parallelism
    return params


def check_resources(slurm: SlurmConfig, environ: Mapping[str, str] | None = None) -> None:
    """Ask Slurm whether it could run a job of these resources (``sbatch --test-only``), before anything is
    submitted: a node count, memory, partition or account the cluster cannot give is sbatch's own reason,
    as one line, and no job (not even a FAILED one) is left in sacct. Node count and resources come first,
    so ``--nodes 3`` on two nodes is that, not a batch that does not divide by 3 ranks."""
    argv = ["sbatch", "--test-only", f"--nodes={slurm.nodes + slurm.spare_nodes}",
            f"--ntasks-per-node={slurm.tasks_per_node}",
            f"--cpus-per-task={slurm.cpus_per_task}", f"--time={time_minutes(slurm.time)}"]
    optional = {"gpus-per-node": slurm.gpus_per_node or "", "gpus-per-task": slurm.gpus_per_task or "",
                "mem": slurm.mem, "partition": slurm.partition,
                "account": slurm.account, "qos": slurm.qos, "constraint": slurm.constraint}
    argv += [f"--{option}={value}" for option, value in optional.items() if value]
    try:
        done = subprocess.run([*argv, "--wrap=true"], capture_output=True, text=True, env=environ, timeout=60)
    except FileNotFoundError:
        raise SubmitError("sbatch not found: is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise SubmitError("sbatch --test-only gave no answer within 60 s: is slurmctld up?") from None
    lines = done.stderr.splitlines()
    if done.returncode == 0 or any(line.startswith("sbatch: fatal:") for line in lines):
        return  # fits; or no controller to ask (no slurm.conf): the submission itself will say so
    reasons = [line.removeprefix("sbatch: error: ") for line in lines if line.strip()]
    reason = "; ".join(dict.fromkeys(reasons)) if reasons else f"exit status {done.returncode}"
    raise SubmitError(f"Slurm cannot run {' '.join(argv[2:])}: {reason}")


def with_resources(spec: JobSpec, given: Mapping[str, Any], source: str) -> JobSpec:
    """``spec`` with the ``slurm.*`` values ``given`` (from ``source``) in place of its own, checked like the spec."""
    if not given:
        return spec
    data = spec_to_dict(spec)
    data["slurm"].update(given)
    return spec_from_dict(data, source)


def job_ranks(slurm: SlurmConfig) -> int:
    """The ranks of a job of these resources: nodes x tasks per node."""
    return slurm.nodes * slurm.tasks_per_node


def rank_argv(spec_path: str, overrides: Sequence[str]) -> list[str]:
    """hpc-rank's arguments in every srun task of a job spec: the spec by absolute path (the job may start in
    another directory) and its ``--set`` overrides."""
    return [os.path.abspath(spec_path), *(arg for override in overrides for arg in ("--set", override))]


def make_executor(folder: Path, slurm: SlurmConfig, name: str, array_parallelism: int | None = None,
                  restart_loop: Sequence[str] = ()):
    """A submitit SlurmExecutor writing into ``folder`` (which must be shared by every node); ``restart_loop``:
    slurm/restart.py's lines, for a job that restarts inside its allocation."""
    import submitit

    try:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=task_python())
    except RuntimeError as exc:  # submitit's "Could not detect srun"
        raise SubmitError(f"Slurm is not available here: {exc}") from None
    executor.update_parameters(**executor_parameters(slurm, name, array_parallelism, restart_loop))
    return executor


def sbatch_script(executor, array_size: int | None = None) -> str:
    """The script ``submit`` (or ``submit_array`` of ``array_size`` tasks) would hand to sbatch, for ``--dry-run``.

    submitit has no public dry run: this is the function its own submission writes the file with,
    given the parameters it adds for an array.
    """
    from submitit.slurm.slurm import _make_sbatch_string

    params = {**executor.parameters, **({"map_count": array_size} if array_size else {})}
    return _make_sbatch_string(command=executor._submitit_command_str, folder=executor.folder, **params)


def submit(executor, entry: Callable[[list[str]], None], argv: Sequence[str]) -> str:
    """Submit one job of ``ntasks`` ranks, each calling ``entry(ARGV)``; returns its job id."""
    return _submitted(lambda: [executor.submit(entry, list(argv))])[0]


def submit_array(executor, entry: Callable[[list[str]], None], argvs: Sequence[Sequence[str]]) -> str:
    """Submit one job array, task i's ranks each calling ``entry(ARGVS[i])``; returns the array's job id."""
    job_ids = _submitted(lambda: executor.map_array(entry, [list(argv) for argv in argvs]))
    return job_ids[0].partition("_")[0]


def _submitted(submission) -> list[str]:
    from submitit.core.utils import FailedJobError

    try:
        return [job.job_id for job in submission()]
    except FailedJobError as exc:  # sbatch's own message, e.g. "Requested node configuration is not available"
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise SubmitError(f"sbatch refused the job: {lines[-1] if lines else exc}") from None


def log_path(folder: Path, job_id: str, rank: int) -> Path:
    """Where rank ``rank`` of job ``job_id`` (``A_T`` for an array task) logs; see submitit's JobPaths."""
    return folder / f"{job_id}_{rank}_log.out"

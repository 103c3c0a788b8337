"""Checkpoint and requeue when Slurm announces the end of a job; the signal handlers only set a flag.

Slurm warns a job before it ends: ``--signal=USR1@T`` arrives T seconds before the time limit
(up to a minute early), SIGTERM on preemption or ``scancel``, SIGKILL KillWait seconds later.
A Python handler runs between two bytecodes of the main thread, possibly inside a collective
or a checkpoint write, so ours only records the signal. The training loop asks once per step
whether any rank got one (:meth:`Preemption.agreed`, an all-reduce, so every rank stops after
the same step), saves a checkpoint and raises :class:`Preempted`. :func:`conclude` then has
rank 0 requeue the job (``scontrol requeue`` on the job's own id, so an array task requeues
alone) unless ``SLURM_RESTART_COUNT`` has reached ``slurm.max_requeues``; the restarted job
resumes from the newest checkpoint (``checkpoint.resume = "auto"``).

submitit has a mechanism of its own, but its handler checkpoints and requeues inside the
signal handler, in the middle of whatever step is running, so ours replaces it.

SIGUSR1 (what ``hpc submit`` asks for) and SIGUSR2 (submitit's default) mean "time is up,
come back later": checkpoint and requeue. SIGTERM means stop: checkpoint and exit, since
Slurm requeues a preempted job by itself and a cancelled one must stay cancelled. Handlers
are installed only in srun tasks; elsewhere our launchers stop ranks with SIGTERM and it keeps
its default action.

Start-up: a signal's default action kills a process, and a rank imports for a second or more
before this module can install anything. ``hpc submit`` therefore starts every srun task with
these signals blocked (``env --block-signal``, :data:`BLOCKED_AT_START`; a signal mask survives
exec), and :class:`Preemption` installs its handlers *then* unblocks them, so a signal that
arrived during start-up waits pending and is recorded the moment the handlers are ready. On
exit it blocks them again: a late signal is dropped with the process instead of killing it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Mapping
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from hpc.errors import HpcError
from hpc.runtime.env import Launcher, detect_rank_info

if TYPE_CHECKING:
    import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL from sysexits.h: stopped at a checkpoint, run again to continue
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# Agreement takes the highest rank: a rank asked to requeue outweighs one asked to stop.
_PRIORITY = {signal.SIGTERM: 1, signal.SIGUSR2: 2, signal.SIGUSR1: 3}
_BY_PRIORITY = {priority: signum for signum, priority in _PRIORITY.items()}
# What slurm/submit.py blocks from the first instruction of every srun task (as env's --block-signal list).
BLOCKED_AT_START = "USR1,USR2,TERM"


class Preempted(HpcError):
    """Raised by the training loop once the state after ``step`` is saved (or cannot be: checkpointing is off)."""

    def __init__(self, step: int, signum: signal.Signals, checkpointed: bool) -> None:
        what = f"checkpointed step {step}" if checkpointed else f"stopped after step {step} WITHOUT a checkpoint " \
            "(checkpoint.every_steps = 0: a restart begins again at step 0)"
        super().__init__(f"{signum.name}: {what}")
        self.step, self.signum, self.checkpointed = step, signum, checkpointed


class Preemption:
    """The first signal this rank received (None until one arrives), while installed as a context manager."""

    def __init__(self, signals: tuple[signal.Signals, ...] = tuple(_PRIORITY)) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._mask: set[signal.Signals] = set()

    def __enter__(self) -> Preemption:
        """Handlers first, then unblock: a signal left pending during start-up is recorded here."""
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._record)
        self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)  # blocked again if they were before
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        """The whole handler: remember the signal, keeping a requeue request over a plain stop."""
        signum = signal.Signals(signum)
        if self.received is None or _PRIORITY[signum] > _PRIORITY[self.received]:
            self.received = signum

    def agreed(self, group: dist.ProcessGroup) -> signal.Signals | None:
        """Collective over ``group``: the signal that stops every rank after this step, or None to go on."""
        import torch
        import torch.distributed as dist

        priority = torch.tensor([_PRIORITY[self.received] if self.received is not None else 0])
        dist.all_reduce(priority, op=dist.ReduceOp.MAX, group=group)
        return _BY_PRIORITY.get(int(priority.item()))


def watch(environ: Mapping[str, str]) -> Preemption | None:
    """A Preemption to install in an srun task, None elsewhere (no handlers, no per-step all-reduce)."""
    return Preemption() if detect_rank_info(environ).launcher is Launcher.SLURM else None


def requeue_plan(stop: Preempted, environ: Mapping[str, str], max_requeues: int) -> tuple[list[str] | None, str]:
    """(the command that requeues this job, or None; what to tell the user), from the signal and past restarts."""
    job = environ.get("SLURM_JOB_ID")  # an array task's own id: requeuing it leaves its siblings alone
    if stop.signum not in REQUEUE_SIGNALS:
        return None, "not requeued: Slurm requeues a preempted job itself, and a cancelled one stays cancelled"
    if not job:
        return None, "not requeued: not a Slurm job; run it again to resume"
    restarts = int(environ.get("SLURM_RESTART_COUNT") or 0)
    if restarts >= max_requeues:
        return None, f"not requeued: job {job} was requeued {restarts} times (slurm.max_requeues = {max_requeues})"
    return ["scontrol", "requeue", job], f"requeued job {job} (requeue {restarts + 1} of at most {max_requeues})"


def conclude(
    stop: Preempted, rank: int, group: dist.ProcessGroup, environ: Mapping[str, str], max_requeues: int
) -> None:
    """Rank 0 requeues the job or says why not; the others wait for it, so that no rank exits
    first and srun's --kill-on-bad-exit cannot take rank 0 down before the requeue."""
    import torch.distributed as dist

    if rank == 0:
        command, message = requeue_plan(stop, environ, max_requeues)
        if command is not None:
            # The requeue itself has slurmstepd SIGTERM every process of the step, scontrol too: seen to kill it
            # before it exited 0 (an empty "requeue failed" for a job that was requeued). It ignores the signal.
            done = subprocess.run(["env", "--ignore-signal=TERM", *command], capture_output=True, text=True,
                                  timeout=60)
            if done.returncode != 0:
                message = f"requeue failed: {' '.join(command)}: {(done.stderr or done.stdout).strip()}"
        # One write: under python -u, print() writes the text and the newline apart, and slurmstepd's
        # "CANCELLED DUE TO JOB REQUEUE" line, in the same log file, can land between them.
        sys.stdout.write(f"preempted: {stop}; {message}\n")
        sys.stdout.flush()
    dist.barrier(group=group)

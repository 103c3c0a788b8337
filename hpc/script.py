"""Your own training script under hpc-batch: the few calls a plain torch script adds to get what spec jobs get.

A script written like the PyTorch DDP tutorial runs under ``hpc run -n 4 train.py``,
``mpirun -np 4 python train.py`` and ``hpc submit train.py -- ARGS`` unchanged once it holds
a :class:`Session` (``jobs/examples/ddp_script.py`` is a complete one)::

    with hpc.session() as run:                     # joins the process group; Slurm's warning signals handled
        model = DDP(Net().to(run.device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        start = run.resume(model, optimizer)       # the newest complete checkpoint's step, 0 without one
        for step in range(start, steps):
            ...one training step...
            run.log(step + 1, loss=loss.item())    # rank 0 appends to metrics.jsonl
            if (step + 1) % 100 == 0:
                run.save(step + 1)                 # sharded, atomic HDF5 checkpoint
            if run.preempted(step + 1):            # true on every rank at the same step, once checkpointed
                break                              # leaving the block requeues: the process exits with 75
        run.finish(test_accuracy=accuracy)         # result.json (final_loss is the last loss logged)

The run directory is ``$HPC_RUN_PATH`` (``hpc submit`` and ``hpc sweep`` export
``<job.run_dir>/<job.name>``, the name defaulting to the script's), else ``runs/<script stem>``
under the working directory (``hpc run``, ``mpirun``). It holds what a spec job's holds:
``metrics.jsonl``, ``result.json``, ``checkpoints/``, and under Slurm ``slurm/`` with a log per
rank, so ``hpc status``, ``hpc logs``, ``hpc report`` and ``hpc sweep results`` read a script's
run as a spec's.

Preemption (hpc/runtime/preemption.py): in an srun task, :func:`session` first installs the
handlers that only record SIGUSR1/SIGUSR2/SIGTERM (``hpc submit`` starts the task with them
blocked, so one during the script's imports waits), then joins. :meth:`Session.preempted` asks
every rank once per step (an all-reduce); when any got a signal it saves a checkpoint of the
model and optimizer :meth:`Session.resume` registered, has rank 0 requeue the job
(``scontrol requeue``, up to ``slurm.max_requeues``), and returns True on every rank. Closing
the session then ends the process with status 75; the requeued job's ``resume`` continues from
that step. Outside Slurm the check is free and always False.

A :class:`Session` is the user's face of the run session a spec job runs in (``hpc/run_session.py``):
start-up, resume, save, metrics, the stop and requeue, ``result.json`` are the same code for both.
State lives in the Session the script holds: nothing is global but the process group itself.
``import hpc.script`` is cheap (torch and h5py are imported by the calls), so the CLI reads its
constants on a login node.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hpc.errors import HpcError
from hpc.runtime import preemption

if TYPE_CHECKING:
    import torch

    from hpc.checkpoint import Piece
    from hpc.checkpoint.format import CheckpointIndex
    from hpc.run_session import RunSession

RUN_PATH_ENV = "HPC_RUN_PATH"  # the run directory; hpc submit and hpc sweep export it
MAX_REQUEUES_ENV = "HPC_MAX_REQUEUES"  # slurm.max_requeues of the submission
DEFAULT_RUN_DIR = "runs"


def run_path_for(environ: Mapping[str, str], script: str) -> Path:
    """Where a script's run keeps its files: ``$HPC_RUN_PATH``, else ``runs/<script stem>``."""
    given = environ.get(RUN_PATH_ENV)
    return Path(given) if given else Path(DEFAULT_RUN_DIR) / Path(script).stem


def session(
    backend: str = "auto",
    init_timeout_s: float = 60.0,
    timeout_s: float = 300.0,
    *,
    keep: int = 3,
    async_save: bool = False,
    tensorboard: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Session:
    """Join the job (:func:`hpc.init` with these arguments) and return the script's :class:`Session`.

    In an srun task the preemption handlers go in first. Without OMP_NUM_THREADS, torch takes
    the threads every launcher gives a rank (``--cpus-per-task`` under srun). ``keep``: how many
    checkpoints to keep; ``async_save``: write checkpoints in the background, as ``checkpoint.async_save`` does
    for a spec job (committed within ``timeout_s``); ``tensorboard``: also write TensorBoard scalars beside
    metrics.jsonl.
    """
    from hpc import run_session
    from hpc.config import SlurmConfig
    from hpc.errors import HpcError
    from hpc.runtime.abort import abort_job

    environ = os.environ if environ is None else environ
    max_requeues = int(environ.get(MAX_REQUEUES_ENV) or SlurmConfig().max_requeues)
    run_path = run_path_for(environ, sys.argv[0])
    try:
        started = run_session.start(
            run_path, backend=backend, init_timeout_s=init_timeout_s, timeout_s=timeout_s, environ=environ,
            run_dir_setting=RUN_PATH_ENV, max_requeues=max_requeues, keep=keep, async_save=async_save,
            tensorboard=tensorboard)
    except HpcError as exc:  # the launch's own problem (its variables, the rendezvous): one line, as hpc-rank says it
        abort_job(exc, run_path)
    return Session(started)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel: checkpoints name tensors as the plain model does."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class ScriptState:
    """A script's model and optimizer as the run session saves them: whole on every rank, its layout the world
    size (``hpc.run_session.TrainingState``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> None:
        self.model, self.optimizer, self.world_size = _unwrapped(model), optimizer, world_size

    def layout(self) -> dict[str, int]:
        return {"layout_dp": self.world_size, "layout_tp": 1, "layout_pp": 1, "layout_ep": 1, "layout_nodes": 1}

    def pieces(self) -> list[Piece]:
        from hpc.checkpoint.state import state_pieces

        return state_pieces(self.model, self.optimizer)

    def private_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load(self, index: CheckpointIndex, same_layout: bool) -> None:
        from hpc.checkpoint.state import load_state

        load_state(index, self.model, self.optimizer)


class Session:
    """A script's run (see the module): its world, run directory, checkpoints, metrics and preemption watch,
    held by ``run``, the run session a spec job's rank runs in too."""

    def __init__(self, run: RunSession) -> None:
        self.run = run
        self._state: ScriptState | None = None
        self._last: dict[str, Any] = {}
        self._finished = False

    @property
    def world(self):
        return self.run.world

    @property
    def run_path(self) -> Path:
        return self.run.run_path

    @property
    def rank(self) -> int:
        return self.run.rank

    @property
    def size(self) -> int:
        return self.run.size

    @property
    def device(self) -> torch.device:
        """This rank's device: its GPU under NCCL, else the CPU."""
        return self.run.device

    @property
    def checkpoint_path(self) -> Path:
        return self.run.checkpoint_path

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Collective. Register what :meth:`save` and a preemption checkpoint, and load the newest complete
        checkpoint of this run into it (any world size saved it); returns its step, or 0 without one.

        A rank also gets its RNGs back (the CPU's, and its GPU's where CUDA is) when the world size is the one that
        saved it.
        """
        self._state = ScriptState(model, optimizer, self.size)
        index = self.run.resume(self._state)
        return 0 if index is None else index.step

    def save(self, step: int) -> None:
        """Collective: checkpoint the model and optimizer :meth:`resume` registered as ``step``
        (every rank writes its share; rank 0 commits it atomically; the ``keep`` newest stay)."""
        if self._state is None:
            raise HpcError("save() checkpoints what resume(model, optimizer) registered: call resume first")
        self.run.save(step, self._state)

    def log(self, step: int, **values: float) -> None:
        """Rank 0 appends ``{"step": step, **values}`` to metrics.jsonl (``loss`` is what hpc status shows);
        the other ranks write nothing. Not collective: pass a global value (all-reduced) to log one."""
        self._last = {"step": step, **{key: value.item() if hasattr(value, "item") else value  # a 0-d tensor too
                                       for key, value in values.items()}}
        self.run.log(self._last)

    def preempted(self, step: int) -> bool:
        """Collective in an srun task (always False elsewhere): whether any rank got a warning signal.

        When one did, every rank gets True at this same step, after the state of ``step`` is
        checkpointed and rank 0 requeued the job; leave the training loop: closing the session
        ends the process with status 75.
        """
        if self.run.stopped is not None:
            return True
        signum = self.run.stop_signal()
        if signum is None:
            return False
        if self._state is not None:
            self.save(step)
        stop = preemption.Preempted(step, signum, checkpointed=self._state is not None)
        if self._state is None:
            stop.message = (f"{signum.name}: stopped after step {step} WITHOUT a checkpoint (resume(model, "
                            "optimizer) registered nothing to save: a restart begins again at step 0)")
        self.run.stop(stop)
        return True

    def finish(self, **measures: float) -> None:
        """Rank 0 writes result.json: ``steps`` and ``final_loss`` from the last :meth:`log`, then ``measures``
        (what a sweep's ``metric`` may name). Closing the session after a normal end does this if not done."""
        from hpc.rundir import last_metrics

        self._finished = True
        if self.rank != 0:
            return
        last = self._last or last_metrics(self.run_path) or {}  # a run resumed at its end logs nothing itself
        record: dict[str, Any] = {"steps": last.get("step", self.run.saved_step)}
        if "loss" in last:
            record["final_loss"] = last["loss"]
        self.run.finish({**record, **measures})

    def close(self) -> None:
        """Finish writing checkpoints and metrics, leave the process group; after a preemption, exit with 75."""
        if self.run.closed:
            return
        self.run.close()
        if self.run.stopped is not None:
            raise SystemExit(preemption.PREEMPTED_EXIT)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """A normal end writes result.json and closes; an exception on any rank takes the whole job down."""
        from hpc.runtime.abort import abort_job

        if exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            abort_job(exc, self.run_path)  # recorded in the run directory, as hpc-rank's are
        if self.run.stopped is None and not self._finished:
            self.finish()
        self.close()

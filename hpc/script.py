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

    from hpc.checkpoint import Checkpointer
    from hpc.observe.metrics import MetricsLog
    from hpc.runtime.bootstrap import World

RUN_PATH_ENV = "HPC_RUN_PATH"  # the run directory; hpc submit and hpc sweep export it
MAX_REQUEUES_ENV = "HPC_MAX_REQUEUES"  # slurm.max_requeues of the submission
DEFAULT_RUN_DIR = "runs"
CHECKPOINTS_DIR = "checkpoints"


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
    tensorboard: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Session:
    """Join the job (:func:`hpc.init` with these arguments) and return the script's :class:`Session`.

    In an srun task the preemption handlers go in first. Without OMP_NUM_THREADS, torch takes
    the threads every launcher gives a rank (``--cpus-per-task`` under srun). ``keep``: how many
    checkpoints to keep; ``tensorboard``: also write TensorBoard scalars beside metrics.jsonl.
    """
    import torch

    from hpc.config import SlurmConfig
    from hpc.runtime import bootstrap
    from hpc.runtime.launch import rank_threads

    environ = os.environ if environ is None else environ
    watcher = preemption.watch(environ)
    if watcher is not None:
        watcher.__enter__()  # before anything slow: a pending warning signal is recorded, not fatal
    try:
        if "OMP_NUM_THREADS" not in environ:
            torch.set_num_threads(rank_threads(environ))
        from hpc.rundir import enable_flight_recorder

        run_path = run_path_for(environ, sys.argv[0])
        enable_flight_recorder(run_path, environ)
        world = bootstrap.init(backend, init_timeout_s, timeout_s, environ)
        try:
            run_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HpcError(f"rank {world.rank} cannot create the run directory {run_path}: {exc.strerror}",
                           variable=RUN_PATH_ENV) from None
    except BaseException:
        if watcher is not None:
            watcher.__exit__(None, None, None)
        raise
    max_requeues = int(environ.get(MAX_REQUEUES_ENV) or SlurmConfig().max_requeues)
    return Session(world, run_path, watcher, environ, max_requeues, keep, tensorboard)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel: checkpoints name tensors as the plain model does."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class Session:
    """A script's run: its world, run directory, checkpoints, metrics and preemption watch (see the module)."""

    def __init__(self, world: World, run_path: Path, watcher: preemption.Preemption | None,
                 environ: Mapping[str, str], max_requeues: int = 3, keep: int = 3, tensorboard: bool = False) -> None:
        self.world, self.run_path = world, run_path
        self._watcher, self._environ, self._max_requeues = watcher, environ, max_requeues
        self._keep, self._tensorboard = keep, tensorboard
        self._state: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None
        self._checkpointer: Checkpointer | None = None
        self._saved_step: int | None = None
        self._metrics: MetricsLog | None = None
        self._last: dict[str, Any] = {}
        self._stop: preemption.Preempted | None = None
        self._finished = self._closed = False

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def device(self) -> torch.device:
        """This rank's device: its GPU under NCCL, else the CPU."""
        return self.world.device

    @property
    def checkpoint_path(self) -> Path:
        return self.run_path / CHECKPOINTS_DIR

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Collective. Register what :meth:`save` and a preemption checkpoint, and load the newest complete
        checkpoint of this run into it (any world size saved it); returns its step, or 0 without one.

        A rank also gets its RNGs back (the CPU's, and its GPU's where CUDA is) when the world size is the one that
        saved it.
        """
        import torch.distributed as dist

        from hpc.checkpoint.load import load_rank_state, open_checkpoint
        from hpc.checkpoint.state import CUDA_RNG, RNG, choose_resume, load_state, restore_rng

        self._state = (model, optimizer)
        path = choose_resume("auto", self.checkpoint_path, dist.group.WORLD)
        if path is None:
            return 0
        index = open_checkpoint(path)
        load_state(index, _unwrapped(model), optimizer)
        if index.world_size == self.size:  # rank r holds what rank r held
            restore_rng(load_rank_state(index, self.rank, only=(RNG, CUDA_RNG)))
        if self.rank == 0:
            print(f"resumed from {path} at step {index.step}", flush=True)
        self._saved_step = index.step
        return index.step

    def save(self, step: int) -> None:
        """Collective: checkpoint the model and optimizer :meth:`resume` registered as ``step``
        (every rank writes its share; rank 0 commits it atomically; the ``keep`` newest stay)."""
        import torch.distributed as dist

        from hpc.checkpoint import Checkpointer
        from hpc.checkpoint.state import rng_state, state_pieces

        if self._state is None:
            raise HpcError("save() checkpoints what resume(model, optimizer) registered: call resume first")
        if step == self._saved_step:
            return
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.checkpoint_path, dist.group.WORLD, keep=self._keep)
        model, optimizer = self._state
        self._checkpointer.save(step, state_pieces(_unwrapped(model), optimizer), rng_state())
        self._saved_step = step

    def log(self, step: int, **values: float) -> None:
        """Rank 0 appends ``{"step": step, **values}`` to metrics.jsonl (``loss`` is what hpc status shows);
        the other ranks write nothing. Not collective: pass a global value (all-reduced) to log one."""
        from hpc.observe.metrics import MetricsLog
        from hpc.rundir import METRICS_FILE

        self._last = {"step": step, **{key: value.item() if hasattr(value, "item") else value  # a 0-d tensor too
                                       for key, value in values.items()}}
        if self.rank != 0:
            return
        if self._metrics is None:
            self._metrics = MetricsLog(self.run_path / METRICS_FILE, tensorboard=self._tensorboard)
        self._metrics.write(self._last)

    def preempted(self, step: int) -> bool:
        """Collective in an srun task (always False elsewhere): whether any rank got a warning signal.

        When one did, every rank gets True at this same step, after the state of ``step`` is
        checkpointed and rank 0 requeued the job; leave the training loop: closing the session
        ends the process with status 75.
        """
        import torch.distributed as dist

        if self._stop is not None:
            return True
        if self._watcher is None:
            return False
        signum = self._watcher.agreed(dist.group.WORLD)
        if signum is None:
            return False
        if self._state is not None:
            self.save(step)
        self._stop = preemption.Preempted(step, signum, checkpointed=self._state is not None)
        if self._state is None:
            self._stop.message = (f"{signum.name}: stopped after step {step} WITHOUT a checkpoint (resume(model, "
                                  "optimizer) registered nothing to save: a restart begins again at step 0)")
        preemption.conclude(self._stop, self.rank, dist.group.WORLD, self._environ, self._max_requeues)
        return True

    def finish(self, **measures: float) -> None:
        """Rank 0 writes result.json: ``steps`` and ``final_loss`` from the last :meth:`log`, then ``measures``
        (what a sweep's ``metric`` may name). Closing the session after a normal end does this if not done."""
        from hpc.rundir import RESULT_FILE, last_metrics, write_json

        self._finished = True
        if self.rank != 0:
            return
        last = self._last or last_metrics(self.run_path) or {}  # a run resumed at its end logs nothing itself
        record: dict[str, Any] = {"steps": last.get("step", self._saved_step)}
        if "loss" in last:
            record["final_loss"] = last["loss"]
        write_json(self.run_path / RESULT_FILE, {**record, **measures, "world_size": self.size,
                                                 "job_id": self.world.info.job_id})

    def close(self) -> None:
        """Finish writing checkpoints and metrics, leave the process group; after a preemption, exit with 75."""
        from hpc.runtime import bootstrap

        if self._closed:
            return
        self._closed = True
        if self._checkpointer is not None:
            self._checkpointer.finalize()
        if self._metrics is not None:
            self._metrics.close()
        bootstrap.shutdown()
        if self._stop is not None:
            self._ignore_late_signals()
            raise SystemExit(preemption.PREEMPTED_EXIT)
        if self._watcher is not None:
            self._watcher.__exit__(None, None, None)

    def _ignore_late_signals(self) -> None:
        """Stopping for a requeue, the signal Slurm's requeue sends the step must not kill the process first:
        threads that outlive the process group (DDP keeps gloo's) do not block it, so ignore it."""
        import signal

        for signum in self._watcher.signals if self._watcher is not None else ():
            signal.signal(signum, signal.SIG_IGN)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """A normal end writes result.json and closes; an exception on any rank takes the whole job down."""
        from hpc.runtime.abort import abort_job

        if exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            abort_job(exc)
        if self._stop is None and not self._finished:
            self.finish()
        self.close()

"""The run session: what every run does around its steps, for spec jobs and user scripts alike.

A spec job (``hpc-rank``: ``hpc/cli/rank.py`` and ``jobs/train/loop.py``) and a script
(``hpc.session()``: ``hpc/script.py``) are the same run to Slurm, to ``hpc status`` and to a
requeue, so one object does it for both, in this order: start watching for Slurm's warning
signals (before anything slow), give torch the rank's threads, make the run directory (one line
naming it and the host when it cannot be made), turn on NCCL's flight recorder, join the process
group; then resume (the newest complete checkpoint, or ``checkpoint.resume``'s), save (sync or
async, committed within the commit timeout), append metrics, agree on a stop signal and requeue,
write ``result.json``, close.

What is saved is the run's business, through a small protocol (:class:`TrainingState`): its
tensors as checkpoint pieces, its rank-private state beyond the RNGs, the layout it runs under and
how to load itself. The session owns the RNGs: a rank gets its own back when the checkpoint was
saved under the same layout (rank r then holds what rank r held); a script's layout is its world
size, so a script and a spec job restore alike.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpc.errors import HpcError
from hpc.rundir import CHECKPOINTS_DIR
from hpc.runtime import preemption

if TYPE_CHECKING:
    import torch

    from hpc.checkpoint import Checkpointer, Piece
    from hpc.checkpoint.format import CheckpointIndex
    from hpc.checkpoint.local import LocalTier
    from hpc.config import JobSpec
    from hpc.observe.metrics import MetricsLog
    from hpc.runtime.bootstrap import World

LAYOUT_AXES = ("dp", "tp", "pp", "ep", "nodes")  # nodes: those a hierarchical gradient exchange was cut by


class TrainingState(Protocol):
    """What a session saves and resumes."""

    def layout(self) -> dict[str, int]:
        """``layout_<axis>`` for each of :data:`LAYOUT_AXES`: the run's layout, recorded with each checkpoint."""

    def pieces(self) -> list[Piece]:
        """This rank's share of the tensors to write (model and optimizer)."""

    def private_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state besides its RNGs (a distributed optimizer's communication state)."""

    def load(self, index: CheckpointIndex, same_layout: bool) -> None:
        """Load the checkpoint into this rank's share; ``same_layout``: whether its private state applies."""


def saved_layout(attrs: Mapping[str, Any]) -> tuple[int | None, ...]:
    """The (dp, tp, pp, ep, nodes) a checkpoint was saved under; ep and nodes 1 when it predates them."""
    values = (attrs.get(f"layout_{axis}", 1 if axis in ("ep", "nodes") else None) for axis in LAYOUT_AXES)
    return tuple(int(value) if value is not None else None for value in values)  # HDF5 gives numpy integers


def _check_same_optimizer(saved: Mapping[str, Any], current: Mapping[str, Any], path: Path) -> None:
    """A spec job resumes only the optimizer that saved its state (Adam's moments mean nothing to SGD, and SGD's
    momentum has no step count for Adam): one line naming ``train.optimizer`` where the recorded specs differ."""
    from hpc.checkpoint.format import CheckpointError

    def optimizer(attrs: Mapping[str, Any]) -> str | None:
        try:
            return json.loads(str(attrs["job_spec"]))["train"]["optimizer"]
        except (KeyError, TypeError, ValueError):  # a script's checkpoint, or one without a readable spec
            return None

    before, now = optimizer(saved), optimizer(current)
    if before is not None and now is not None and before != now:
        raise CheckpointError(f"{path} was saved with train.optimizer = {before!r} and this run has {now!r}: the "
                              f"optimizer's state does not carry over; resume with {before!r}, or start from its "
                              f"weights alone with checkpoint.init_from = {path}")


def load_checkpoint(index: CheckpointIndex, state: TrainingState, rank: int, same_layout: bool) -> None:
    """``state`` from the checkpoint, and ``rank``'s RNGs when it was saved under the same layout."""
    from hpc.checkpoint.load import load_rank_state
    from hpc.checkpoint.state import CUDA_RNG, RNG, restore_rng

    state.load(index, same_layout)
    if same_layout:
        restore_rng(load_rank_state(index, rank, only=(RNG, CUDA_RNG)))


def make_run_dir(path: Path, setting: str = "job.run_dir") -> None:
    """The run directory on this host, or one line that says which directory and where (a node's private /tmp?)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HpcError(f"cannot create the run directory {path} on {socket.gethostname()}: {exc.strerror}; "
                       f"{setting} must be writable, and shared by every node") from None


def write_result(path: Path, record: Mapping[str, Any], world: World) -> None:
    """``result.json``: the run's measures with its world size and Slurm job, replaced atomically."""
    from hpc.rundir import write_json

    write_json(path, {**record, "world_size": world.size, "job_id": world.info.job_id})


def spec_options(spec: JobSpec) -> dict[str, Any]:
    """A spec job's session settings: its checkpoint directory, retention, async saves and commit timeout, its
    requeue limit, TensorBoard scalars beside metrics.jsonl (where tensorboard is installed), and its spec
    recorded with every checkpoint (``hpc ckpt export`` reads it)."""
    from hpc.config import spec_to_dict

    cfg = spec.checkpoint
    return {"checkpoint_path": spec.checkpoint_path, "keep": cfg.keep, "async_save": cfg.async_save,
            "local_every": cfg.local_every_steps, "local_keep": cfg.local_keep, "local_dir": cfg.local_dir,
            "commit_timeout_s": spec.parallel.timeout_s, "max_requeues": spec.slurm.max_requeues, "tensorboard": True,
            "attrs": {"job_spec": json.dumps(spec_to_dict(spec))}}


def start(
    run_path: Path,
    *,
    backend: str = "auto",
    init_timeout_s: float = 60.0,
    timeout_s: float = 300.0,
    device: str = "auto",
    environ: Mapping[str, str] | None = None,
    run_dir_setting: str = "job.run_dir",
    **options: Any,
) -> RunSession:
    """Start a rank's run: the warning-signal watch first (an srun task only), the rank's threads, the run
    directory, the flight recorder, then join; ``options`` go to :class:`RunSession`."""
    import torch

    from hpc.rundir import enable_flight_recorder
    from hpc.runtime import bootstrap
    from hpc.runtime.launch import rank_threads

    environ = os.environ if environ is None else environ
    watcher = preemption.watch(environ)
    if watcher is not None:
        watcher.__enter__()  # before anything slow: a pending warning signal is recorded, not fatal
    try:
        if "OMP_NUM_THREADS" not in environ:  # else torch follows it: the user's, or what our launchers set
            torch.set_num_threads(rank_threads(environ))
        make_run_dir(run_path, run_dir_setting)
        enable_flight_recorder(run_path, environ)
        world = bootstrap.init(backend, init_timeout_s, timeout_s, environ, device=device)
    except BaseException:
        if watcher is not None:
            watcher.__exit__(None, None, None)
        raise
    options.setdefault("commit_timeout_s", timeout_s)  # a commit waits on every rank as a collective would
    return RunSession(world, run_path, watcher=watcher, environ=environ, owns_world=True, **options)


class RunSession:
    """One rank's run: its world, run directory, checkpoints, metrics, stop signal and result (see the module).

    ``owns_world``: closing leaves the process group and removes the signal watch (a session :func:`start` made);
    a session attached to a world and a watch its caller holds (a test's ranks) leaves both as they are.
    """

    def __init__(self, world: World, run_path: Path, *, watcher: preemption.Preemption | None = None,
                 environ: Mapping[str, str] | None = None, max_requeues: int = 3, keep: int = 3,
                 async_save: bool = False, commit_timeout_s: float = 300.0, tensorboard: bool = False,
                 attrs: Mapping[str, Any] | None = None, checkpoint_path: Path | None = None,
                 owns_world: bool = False, local_every: int = 0, local_keep: int = 2, local_dir: str = "") -> None:
        self.world, self.run_path = world, Path(run_path)
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else self.run_path / CHECKPOINTS_DIR
        self.watcher, self.environ = watcher, os.environ if environ is None else environ
        self.max_requeues, self.keep, self.async_save = max_requeues, keep, async_save
        self.commit_timeout_s, self.tensorboard, self.owns_world = commit_timeout_s, tensorboard, owns_world
        self.attrs = dict(attrs or {})  # recorded with every checkpoint (a spec job's job_spec)
        self.checkpointer: Checkpointer | None = None
        # the node-local tier (hpc/checkpoint/local.py)
        self.local_every, self.local_keep, self.local_dir = local_every, local_keep, local_dir
        self.local: LocalTier | None = None
        self.metrics: MetricsLog | None = None
        self.saved_step: int | None = None
        self.stopped: preemption.Preempted | None = None
        self.closed = False

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def device(self) -> torch.device:
        return self.world.device

    def resume(self, state: TrainingState, source: str = "auto") -> CheckpointIndex | None:
        """Collective: load the checkpoint ``source`` names (``auto``: this run's newest complete one, if any;
        rank 0 chooses, so all ranks agree) into ``state``, and this rank's RNGs when the layout is the one that
        saved it. Returns the checkpoint's index, or None when there is none to resume."""
        import torch.distributed as dist

        from hpc.checkpoint.load import open_checkpoint
        from hpc.checkpoint.state import choose_resume

        path = choose_resume(source, self.checkpoint_path, dist.group.WORLD)
        index = None if path is None else open_checkpoint(path)
        if source == "auto" and self.local_every:  # the local tier's newest, where newer than the persistent one
            local = self._restore_local(state, None if index is None else index.step)
            path, index = (local.path, local) if local is not None else (path, index)
        if path is None or index is None:
            return None
        _check_same_optimizer(index.attrs, self.attrs, path)
        saved, current = saved_layout(index.attrs), saved_layout(state.layout())
        same_layout = saved == current if saved[0] is not None else index.world_size == self.size  # older scripts'
        load_checkpoint(index, state, self.rank, same_layout)
        if self.rank == 0:
            if not same_layout:
                print(f"note: {path} was saved under (dp, tp, pp, ep, nodes) = {saved}, this run is {current}: "
                      "every rank starts with a fresh RNG and communication state (codec residuals, warm starts, "
                      "velocities)", flush=True)
            print(f"resumed from {path} at step {index.step}", flush=True)
        self.saved_step = index.step
        return index

    def local_tier(self) -> LocalTier:
        """Collective the first time: the node-local tier of this run (a Gloo group beside the job's)."""
        from hpc.checkpoint.discovery import local_root
        from hpc.checkpoint.local import LocalTier

        if self.local is None:
            self.local = LocalTier(local_root(self.run_path, self.local_dir), self.world.info.node_rank,
                                   self.local_keep)
        return self.local

    def _restore_local(self, state: TrainingState, newer_than: int | None) -> CheckpointIndex | None:
        """The index, in this node's directory, of the newest local step above ``newer_than``; None if none."""
        from hpc.checkpoint.local import needed_files

        pieces = state.pieces()
        return self.local_tier().restore(newer_than, lambda index: needed_files(index, pieces, self.rank))

    def save_local(self, step: int, state: TrainingState, **attrs: Any) -> None:
        """Collective: ``step`` into the node-local tier (each node's scratch, each shard also on the next node)."""
        from hpc.checkpoint.state import rng_state

        if step == self.saved_step:
            return
        private = {**rng_state(), **state.private_state()}
        self.local_tier().save(step, state.pieces(), private, {**state.layout(), **self.attrs, **attrs})

    def save(self, step: int, state: TrainingState, **attrs: Any) -> None:
        """Collective: checkpoint ``state`` as ``step`` (every rank writes its share; rank 0 commits it atomically;
        the ``keep`` newest stay), with the layout, the session's attributes and ``attrs``; once per step."""
        import torch.distributed as dist

        from hpc.checkpoint import Checkpointer
        from hpc.checkpoint.state import rng_state

        if step == self.saved_step:
            return
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.checkpoint_path, dist.group.WORLD, keep=self.keep,
                                             async_save=self.async_save, commit_timeout_s=self.commit_timeout_s)
        private = {**rng_state(), **state.private_state()}
        self.checkpointer.save(step, state.pieces(), private, {**state.layout(), **self.attrs, **attrs})
        self.saved_step = step

    def wait_for_saves(self) -> None:
        """Every checkpoint this rank started is written and committed (an async save's too)."""
        if self.checkpointer is not None:
            self.checkpointer.finalize()

    def stop_signal(self) -> Any:
        """Collective in an srun task (None elsewhere, free): the warning signal any rank got, or None."""
        import torch.distributed as dist

        return self.watcher.agreed(dist.group.WORLD) if self.watcher is not None else None

    def stop(self, stopped: preemption.Preempted) -> None:
        """Collective: every checkpoint written, rank 0 requeues the job (or says why not), the others wait."""
        import torch.distributed as dist

        self.wait_for_saves()
        preemption.conclude(stopped, self.rank, dist.group.WORLD, self.environ, self.max_requeues)
        self.stopped = stopped

    def log(self, record: Mapping[str, Any]) -> None:
        """Rank 0 appends ``record`` to metrics.jsonl with the wall-clock ``time`` it was logged at (what ``hpc
        status`` times a restart's recovery by), and to TensorBoard when asked; the others write nothing."""
        from hpc.observe.metrics import MetricsLog
        from hpc.rundir import METRICS_FILE

        if self.rank != 0:
            return
        if self.metrics is None:
            self.metrics = MetricsLog(self.run_path / METRICS_FILE, tensorboard=self.tensorboard)
        self.metrics.write({**record, "time": time.time()})

    def finish(self, record: Mapping[str, Any]) -> None:
        """Rank 0 writes result.json: ``record`` with the world size and the Slurm job."""
        from hpc.rundir import RESULT_FILE

        if self.rank == 0:
            write_result(self.run_path / RESULT_FILE, record, self.world)

    def close(self) -> None:
        """Finish writing checkpoints and metrics; leave the process group when this session joined it."""
        from hpc.runtime import bootstrap

        if self.closed:
            return
        self.closed = True
        self.wait_for_saves()
        if self.metrics is not None:
            self.metrics.close()
        if not self.owns_world:
            return
        bootstrap.shutdown()
        if self.stopped is not None:
            self._ignore_late_signals()
        elif self.watcher is not None:
            self.watcher.__exit__(None, None, None)

    def _ignore_late_signals(self) -> None:
        """Stopping for a requeue, the signal Slurm's requeue sends the step must not kill the process first:
        threads that outlive the process group (DDP keeps gloo's) do not block it, so ignore it."""
        import signal

        for signum in self.watcher.signals if self.watcher is not None else ():
            signal.signal(signum, signal.SIG_IGN)


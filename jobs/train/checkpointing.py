"""The training loop's state as checkpoint pieces, and back; resume and save on schedule.

Names in the checkpoint: ``model/<name>``, ``optim/<parameter name>/<key>`` and the per-rank
``rng/torch_cpu`` (and ``rng/torch_cuda`` on GPUs), as ``hpc/checkpoint/state.py`` writes them for
any model and optimizer; here each tensor-parallel shard is placed by the ``partition_dims`` of its layer
(``parallel.tensor_parallel.tp_split_dims``), and under pipeline parallelism a rank's model
holds only its stages, so it writes only their tensors. Besides, per rank, ``comm/<key>``:
the distributed optimizer's ``comm_state_dict()``, what data-parallel
communication carries into the next step: the reducer's error-feedback residuals
(``comm/residual/...``) and PowerSGD's warm starts (``comm/q/...``), top-k's momentum
velocity (``comm/velocity/...``, Deep Gradient Compression keeps SGD's momentum there
instead of in the optimizer) and ``comm/steps_synchronized``, which decides when
``compression_warmup_steps`` end; restored, each goes to the device of this rank's
parameters. Under ZeRO stage 1 a rank holds, and so writes, only the optimizer state of the
parameters it owns; the index still shows each state tensor whole.
And the attributes ``layout_dp``, ``layout_tp``,
``layout_pp``, ``layout_ep`` (absent before expert parallelism: 1), ``job_spec`` (JSON) and ``loss``, the
global loss of the last step before the save (absent from older checkpoints; a resume with no steps left reports it).

The data position is the step itself: a batch is a pure function of (seed, step)
(``jobs.data.datasets.global_batch_indices``). A rank restores its own RNG and communication
state when the checkpoint was saved under the same (dp, tp, pp, ep) layout; under another one
the ranks keep their fresh state, since rank r no longer holds what rank r held (its
residuals and velocities describe other buckets), except ``steps_synchronized``, which
every rank shares and which is taken from rank 0. ep counts as much as dp: at ep > 1 the
sharded experts are outside the DP optimizer (``parallel.ep`` reduces them), so a change
of ep, even at the same dp, puts other parameters in each bucket.

Fine-tuning (``checkpoint.init_from``) reads only the ``model/`` tensors of another run's checkpoint,
under any layout, and the run starts at step 0 with fresh optimizer, RNG and communication state, so
the learning-rate schedule's warm-up and decay count from the fine-tune's own first step. A checkpoint
of the run's own, which ``checkpoint.resume`` finds first (a requeue), continues where it stopped.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.checkpoint import Checkpointer, Piece, state
from hpc.checkpoint.format import CheckpointError, CheckpointIndex, read_index
from hpc.checkpoint.load import load_into, load_rank_state, open_checkpoint
from hpc.checkpoint.state import restore_rng, rng_state
from hpc.config import JobSpec, spec_to_dict
from hpc.runtime.mesh import Mesh
from parallel.optimizer import DistributedOptimizerMixin
from parallel.tensor_parallel import tp_split_dims

COMM = "comm/"
SHARED_COMM = COMM + "steps_synchronized"
LAYOUT_AXES = ("dp", "tp", "pp", "ep")


def layout_attrs(mesh: Mesh, ep: int = 1) -> dict[str, int]:
    """The layout a checkpoint records: ``layout_<axis>`` for each of :data:`LAYOUT_AXES`."""
    return {"layout_dp": mesh.shape.dp, "layout_tp": mesh.shape.tp, "layout_pp": mesh.shape.pp, "layout_ep": ep}


def saved_layout(attrs) -> tuple[int | None, ...]:
    """The (dp, tp, pp, ep) a checkpoint was saved under; ep 1 when it predates expert parallelism."""
    values = (attrs.get(f"layout_{axis}", 1 if axis == "ep" else None) for axis in LAYOUT_AXES)
    return tuple(int(value) if value is not None else None for value in values)  # HDF5 gives numpy integers


def model_pieces(model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> list[Piece]:
    """The model's tensors (sharing its memory) as pieces of the single-device model's tensors."""
    return state.model_pieces(model, tp_split_dims(model), tp_rank, tp_size)


def state_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tp_rank: int = 0, tp_size: int = 1
) -> list[Piece]:
    return state.state_pieces(model, optimizer, tp_split_dims(model), tp_rank, tp_size)


def rank_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's private state: its RNG, and the communication state when ``optimizer`` is distributed."""
    comm = optimizer.comm_state_dict() if isinstance(optimizer, DistributedOptimizerMixin) else {}
    return {**rng_state(), **{COMM + key: value for key, value in comm.items()}}


def restore(
    step_dir: str | Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh | None = None,
    ep: int = 1,
) -> int:
    """Load a checkpoint into a freshly built model and optimizer; returns its step.

    ``mesh`` places this rank's share (its TP shards; its stages are what ``model``
    holds) and, with ``ep`` (``parallel.ep``), decides whether rank-private state applies; None
    is one process holding the whole model, which takes rank ``rank``'s private state whatever
    the saved layout.
    A distributed optimizer (``parallel.optimizer``) gets its communication state back, and under
    ZeRO (``parallel.zero``) reads only the optimizer state of the parameters this rank owns.
    """
    index = open_checkpoint(step_dir)
    tp_rank, tp_size = (mesh.index("tp"), mesh.size("tp")) if mesh else (0, 1)
    distributed = isinstance(optimizer, DistributedOptimizerMixin)
    holds = optimizer.holds_state if distributed else None
    with optimizer.parameters_allocated() if distributed else contextlib.nullcontext():  # ZeRO-3: others' dropped
        state.load_state(index, model, optimizer, tp_split_dims(model), tp_rank, tp_size, holds)
    saved, current = saved_layout(index.attrs), saved_layout(layout_attrs(mesh, ep)) if mesh else None
    same_layout = mesh is None or saved == current
    private = load_rank_state(index, rank) if same_layout else load_rank_state(index, 0, only=(SHARED_COMM,))
    if not same_layout and rank == 0:
        print(f"note: {step_dir} was saved under (dp, tp, pp, ep) = {saved}, this run is {current}: "
              "every rank starts with a fresh RNG and communication state (codec residuals, warm starts, "
              "velocities)", flush=True)
    restore_rng(private)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # where the gradients are
    comm = {key.removeprefix(COMM): value.to(device) for key, value in private.items() if key.startswith(COMM)}
    if comm and isinstance(optimizer, DistributedOptimizerMixin):
        optimizer.load_comm_state_dict(comm)
    return index.step


def weights_problem(index: CheckpointIndex, pieces: list[Piece]) -> str | None:
    """Why ``pieces`` (a model's) cannot be loaded from ``index``: a tensor missing there, or of another dtype or
    shape; None when they all can. Tensors of the checkpoint that the model lacks do not matter."""
    for piece in pieces:
        name, meta = piece.name.removeprefix("model/"), piece.meta()
        record = index.tensors.get(piece.name)
        if record is None:
            return f"this model's {name} is not in {index.path} (a checkpoint of another model?)"
        if (record.dtype, tuple(record.shape)) != (meta.dtype, meta.global_shape):
            return (f"{name} is {record.dtype}{list(record.shape)} in {index.path}, "
                    f"{meta.dtype}{list(meta.global_shape)} in this model (the [model] settings must match its run's)")
    return None


def check_init_from(spec: JobSpec, model: torch.nn.Module | None = None) -> None:
    """Before any rank starts: ``checkpoint.init_from`` names a complete checkpoint (a step directory, or a
    directory of them) that holds every tensor of this model at its shape and dtype (``model``: the spec's model
    built on the meta device, when the caller has it). Not checked when this run's own checkpoint comes first
    (``resume = "auto"`` and one is there: a requeue), as the ranks would not read it."""
    from hpc.checkpoint.discovery import find_latest, resolve_resume
    from jobs.models.protocol import build_model

    source = spec.checkpoint.init_from
    if not source or (spec.checkpoint.resume == "auto" and find_latest(spec.checkpoint_path) is not None):
        return
    if not Path(source).exists():
        raise CheckpointError(f"checkpoint.init_from={source}: no such file or directory")
    if not Path(source).is_dir():
        raise CheckpointError(f"checkpoint.init_from={source}: not a directory (a checkpoint is a step directory, "
                              "or a directory of them)")
    index = open_checkpoint(resolve_resume(source, source, key="checkpoint.init_from"))
    if model is None:
        with torch.device("meta"):
            model = build_model(spec)
    problem = weights_problem(index, model_pieces(model))
    if problem is not None:
        raise CheckpointError(f"checkpoint.init_from={source}: {problem}")


class TrainingCheckpoints:
    """What ``jobs/train/loop.py`` asks of checkpointing: resume once, save on schedule, finish writing at exit."""

    def __init__(
        self,
        spec: JobSpec,
        group: dist.ProcessGroup,
        mesh: Mesh,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.spec, self.group, self.model, self.optimizer = spec, group, model, optimizer
        self.mesh, self.rank = mesh, dist.get_rank(group)
        self.resumed_loss: float | None = None  # the resumed checkpoint's last loss, when it recorded one
        self.attrs = {**layout_attrs(mesh, spec.parallel.ep), "job_spec": json.dumps(spec_to_dict(spec))}
        cfg = spec.checkpoint
        self.checkpointer = (
            Checkpointer(spec.checkpoint_path, group, keep=cfg.keep, async_save=cfg.async_save,
                         commit_timeout_s=spec.parallel.timeout_s)
            if cfg.every_steps
            else None
        )

    def resume(self) -> int:
        """The step to start from: the resumed checkpoint's (its schedule continues), or 0 (after taking the weights
        of ``checkpoint.init_from``, if set). Rank 0 chooses, so all ranks agree."""
        path = state.choose_resume(self.spec.checkpoint.resume, self.spec.checkpoint_path, self.group)
        if path is None:
            self.init_from()
            return 0
        step = restore(path, self.rank, self.model, self.optimizer, self.mesh, self.spec.parallel.ep)
        loss = read_index(path).attrs.get("loss")
        self.resumed_loss = None if loss is None else float(loss)
        if self.rank == 0:
            print(f"resumed from {path} at step {step}", flush=True)
        return step

    def init_from(self) -> None:
        """``checkpoint.init_from``: the model's weights from another run's checkpoint (collective); the optimizer,
        RNG and communication state stay fresh and the run starts at step 0. A tensor of this model missing there,
        or of another shape or dtype, is one error, the same on every rank."""
        source = self.spec.checkpoint.init_from
        if not source:
            return
        path = state.choose_resume(source, source, self.group, key="checkpoint.init_from")
        index = open_checkpoint(path)
        pieces = model_pieces(self.model, self.mesh.index("tp"), self.mesh.size("tp"))
        problems: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, weights_problem(index, pieces), group=self.group)
        problem = next((problem for problem in problems if problem is not None), None)
        if problem is not None:
            raise CheckpointError(f"checkpoint.init_from={source}: {problem}")
        distributed = isinstance(self.optimizer, DistributedOptimizerMixin)
        with self.optimizer.parameters_allocated() if distributed else contextlib.nullcontext():  # ZeRO-3
            load_into(index, pieces)
        if self.rank == 0:
            print(f"initialized the model from {path} (checkpoint.init_from): step 0, fresh optimizer state and "
                  "learning-rate schedule", flush=True)

    def due(self, done: int, force: bool = False) -> bool:
        """A save is due when ``done`` steps are a multiple of ``every_steps``, after the last one, or when forced."""
        return self.checkpointer is not None and (
            force or done % self.spec.checkpoint.every_steps == 0 or done == self.spec.train.steps)

    def save(self, done: int, loss: float | None = None) -> None:
        pieces = state_pieces(self.model, self.optimizer, self.mesh.index("tp"), self.mesh.size("tp"))
        if isinstance(self.optimizer, DistributedOptimizerMixin):  # ZeRO-3: each parameter written by its owner
            others = {f"model/{name}" for name, p in self.model.named_parameters()
                      if not self.optimizer.holds_parameter(p)}
            pieces = [piece for piece in pieces if piece.name not in others]
        attrs = self.attrs if loss is None else {**self.attrs, "loss": loss}
        self.checkpointer.save(done, pieces, rank_state(self.optimizer), attrs)

    def finalize(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.finalize()

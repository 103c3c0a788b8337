"""The training loop's state as checkpoint pieces, and back (``LoopState``, what ``hpc.run_session`` saves and resumes).

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
``layout_pp``, ``layout_ep`` (absent before expert parallelism: 1), ``layout_nodes`` (the nodes a hierarchical
gradient exchange was cut by; absent before it: 1), ``job_spec`` (JSON) and ``loss``, the
global loss of the last step before the save (absent from older checkpoints; a resume with no steps left reports it).

The data position is the step itself: a batch is a pure function of (seed, step)
(``jobs.data.datasets.global_batch_indices``). A rank restores its own RNG and communication
state when the checkpoint was saved under the same (dp, tp, pp, ep, nodes) layout; under another one
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
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.checkpoint import Piece, state
from hpc.checkpoint.format import CheckpointError, CheckpointIndex
from hpc.checkpoint.load import load_into, load_rank_state, open_checkpoint
from hpc.config import JobSpec
from hpc.run_session import LAYOUT_AXES, RunSession, load_checkpoint, saved_layout
from hpc.runtime.mesh import Mesh
from parallel.optimizer import DistributedOptimizerMixin
from parallel.tensor_parallel import tp_split_dims

COMM = "comm/"
SHARED_COMM = COMM + "steps_synchronized"


def layout_attrs(mesh: Mesh, ep: int = 1, nodes: int = 1) -> dict[str, int]:
    """The layout a checkpoint records: ``layout_<axis>`` for each of ``hpc.run_session.LAYOUT_AXES`` (``nodes``:
    those the gradient exchange was cut by, whose shards the codec's residuals are of; 1 when flat)."""
    sizes = {"dp": mesh.shape.dp, "tp": mesh.shape.tp, "pp": mesh.shape.pp, "ep": ep, "nodes": nodes}
    return {f"layout_{axis}": sizes[axis] for axis in LAYOUT_AXES}


def model_pieces(model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> list[Piece]:
    """The model's tensors (sharing its memory) as pieces of the single-device model's tensors."""
    return state.model_pieces(model, tp_split_dims(model), tp_rank, tp_size)


def state_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tp_rank: int = 0, tp_size: int = 1
) -> list[Piece]:
    return state.state_pieces(model, optimizer, tp_split_dims(model), tp_rank, tp_size)


class LoopState:
    """This rank's share of the model and optimizer under ``mesh``, and the DP optimizer's communication
    state: the training loop's ``hpc.run_session.TrainingState``. ``mesh`` None: one process holding the whole
    model, which takes rank ``rank``'s private state whatever the saved layout."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh | None = None,
                 ep: int = 1, rank: int = 0) -> None:
        self.model, self.optimizer, self.mesh, self.ep, self.rank = model, optimizer, mesh, ep, rank
        self.tp = (mesh.index("tp"), mesh.size("tp")) if mesh else (0, 1)
        self.distributed = isinstance(optimizer, DistributedOptimizerMixin)

    def layout(self) -> dict[str, int]:
        nodes = self.optimizer.reducer.nodes if self.distributed else 1
        return layout_attrs(self.mesh, self.ep, nodes) if self.mesh else {}

    def pieces(self) -> list[Piece]:
        pieces = state_pieces(self.model, self.optimizer, *self.tp)
        if self.distributed:  # ZeRO-3: each parameter written by its owner
            others = {f"model/{name}" for name, p in self.model.named_parameters()
                      if not self.optimizer.holds_parameter(p)}
            pieces = [piece for piece in pieces if piece.name not in others]
        return pieces

    def private_state(self) -> dict[str, torch.Tensor]:
        comm = self.optimizer.comm_state_dict() if self.distributed else {}
        return {COMM + key: value for key, value in comm.items()}

    def load(self, index: CheckpointIndex, same_layout: bool) -> None:
        """The model and optimizer (under ZeRO only the optimizer state this rank owns), then the communication
        state: this rank's own under the same layout, else only the ``steps_synchronized`` all ranks share."""
        holds = self.optimizer.holds_state if self.distributed else None
        with self.allocated():  # ZeRO-3: others' parameters dropped
            state.load_state(index, self.model, self.optimizer, tp_split_dims(self.model), *self.tp, holds)
        private = load_rank_state(index, self.rank) if same_layout else load_rank_state(index, 0, only=(SHARED_COMM,))
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))  # where the gradients are
        comm = {key.removeprefix(COMM): value.to(device) for key, value in private.items() if key.startswith(COMM)}
        if comm and self.distributed:
            self.optimizer.load_comm_state_dict(comm)

    def allocated(self) -> contextlib.AbstractContextManager:
        return self.optimizer.parameters_allocated() if self.distributed else contextlib.nullcontext()


def restore(
    step_dir: str | Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh | None = None,
    ep: int = 1,
) -> int:
    """Load a checkpoint into a freshly built model and optimizer outside a run session (as a resume would:
    ``hpc.run_session.load_checkpoint``); returns its step. ``mesh``, ``ep``: as :class:`LoopState`'s."""
    index = open_checkpoint(step_dir)
    loop_state = LoopState(model, optimizer, mesh, ep, rank)
    load_checkpoint(index, loop_state, rank, mesh is None or saved_layout(index.attrs) == saved_layout(
        loop_state.layout()))
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


def init_from(spec: JobSpec, loop_state: LoopState, group: dist.ProcessGroup) -> None:
    """``checkpoint.init_from``: the model's weights from another run's checkpoint (collective); the optimizer,
    RNG and communication state stay fresh and the run starts at step 0. A tensor of this model missing there,
    or of another shape or dtype, is one error, the same on every rank."""
    source = spec.checkpoint.init_from
    if not source:
        return
    path = state.choose_resume(source, source, group, key="checkpoint.init_from")
    index = open_checkpoint(path)
    pieces = model_pieces(loop_state.model, *loop_state.tp)
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, weights_problem(index, pieces), group=group)
    problem = next((problem for problem in problems if problem is not None), None)
    if problem is not None:
        raise CheckpointError(f"checkpoint.init_from={source}: {problem}")
    with loop_state.allocated():  # ZeRO-3
        load_into(index, pieces)
    if dist.get_rank(group) == 0:
        print(f"initialized the model from {path} (checkpoint.init_from): step 0, fresh optimizer state and "
              "learning-rate schedule", flush=True)


def resume(spec: JobSpec, run: RunSession, loop_state: LoopState) -> tuple[int, float | None]:
    """Collective: (the step to start from, the loss recorded with it). The checkpoint ``checkpoint.resume`` names
    (its schedule continues), else step 0 after taking the weights of ``checkpoint.init_from``, if set."""
    if spec.checkpoint.resume == "never":  # the weights first: init_from may name a checkpoint that resume sets aside
        init_from(spec, loop_state, dist.group.WORLD)
        run.resume(loop_state, "never")
        return 0, None
    index = run.resume(loop_state, spec.checkpoint.resume)
    if index is None:
        init_from(spec, loop_state, dist.group.WORLD)
        return 0, None
    loss = index.attrs.get("loss")
    return index.step, None if loss is None else float(loss)

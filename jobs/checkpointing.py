"""The training loop's state as checkpoint pieces, and back; resume and save on schedule.

Names in the checkpoint:

- ``model/<name>``: every entry of ``model.state_dict()``, named as in the single-device
  model. A tensor-parallel shard is a piece at its offsets in the global tensor (the
  layers' ``partition_dims`` say along which dimension); under pipeline parallelism a
  rank's model holds only its stages, so it writes only their tensors. Replicas (DP
  ranks, and TP ranks for unsplit tensors) hold the same piece, which one of them writes;
- ``optim/<parameter name>/<key>``: every tensor of the optimizer's per-parameter
  state (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``), a
  tensor shaped like its parameter placed like it;
- per rank: ``rng/torch_cpu`` (the default generator, which drives dropout) and
  ``comm/<key>``: the distributed optimizer's ``comm_state_dict()``, what data-parallel
  communication carries into the next step: the reducer's error-feedback residuals
  (``comm/residual/...``) and PowerSGD's warm starts (``comm/q/...``), top-k's momentum
  velocity (``comm/velocity/...``, Deep Gradient Compression keeps SGD's momentum there
  instead of in the optimizer) and ``comm/steps_synchronized``, which decides when
  ``compression_warmup_steps`` end;
- attributes: ``layout_dp``, ``layout_tp``, ``layout_pp`` and ``job_spec`` (JSON).

The data position is the step itself: a batch is a pure function of (seed, step)
(``jobs.datasets.global_batch_indices``). A rank restores its own RNG and communication
state when the checkpoint was saved under the same (dp, tp, pp) layout; under another one
the ranks keep their fresh state, since rank r no longer holds what rank r held (its
residuals and velocities describe other buckets), except ``steps_synchronized``, which
every rank shares and which is taken from rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.checkpoint import Checkpointer, CheckpointError, Piece
from hpc.checkpoint.discovery import resolve_resume
from hpc.checkpoint.load import load_into, load_rank_state, open_checkpoint
from hpc.config import JobSpec, spec_to_dict
from hpc.runtime.mesh import Mesh
from parallel.optimizer import DistributedOptimizerMixin
from parallel.tensor_parallel import tp_split_dims

RNG = "rng/torch_cpu"
COMM = "comm/"
SHARED_COMM = COMM + "steps_synchronized"


def _placed(name: str, tensor: torch.Tensor, split_dim: int | None, tp_rank: int, tp_size: int) -> Piece:
    """``tensor`` as the piece it is of global tensor ``name``: this TP rank's block along ``split_dim``, or whole."""
    if split_dim is None:
        return Piece.whole(name, tensor)
    global_shape, offsets = list(tensor.shape), [0] * tensor.dim()
    offsets[split_dim] = tp_rank * tensor.shape[split_dim]
    global_shape[split_dim] *= tp_size
    return Piece(name, tensor, tuple(global_shape), tuple(offsets))


def model_pieces(model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> list[Piece]:
    """The model's tensors (sharing its memory) as pieces of the single-device model's tensors."""
    dims = tp_split_dims(model)
    return [_placed(f"model/{name}", tensor, dims.get(name), tp_rank, tp_size)
            for name, tensor in model.state_dict().items()]


def state_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tp_rank: int = 0, tp_size: int = 1
) -> list[Piece]:
    names = {id(p): name for name, p in model.named_parameters()}
    dims = tp_split_dims(model)
    pieces = model_pieces(model, tp_rank, tp_size)
    for param, entries in optimizer.state.items():
        name = names[id(param)]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                split = dims.get(name) if value.shape == param.shape else None
                pieces.append(_placed(f"optim/{name}/{key}", value, split, tp_rank, tp_size))
            elif value is not None:
                raise CheckpointError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
    return pieces


def rank_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's private state: its RNG, and the communication state when ``optimizer`` is distributed."""
    comm = optimizer.comm_state_dict() if isinstance(optimizer, DistributedOptimizerMixin) else {}
    return {RNG: torch.get_rng_state(), **{COMM + key: value for key, value in comm.items()}}


def restore(
    step_dir: str | Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh | None = None,
) -> int:
    """Load a checkpoint into a freshly built model and optimizer; returns its step.

    ``mesh`` places this rank's share (its TP shards; its stages are what ``model``
    holds) and decides whether rank-private state applies; None is one process holding
    the whole model, which takes rank ``rank``'s private state whatever the saved layout.
    A distributed optimizer (``parallel.optimizer``) gets its communication state back.
    """
    index = open_checkpoint(step_dir)
    tp_rank, tp_size = (mesh.index("tp"), mesh.size("tp")) if mesh else (0, 1)
    load_into(index, model_pieces(model, tp_rank, tp_size))
    names = {id(p): name for name, p in model.named_parameters()}
    dims = tp_split_dims(model)
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    pieces = []
    for position, param in enumerate(ordered):
        name = names[id(param)]
        param_shape = _placed(name, param, dims.get(name), tp_rank, tp_size).global_shape
        prefix = f"optim/{name}/"
        for stored in (record for key, record in index.tensors.items() if key.startswith(prefix)):
            like_param = tuple(stored.shape) == param_shape
            tensor = torch.empty(param.shape if like_param else stored.shape, dtype=getattr(torch, stored.dtype))
            pieces.append(_placed(stored.name, tensor, dims.get(name) if like_param else None, tp_rank, tp_size))
            state.setdefault(position, {})[stored.name.removeprefix(prefix)] = tensor
    load_into(index, pieces)
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    saved_layout = tuple(index.attrs.get(f"layout_{axis}") for axis in ("dp", "tp", "pp"))
    same_layout = mesh is None or saved_layout == (mesh.shape.dp, mesh.shape.tp, mesh.shape.pp)
    private = load_rank_state(index, rank) if same_layout else load_rank_state(index, 0, only=(SHARED_COMM,))
    if RNG in private:
        torch.set_rng_state(private[RNG])
    comm = {key.removeprefix(COMM): value for key, value in private.items() if key.startswith(COMM)}
    if comm and isinstance(optimizer, DistributedOptimizerMixin):
        optimizer.load_comm_state_dict(comm)
    return index.step


class TrainingCheckpoints:
    """What ``jobs/train.py`` asks of checkpointing: resume once, save on schedule, finish writing at exit."""

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
        self.attrs = {
            "layout_dp": mesh.shape.dp, "layout_tp": mesh.shape.tp, "layout_pp": mesh.shape.pp,
            "job_spec": json.dumps(spec_to_dict(spec)),
        }
        cfg = spec.checkpoint
        self.checkpointer = (
            Checkpointer(spec.checkpoint_path, group, keep=cfg.keep, async_save=cfg.async_save,
                         commit_timeout_s=spec.parallel.timeout_s)
            if cfg.every_steps
            else None
        )

    def resume(self) -> int:
        """The step to start from: the resumed checkpoint's, or 0. Rank 0 chooses, so all ranks agree."""
        choice: list[tuple[str | None, str | None]] = [(None, None)]
        if self.rank == 0:
            try:
                path = resolve_resume(self.spec.checkpoint.resume, self.spec.checkpoint_path)
                choice = [(str(path) if path else None, None)]
            except CheckpointError as exc:
                choice = [(None, str(exc))]
        dist.broadcast_object_list(choice, group=self.group, group_src=0)
        path, error = choice[0]
        if error is not None:
            raise CheckpointError(error)
        if path is None:
            return 0
        step = restore(path, self.rank, self.model, self.optimizer, self.mesh)
        if self.rank == 0:
            print(f"resumed from {path} at step {step}", flush=True)
        return step

    def due(self, done: int, force: bool = False) -> bool:
        """A save is due when ``done`` steps are a multiple of ``every_steps``, after the last one, or when forced."""
        return self.checkpointer is not None and (
            force or done % self.spec.checkpoint.every_steps == 0 or done == self.spec.train.steps)

    def save(self, done: int) -> None:
        pieces = state_pieces(self.model, self.optimizer, self.mesh.index("tp"), self.mesh.size("tp"))
        self.checkpointer.save(done, pieces, rank_state(self.optimizer), self.attrs)

    def finalize(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.finalize()

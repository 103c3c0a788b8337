"""A model and its optimizer as checkpoint pieces, and back: what the training loop and user scripts save.

Names in the checkpoint:

- ``model/<name>``: every entry of ``model.state_dict()``, named as in the single-device
  model, a tensor held under two names (tied weights) once, under its first. A tensor-parallel
  shard is a piece at its offsets in the global tensor: the caller passes ``split_dims``
  (state-dict name -> the dimension split over the TP group) and this rank's ``tp_rank`` of
  ``tp_size``; without them every tensor is whole. Replicas (DP ranks, TP ranks for unsplit
  tensors, the two pipeline stages holding a copy of a tied weight) hold the same piece, which
  one of them writes;
- ``optim/<parameter name>/<key>``: every tensor of the optimizer's per-parameter state
  (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``); one shaped like
  its parameter is placed like it;
- per rank, ``rng/torch_cpu`` (:data:`RNG`): the default generator, which drives dropout on the CPU;
  and ``rng/torch_cuda`` (:data:`CUDA_RNG`) once this process has used CUDA: the current GPU's
  generator, which drives dropout there. A resume restores it only where CUDA is available (a CPU
  resume of a GPU checkpoint ignores it; a GPU resume of a CPU checkpoint keeps the seeded one).

Every tensor loads onto the device of the tensor it is copied into: parameters in place,
optimizer state created on its parameter's device (``step`` on the CPU, where torch keeps
it), so a checkpoint saved on GPUs loads on CPUs and back.

Nothing here knows about tensor-parallel layers (``parallel/``) or a job spec (``jobs/``):
``jobs/train/checkpointing.py`` passes the TP split of its layers, ``hpc/script.py`` none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.checkpoint.discovery import resolve_resume, set_aside
from hpc.checkpoint.format import CheckpointError, CheckpointIndex
from hpc.checkpoint.load import load_into, torch_dtype
from hpc.checkpoint.pieces import Piece

RNG = "rng/torch_cpu"
CUDA_RNG = "rng/torch_cuda"
NO_SPLIT: Mapping[str, int] = {}


def placed(name: str, tensor: torch.Tensor, split_dim: int | None, tp_rank: int, tp_size: int) -> Piece:
    """``tensor`` as the piece it is of global tensor ``name``: this TP rank's block along ``split_dim``, or whole."""
    if split_dim is None:
        return Piece.whole(name, tensor)
    global_shape, offsets = list(tensor.shape), [0] * tensor.dim()
    offsets[split_dim] = tp_rank * tensor.shape[split_dim]
    global_shape[split_dim] *= tp_size
    return Piece(name, tensor, tuple(global_shape), tuple(offsets))


def model_pieces(
    model: torch.nn.Module, split_dims: Mapping[str, int] = NO_SPLIT, tp_rank: int = 0, tp_size: int = 1
) -> list[Piece]:
    """The model's tensors (sharing its memory) as pieces of the single-device model's tensors; a tensor held
    under several names (tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``) once, under the
    first, as transformers saves it (loading it fills every module holding it)."""
    pieces, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            pieces.append(placed(f"model/{name}", tensor.detach(), split_dims.get(name), tp_rank, tp_size))
    return pieces


def state_pieces(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    split_dims: Mapping[str, int] = NO_SPLIT,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[Piece]:
    """The model's pieces and every tensor of the optimizer's per-parameter state."""
    names = {id(p): name for name, p in model.named_parameters()}
    pieces = model_pieces(model, split_dims, tp_rank, tp_size)
    for param, entries in optimizer.state.items():
        name = names[id(param)]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                split = split_dims.get(name) if value.shape == param.shape else None
                pieces.append(placed(f"optim/{name}/{key}", value, split, tp_rank, tp_size))
            elif value is not None:
                raise CheckpointError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
    return pieces


def load_state(
    index: CheckpointIndex,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    split_dims: Mapping[str, int] = NO_SPLIT,
    tp_rank: int = 0,
    tp_size: int = 1,
    holds: Callable[[torch.Tensor], bool] | None = None,
) -> None:
    """Load a checkpoint's model and optimizer tensors into a freshly built ``model`` and ``optimizer``,
    each rank reading the blocks its own (tp_rank, tp_size) holds, whatever layout saved them; the optimizer
    state only of the parameters ``holds`` accepts (a rank owning a share of it, ZeRO), all when None."""
    load_into(index, model_pieces(model, split_dims, tp_rank, tp_size))
    names = {id(p): name for name, p in model.named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    pieces = []
    for position, param in enumerate(ordered):
        if holds is not None and not holds(param):
            continue
        name = names[id(param)]
        param_shape = placed(name, param, split_dims.get(name), tp_rank, tp_size).global_shape
        prefix = f"optim/{name}/"
        for stored in (record for key, record in index.tensors.items() if key.startswith(prefix)):
            like_param = tuple(stored.shape) == param_shape
            on_param = like_param and stored.name != f"{prefix}step"  # torch keeps step counts on the CPU
            tensor = torch.empty(param.shape if like_param else stored.shape, dtype=torch_dtype(stored.dtype),
                                 device=param.device if on_param else "cpu")
            pieces.append(placed(stored.name, tensor, split_dims.get(name) if like_param else None, tp_rank, tp_size))
            state.setdefault(position, {})[stored.name.removeprefix(prefix)] = tensor
    load_into(index, pieces)
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random generators as rank state: the CPU's, and the current GPU's once CUDA is in use."""
    state = {RNG: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[CUDA_RNG] = torch.cuda.get_rng_state()
    return state


def restore_rng(private: Mapping[str, torch.Tensor]) -> None:
    """Set the generators :func:`rng_state` saved, of those in ``private``; the GPU's only where CUDA is."""
    if RNG in private:
        torch.set_rng_state(private[RNG])
    if CUDA_RNG in private and torch.cuda.is_available():
        torch.cuda.set_rng_state(private[CUDA_RNG])


def choose_resume(resume: str, root: str | Path, group: dist.ProcessGroup,
                  key: str = "checkpoint.resume") -> Path | None:
    """Collective: the checkpoint every rank of ``group`` resumes from (``checkpoint.resume``: 'never', 'auto'
    or a path; see :func:`resolve_resume`, whose errors name ``key``), or None. Rank 0 looks, so all ranks agree
    even while a save lands."""
    choice: list[tuple[str | None, str | None]] = [(None, None)]
    if dist.get_rank(group) == 0:
        try:
            path = resolve_resume(resume, root, key)
            aside = set_aside(root) if resume == "never" else None
            if aside is not None:
                print(f"note: checkpoint.resume=never: this run starts over; the checkpoints already in {root} are "
                      f"now in {aside}", flush=True)
            choice = [(str(path) if path else None, None)]
        except CheckpointError as exc:
            choice = [(None, str(exc))]
    dist.broadcast_object_list(choice, group=group, group_src=0)
    path, error = choice[0]
    if error is not None:
        raise CheckpointError(error)
    return Path(path) if path is not None else None

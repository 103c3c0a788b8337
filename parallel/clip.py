"""Global gradient-norm clipping for a model split over tensor- and pipeline-parallel ranks.

The norm must be the single-device model's. Each rank adds up the squares of the
gradients only it holds: its TP shards, and the tensors replicated over the TP group
(LayerNorms, row-parallel biases) on one of their holders only. The sum is all-reduced
over the groups whose ranks hold different parts of the model, TP and PP; DP replicas
hold identical gradients once reduced, so they are left out, except under ZeRO stage 2,
where each DP replica holds only its own parameters' gradients: the caller then counts
those and passes the DP group too (``jobs/train/loop.py``). Every rank then scales by
the same factor. The local arithmetic is torch's own (``get_total_norm``,
``clip_grads_with_norm_``), so a single process clips exactly as ``clip_grad_norm_``.

Given one of torch's fused Adam/AdamW optimizers (what the trainer builds on a GPU), the factor goes
into the optimizer's ``grad_scale`` instead, which its one kernel divides every gradient by as it
reads it (GradScaler's hook): that saves a pass reading and writing every gradient, 8 bytes a
float32 parameter, about 1.5 ms a step of a 0.7B model on an H200, for a result within a rounding
of the multiplication's (a division by the factor's reciprocal).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    counted: Iterable[torch.Tensor],
    groups: Sequence[ProcessGroup] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Scale this rank's gradients so the global 2-norm is at most ``max_norm``; returns the norm before.

    ``counted`` are the parameters whose gradients this rank contributes to the norm
    (each part of the model counted by exactly one rank across ``groups``); all of
    ``parameters`` are scaled. Collective over each group of ``groups`` with more than one rank. The norm
    comes back as a 0-dim tensor on the gradients' device: reading it (``float``) is the caller's host
    synchronization, which a training step takes once, at its end. When ``optimizer`` takes a gradient
    scale (``takes_clip_scale``), the gradients are left as they are and the factor waits in its
    ``grad_scale`` for its next step, which must run inside ``scaled_step(optimizer)``.
    """
    parameters = list(parameters)
    grads = [p.grad for p in counted if p.grad is not None]
    device = parameters[0].device if parameters else None
    local = get_total_norm(grads) if grads else torch.zeros((), device=device)
    shared = [group for group in groups if dist.get_world_size(group) > 1]
    if shared:
        squares = local.double().square()
        for group in shared:
            dist.all_reduce(squares, group=group)
        total = squares.sqrt().to(local.dtype)
    else:
        total = local
    if not math.isfinite(max_norm):  # inf: measure the norm only (for metrics)
        return total.detach()
    if takes_clip_scale(optimizer):
        factor = torch.clamp(max_norm / (total.detach() + 1e-6), max=1.0)  # clip_grads_with_norm_'s
        optimizer.grad_scale = factor.reciprocal().float()
    else:
        clip_grads_with_norm_(parameters, max_norm, total)
    return total.detach()


def takes_clip_scale(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` is one of torch's fused Adam/AdamW, every group fused, with no gradient scale of
    its own (a GradScaler's). The fused step moves the scale to each of its parameters' devices itself."""
    return (isinstance(optimizer, torch.optim.Adam) and getattr(optimizer, "grad_scale", None) is None
            and all(group.get("fused") for group in optimizer.param_groups))


@contextlib.contextmanager
def scaled_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer step that applies a clip factor ``clip_grad_norm_`` left in ``grad_scale``, then
    takes it away, so that no later step divides by it again."""
    try:
        yield
    finally:
        optimizer.__dict__.pop("grad_scale", None)

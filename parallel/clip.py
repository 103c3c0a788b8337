"""Global gradient-norm clipping for a model split over tensor- and pipeline-parallel ranks.

The norm must be the single-device model's. Each rank adds up the squares of the
gradients only it holds: its TP shards, and the tensors replicated over the TP group
(LayerNorms, row-parallel biases) on one of their holders only. The sum is all-reduced
over the groups whose ranks hold different parts of the model, TP and PP; DP replicas
hold identical gradients once reduced, so they are left out, except under ZeRO stage 2,
where each DP replica holds only its own parameters' gradients: the caller then counts
those and passes the DP group too (``jobs/train.py``). Every rank then scales by
the same factor. The local arithmetic is torch's own (``get_total_norm``,
``clip_grads_with_norm_``), so a single process clips exactly as ``clip_grad_norm_``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

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
) -> torch.Tensor:
    """Scale this rank's gradients so the global 2-norm is at most ``max_norm``; returns the norm before.

    ``counted`` are the parameters whose gradients this rank contributes to the norm
    (each part of the model counted by exactly one rank across ``groups``); all of
    ``parameters`` are scaled. Collective over each group of ``groups`` with more than one rank. The norm
    comes back as a 0-dim tensor on the gradients' device: reading it (``float``) is the caller's host
    synchronization, which a training step takes once, at its end.
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
    if math.isfinite(max_norm):  # inf: measure the norm only (for metrics)
        clip_grads_with_norm_(parameters, max_norm, total)
    return total.detach()

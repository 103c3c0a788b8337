"""Data parallelism: average gradients over the data-parallel group after backward.

All gradients go through one flat buffer and one all-reduce: fewer, larger
messages are what a ring (and Gloo's TCP) needs to reach its bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def average_gradients(parameters: Iterable[torch.nn.Parameter], group: ProcessGroup) -> None:
    grads = [p.grad for p in parameters if p.grad is not None]
    size = dist.get_world_size(group)
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()

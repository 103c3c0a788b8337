"""Data parallelism: average gradients over the data-parallel group after backward.

All gradients go through one flat buffer and one ring all-reduce: fewer, larger
messages are what a ring needs to reach its bandwidth. With a lossy codec the
error each step's compression makes is fed back into the next step's gradients.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from parallel.compression import Codec, ErrorFeedback
from parallel.ring import IDENTITY, Transport, ring_allreduce


def average_gradients(
    parameters: Iterable[torch.nn.Parameter],
    transport: Transport,
    codec: Codec = IDENTITY,
    feedback: ErrorFeedback | None = None,
) -> None:
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    error = None
    if feedback is not None and codec.lossy:
        feedback.compensate("gradients", flat)
        error = torch.zeros_like(flat)
    ring_allreduce(flat, transport, codec=codec, average=True, error=error)
    if error is not None:
        feedback.store("gradients", error)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()

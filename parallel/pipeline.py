"""Run one rank's share of a pipeline schedule (``parallel.schedule``) with real messages.

Each rank holds v chunk modules; chunk k runs global stage k*p + rank. Forward keeps,
per microbatch and stage, the stage input (made a leaf that requires grad, so backward
leaves its gradient in ``.grad`` to send upstream) and the output; backward calls
``torch.autograd.backward(output, grad)``. The last stage turns its output into
``loss_fn(output, target) / m``, so the gradients accumulated over the m microbatches
equal the full-batch gradient of a mean loss: the caller zeroes grads before the step
and runs its optimizer after it.

Every tensor crossing a stage boundary has the same ``activation_shape`` and dtype, given
per call (true of stacks of equal blocks, which is what we cut into stages), so a
receive allocates its buffer without a shape exchange. Messages travel through a
``parallel.ring`` transport of the pipeline group (torch.distributed by default, or MPI),
tagged by the message they carry, posted as ``schedule.ticks`` says: after each tick's computes,
one batch of the sends of their outputs and the receives of the next tick's inputs (one
``batch_isend_irecv`` launch where the backend coalesces, NCCL; Megatron's batched
point-to-point). That order is the one ``schedule.lockstep_deadlock`` proves NCCL moves: each
rank's batches in order on one queue, messages matched in order, not by tag. A compute waits
only for its own input; sends are awaited at the end of the step. Nothing is copied: a stage's
output and its input's gradient are sent as they are, received buffers become the next
stage's input or output gradient. We drive torch.distributed point-to-point
ourselves instead of torch.distributed.pipelining so that the schedule executed is
exactly the inspectable, simulated one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hpc.errors import LayoutError
from hpc.observe.probe import Probe
from hpc.observe.stopwatch import Stopwatch
from hpc.runtime.placement import Pending
from parallel.schedule import Action, Message, stage_bounds, ticks
from parallel.transport import PointToPoint, TorchTransport, Transport


@dataclass(frozen=True)
class StepStats:
    """One rank's step. The loss and the times stay on the device until read (``hpc/observe/stopwatch.py``):
    reading them after the caller's host synchronization costs none."""

    loss_sum: torch.Tensor | None  # the microbatches' mean loss on the rank of the last stage (0-dim); else None
    forward: Stopwatch  # inside forward compute (loss included)
    backward: Stopwatch  # inside backward compute
    wall: Stopwatch  # from the call until every send of this rank completed
    peak_activation_bytes: int  # most bytes held for backward at once (see _forward_keeping)

    @property
    def loss(self) -> float | None:
        return None if self.loss_sum is None else float(self.loss_sum)

    @property
    def forward_s(self) -> float:
        return self.forward.seconds()

    @property
    def backward_s(self) -> float:
        return self.backward.seconds()

    @property
    def wall_s(self) -> float:
        return self.wall.seconds()

    @property
    def wait_s(self) -> float:
        """What the rank spent neither computing nor queuing: waiting for messages (the bubble included)."""
        return max(0.0, self.wall_s - self.forward_s - self.backward_s)


def split_into_stages(layers: Sequence[nn.Module], p: int, v: int = 1) -> list[list[nn.Sequential]]:
    """Cut the blocks into p*v contiguous chunks; ``result[rank][k]`` is chunk k*p + rank (Megatron's order)."""
    chunks = [nn.Sequential(*layers[start:stop]) for start, stop in stage_bounds(len(layers), p, v)]
    return [chunks[rank::p] for rank in range(p)]


def message_tag(message: Message, num_stages: int) -> int:
    """A tag unique to the message within a step, so receives never depend on arrival order."""
    return (message.microbatch * num_stages + message.stage) * 2 + (message.direction == "B")


def run_pipeline_step(
    actions: Sequence[Action],
    chunks: Sequence[nn.Module],
    group: ProcessGroup,
    *,
    activation_shape: Sequence[int],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: Sequence[torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    probe: Probe | None = None,
    transport: Transport | None = None,
) -> StepStats:
    """Run this rank's actions once: forward and backward of every microbatch, grads accumulated.

    ``inputs`` (one tensor per microbatch) are needed on rank 0, ``targets`` on the rank of
    the last stage (p-1). The group's size is the number of pipeline ranks. The loss comes
    back on the last stage's rank only, None elsewhere: sharing it costs a collective that
    only the caller knows whether it needs. ``probe`` sees every compute, send and receive wait
    (timeline, stall inspector). ``transport`` carries the messages, over ``group``
    (default: torch.distributed's point-to-point).
    """
    step = _Step(actions, chunks, group, tuple(activation_shape), loss_fn, inputs, targets,
                 dtype or torch.float32, device, probe or Probe(), transport or TorchTransport(group))
    return step.run()


class _Step:
    """One rank during one step: messages posted and in hand, activations kept for backward."""

    def __init__(
        self, actions, chunks, group, activation_shape, loss_fn, inputs, targets, dtype, device, probe, transport,
    ) -> None:
        self.actions, self.chunks, self.group, self.probe, self.transport = actions, chunks, group, probe, transport
        self.activation_shape, self.loss_fn, self.inputs, self.targets = activation_shape, loss_fn, inputs, targets
        self.dtype, self.device = dtype, torch.device(device)
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.num_stages = self.p * len(chunks)
        self.m = 1 + max(action.microbatch for action in actions)
        self.buffers: dict[Message, torch.Tensor] = {}  # receive buffers of the messages in self.posted
        self.posted: dict[Message, tuple[Pending, int]] = {}  # message -> pending irecv, its sender
        self.inbox: dict[Message, torch.Tensor] = {}  # received or handed over, not yet consumed
        self.outbox: dict[Message, torch.Tensor] = {}  # computed, not yet sent
        self.stash: dict[tuple[int, int], tuple] = {}  # (microbatch, stage) -> (input, output, bytes kept)
        self.sends, self.losses = [], []
        self.held = self.peak = 0
        self.forward, self.backward = Stopwatch(self.device), Stopwatch(self.device)

    def run(self) -> StepStats:
        wall = Stopwatch(self.device)
        started = wall.mark()
        computes = {"F": ("forward", self._forward), "B": ("backward", self._backward)}
        for tick in ticks(self.actions):
            for action in tick.computes:
                self._await_input(action)
                name, compute = computes[action.kind]
                with self.probe.span(name, microbatch=action.microbatch, stage=action.stage):
                    compute(action)
            self._post(tick.posts)
        with self.probe.span("wait for sends", "wait"):
            for pending in self.sends:
                pending.wait()
        wall.add(started)
        loss = sum(self.losses) if self.losses else None  # a device scalar: no synchronization here
        return StepStats(loss, self.forward, self.backward, wall, self.peak)

    def _post(self, actions: Sequence[Action]) -> None:
        """The tick's sends and the next tick's receives as one batch (one launch where the backend coalesces)."""
        if not actions:
            return
        ops = []
        for action in actions:
            message, tag = action.message, message_tag(action.message, self.num_stages)
            if action.kind in ("SEND_F", "SEND_B"):
                ops.append(PointToPoint(True, self.outbox.pop(message), action.peer, tag))
                self.probe.sent(f"send {message.direction} mb{message.microbatch} stage{message.stage}",
                                self._link(self.rank, action.peer))
            else:
                self.buffers[message] = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                ops.append(PointToPoint(False, self.buffers[message], action.peer, tag))
        for action, work in zip(actions, self.transport.post(ops), strict=True):
            if action.kind in ("SEND_F", "SEND_B"):
                self.sends.append(work)
            else:
                self.posted[action.message] = (work, action.peer)

    def _link(self, src: int, dst: int) -> str:
        """The stall inspector's channel for messages from pipeline rank src to dst."""
        return f"p2p:{self.global_ranks[src]}>{self.global_ranks[dst]}"

    def _await_input(self, action: Action) -> None:
        """Wait for the message this compute consumes, when one is on its way."""
        stage = action.stage
        message = Message(action.kind, action.microbatch, stage)
        if message not in self.posted:
            return
        pending, peer = self.posted.pop(message)
        with self.probe.collective(f"recv {message.direction} mb{message.microbatch} stage{message.stage}",
                                   self._link(peer, self.rank), [self.global_ranks[peer]]):
            pending.wait()
        self.inbox[message] = self.buffers.pop(message)

    def _deliver(self, message: Message, tensor: torch.Tensor) -> None:
        """Output of a compute: to the network, or straight to the next stage when it is ours (p == 1)."""
        (self.inbox if self.p == 1 else self.outbox)[message] = tensor

    def _forward(self, action: Action) -> None:
        tick = self.forward.mark()
        mb, stage = action.microbatch, action.stage
        x = self.inputs[mb] if stage == 0 else self.inbox.pop(Message("F", mb, stage)).requires_grad_()
        chunk = self.chunks[stage // self.p]
        external = [*chunk.parameters(), *([x] if stage == 0 else [])]
        if stage == self.num_stages - 1:
            target = self.targets[mb]
            external.append(target)
            out, nbytes = _forward_keeping(lambda t: self.loss_fn(chunk(t), target) / self.m, x, external)
            self.losses.append(out.detach())
        else:
            out, nbytes = _forward_keeping(chunk, x, external)
            if tuple(out.shape) != self.activation_shape or out.dtype != self.dtype:
                raise LayoutError(
                    f"stage {stage} produced {tuple(out.shape)} {out.dtype}, but activation_shape is "
                    f"{self.activation_shape} {self.dtype}", rank=self.rank, microbatch=mb,
                )
            self._deliver(Message("F", mb, stage + 1), out.detach().contiguous())
        self.stash[mb, stage] = (x, out, nbytes)
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        self.forward.add(tick)

    def _backward(self, action: Action) -> None:
        tick = self.backward.mark()
        mb, stage = action.microbatch, action.stage
        x, out, nbytes = self.stash.pop((mb, stage))
        grad = None if stage == self.num_stages - 1 else self.inbox.pop(Message("B", mb, stage))
        if out.requires_grad:  # not: a first stage whose parameters are all frozen, with nothing to differentiate
            torch.autograd.backward(out, grad)
        self.held -= nbytes
        if stage > 0:
            self._deliver(Message("B", mb, stage - 1), x.grad)
        self.backward.add(tick)


def _forward_keeping(
    fn: Callable, x: torch.Tensor, external: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """``fn(x)`` and the bytes of activations this microbatch keeps alive until its backward:
    every tensor autograd saves, plus input and output, each counted once; ``external`` ones
    (parameters, the caller's inputs and targets) are left out, as they exist whatever the schedule."""
    skip = {tensor.data_ptr() for tensor in external}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> None:
        if tensor.data_ptr() not in skip:
            kept[tensor.data_ptr()] = max(kept.get(tensor.data_ptr(), 0), tensor.nbytes)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        keep(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(x)
    keep(x)
    keep(out)
    return out, sum(kept.values())

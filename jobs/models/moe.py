"""A mixture-of-experts feed-forward: a top-k router, per-sequence expert capacity, Switch load balancing.

Each token's router picks ``top_k`` experts (k = 1: Switch Transformer; k = 2: GShard,
the two gates renormalized to sum to one). Capacity is counted per sequence, GShard's
"group": an expert takes at most ``ceil(capacity_factor * top_k * seq_len / n_experts)``
tokens of a sequence, first choices before second choices, earlier tokens first; the
others are dropped (their residual carries them unchanged). Counting per sequence makes
the kept set a pure function of each sequence, so it is the same whether the batch is
split over data-parallel ranks, microbatches or neither: a single process drops exactly
what any layout drops.

The auxiliary losses (Switch's ``E * sum_e f_e P_e``, optionally ST-MoE's router
z-loss) are means over sequences too, so a split batch adds up to the whole one. They
join the training loss where they are made, on whatever pipeline stage holds the
layer: ``AttachAuxLoss`` passes the activation through and, in backward, sends the
aux loss its gradient (Megatron's MoEAuxLossAutoScaler); ``loss_scale`` is ``1 /
microbatches`` so it matches the pipeline's ``loss / m``.

Experts run through ``parallel.ep.run_experts``: all of them here, or, once
``jobs.train.parallelize.parallelize_ep`` has sharded them over an expert-parallel group, this
rank's share, the tokens sent to their experts and back by all-to-all. A layer reads the device from the
host once, its kept choices per expert (the rows each expert takes size everything after; on a GPU one
synchronization), instead of a ``nonzero`` and two ``bincount``s each with a read of its own. Experts are an
``nn.ModuleList``, so their parameters keep their single-device names
(``...experts.<global index>...``) under every layout and checkpoints reshard by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parallel.ep import ExpertPlacement, run_experts


@dataclass(frozen=True)
class Routing:
    """Each token's ``top_k`` choices: ``[batch, time, k]`` each."""

    expert: torch.Tensor  # int64 expert index
    gate: torch.Tensor  # the weight of that expert's output (differentiable)
    kept: torch.Tensor  # bool: within the expert's capacity for this sequence


def capacity(seq_len: int, n_experts: int, top_k: int, factor: float) -> int:
    """Slots per expert and sequence."""
    return max(1, math.ceil(factor * top_k * seq_len / n_experts))


def one_hot(index: torch.Tensor, n: int) -> torch.Tensor:
    """``F.one_hot(index, n)`` (int64) without its range check, which reads the indices' minimum and maximum
    on the host: on a GPU a synchronization per call. Router indices come from ``topk``, always in range."""
    return (index.unsqueeze(-1) == torch.arange(n, device=index.device)).long()


def assign_slots(expert: torch.Tensor, n_experts: int, slots: int) -> torch.Tensor:
    """Which choices ``expert`` ``[batch, time, k]`` keep: each sequence fills each expert's ``slots``
    first come, first served, all first choices in token order, then all second choices."""
    batch, time, k = expert.shape
    order = expert.transpose(1, 2).reshape(batch, k * time)  # choice-major
    onehot = one_hot(order, n_experts)
    position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # how many earlier claims on the same expert
    return (position < slots).view(batch, k, time).transpose(1, 2)


def route(logits: torch.Tensor, top_k: int, slots: int) -> tuple[Routing, torch.Tensor]:
    """The routing of router ``logits`` ``[batch, time, experts]``, and the router probabilities."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, expert = probs.topk(top_k, dim=-1)
    gate = top / top.sum(-1, keepdim=True) if top_k > 1 else top
    return Routing(expert, gate, assign_slots(expert, logits.shape[-1], slots)), probs


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's ``E * sum_e f_e P_e`` (f: the share of first choices, P: the mean probability),
    per sequence, averaged over sequences; 1 when the load is uniform."""
    n_experts = probs.shape[-1]
    share = one_hot(first_choice, n_experts).to(probs.dtype).mean(1)
    return (n_experts * (share * probs.mean(1)).sum(-1)).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's mean squared log-partition: keeps router logits small."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class AttachAuxLoss(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s gradient, and ``scale`` into ``aux``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_dtype, ctx.aux_device = scale, aux.dtype, aux.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # made on the device (a fill), not copied there from the host: on a GPU that copy would wait for the stream
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


class MoE(nn.Module):
    """A feed-forward of ``n_experts`` experts (``make_expert()`` each), ``[batch, time, d]`` to the same."""

    def __init__(self, d_model: int, n_experts: int, make_expert: Callable[[], nn.Module], top_k: int = 1,
                 capacity_factor: float = 1.25, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(n_experts))
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.placement = ExpertPlacement(n_experts)  # all experts here until parallelize_ep shards them
        self.loss_scale = 1.0  # 1 / microbatches under the pipeline executor
        self.stats = MoEStats(n_experts)
        self.last_kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time = x.shape[1]
        logits = self.router(x)
        routing, probs = route(logits, self.top_k, capacity(time, self.n_experts, self.top_k, self.capacity_factor))
        y, counts = self._dispatch(x, routing)
        if not self.training:
            return y
        aux = load_balancing_loss(probs, routing.expert[..., 0])
        self._record(counts, routing.kept, aux)
        total = self.aux_loss_coef * aux
        if self.z_loss_coef:
            total = total + self.z_loss_coef * router_z_loss(logits)
        return AttachAuxLoss.apply(y, total, self.loss_scale) if total.requires_grad else y

    @torch.compiler.disable
    def _dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept choices through their experts and back, weighted by their gates: ``[batch, time, d]``, and
        the kept choices per expert. Eager inside a compiled block: the counts read on the host size everything
        here, and a graph of it would recompile for each new set of sizes (until Dynamo gives up on the block)."""
        batch, time, width = x.shape
        k, n_experts = self.top_k, self.n_experts
        flat_expert, kept = routing.expert.reshape(-1), routing.kept.reshape(-1)
        counts = flat_expert.new_zeros(n_experts).index_add_(0, flat_expert, kept.long())  # kept choices per expert
        # the layer's one host read (on a GPU a synchronization): how many rows each expert takes decides the
        # shapes of what follows; the rest is sized by it, not by reads of its own (nonzero, bincount)
        sizes = counts.tolist()
        # kept (token * k + choice), by expert, then token: a stable sort with the dropped ones last
        picks = torch.argsort(torch.where(kept, flat_expert, n_experts), stable=True)[:sum(sizes)]
        outputs = run_experts(x.reshape(-1, width)[picks // k], counts, sizes, self.experts, self.placement,
                              self._rows_bound(batch, time))
        weighted = outputs * routing.gate.reshape(-1)[picks].unsqueeze(1).to(outputs.dtype)
        combined = weighted.new_zeros(batch * time * k, width).index_copy(0, picks, weighted)
        return combined.view(batch, time, k, width).sum(2), counts

    @torch.compiler.disable
    def _record(self, counts: torch.Tensor, kept: torch.Tensor, aux: torch.Tensor) -> None:
        """A training forward's statistics, not a recomputation's inside backward (activation checkpointing)."""
        if torch._C._current_graph_task_id() == -1:
            self.stats.add(counts, kept.numel(), aux.detach())
            self.last_kept = kept.detach()  # which choices the last training forward kept (for tests)

    def _rows_bound(self, batch: int, time: int) -> int | None:
        """The most rows any rank can send any peer, when every rank of the EP group routes ``batch`` sequences
        (training under the trainer: equal shards and microbatches); None otherwise (evaluation)."""
        if not (self.training and batch == self.placement.sequences):
            return None
        slots = capacity(time, self.n_experts, self.top_k, self.capacity_factor)
        return min(batch * time * self.top_k, self.placement.local * slots * batch)


class MoEStats:
    """What a layer routed since the last ``reset()``: kept tokens per expert, choices routed, aux loss."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        self.tokens: torch.Tensor | None = None  # on the device of the routed tokens: no host sync per forward
        self.aux_sum: torch.Tensor | float = 0.0
        self.routed, self.calls = 0.0, 0.0

    def add(self, counts: torch.Tensor, routed: int, aux: torch.Tensor) -> None:
        """One forward's kept choices per expert (on the device), ``routed`` choices, aux loss."""
        counts = counts.double()
        self.tokens = counts if self.tokens is None else self.tokens + counts
        self.routed += routed
        self.aux_sum = aux.detach().double() + self.aux_sum
        self.calls += 1

    def vector(self, device: torch.device) -> torch.Tensor:
        """``[kept tokens per expert..., dropped, routed, aux sum, forward calls]`` in float64 on ``device``, made
        there without reading it (the host reads the run's numbers once a step, after the step)."""
        row = torch.zeros(self.n_experts + 4, dtype=torch.float64, device=device)
        if self.tokens is not None:
            row[:-4] = self.tokens
        row[-4] = self.routed - row[:-4].sum()
        # fills and a device copy: a Python number assigned to an element would be a host-to-device copy
        # that waits for the device (``row[-1] = x`` makes ``x`` a CPU tensor and copies it)
        row[-3].fill_(self.routed)
        row[-1].fill_(self.calls)
        if isinstance(self.aux_sum, torch.Tensor):
            row[-2].copy_(self.aux_sum)
        return row


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The model's MoE layers with their names, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts this rank holds (not the routers: those are dense, replicated over DP)."""
    return [param for _, layer in moe_layers(model) for param in layer.experts.parameters()]

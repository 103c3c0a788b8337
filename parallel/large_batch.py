"""LARS and LAMB: layer-wise trust ratios, so large global batches train; norms over whole layers under TP.

Why: at a large batch one learning rate for every layer diverges wherever a layer's
update is large against its weights. LARS (You et al. 2017) and LAMB (You et al. 2019)
scale each layer's step by a trust ratio ||w|| / ||update||. The ratio must be the
single-device layer's: a layer split over tensor-parallel ranks holds only a shard, and
shard norms would give each rank a different ratio, so the TP run would drift from the
single-device one. The squared norms of the split parameters (``split``: those named by
the layers' ``partition_dims``) are summed in one all-reduce of a few floats per step
over the TP group (``group``, explicit), never a gather; replicated parameters' norms
are whole already. Under pipeline parallelism a layer lives on one stage, and DP
replicas hold identical reduced gradients, so no other group takes part.

Every per-parameter state tensor is shaped like its parameter (placed like it in a
checkpoint), and LAMB's ``step`` is a 0-d tensor, as torch's Adam keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class _TrustRatioOptimizer(torch.optim.Optimizer):
    """What LARS and LAMB share: each step's pairs of norms, whole over the TP group, and the ratio convention."""

    def __init__(self, params, defaults: dict, group: ProcessGroup | None, split: Iterable[torch.Tensor]) -> None:
        super().__init__(params, defaults)
        self.tp_group = group
        self._split = {id(p) for p in split}

    def _whole_norms(self, params: list[torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``[len(pairs), 2]`` float64 norms of each pair, summed over the TP group for the split parameters."""
        if not pairs:
            return torch.zeros((0, 2), dtype=torch.float64, device=params[0].device if params else None)
        squares = [torch.stack([a.double().square().sum(), b.double().square().sum()]) for a, b in pairs]
        split = [i for i, p in enumerate(params) if id(p) in self._split]  # known on the host: nothing read
        if split and self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            shards = torch.stack([squares[i] for i in split])
            dist.all_reduce(shards, group=self.tp_group)
            for i, row in zip(split, shards.unbind(), strict=True):
                squares[i] = row
        return torch.stack(squares).sqrt()

    @staticmethod
    def _with_grads(groups: list[dict]) -> list[tuple[dict, torch.Tensor]]:
        return [(group, p) for group in groups for p in group["params"] if p.grad is not None]


def trust_ratio(numerator: torch.Tensor, weight_norm: torch.Tensor, update_norm: torch.Tensor) -> torch.Tensor:
    """``numerator / update_norm``, or 1 when either norm is zero (a fresh zero layer, a zero update): 0-dim
    tensors on the device, never read by the host (on a GPU each read would drain the queue, once a step)."""
    return torch.where((weight_norm > 0) & (update_norm > 0), numerator / update_norm, 1.0)


class LARS(_TrustRatioOptimizer):
    """You et al. 2017, Algorithm 1: momentum SGD with the local learning rate
    ``eta * ||w|| / (||g|| + weight_decay * ||w||)``; ``v = momentum * v + lr * local_lr * (g + weight_decay * w)``,
    ``w -= v``. State: ``momentum_buffer``."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001,
                 group: ProcessGroup | None = None, split: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta},
                         group, split)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        entries = self._with_grads(self.param_groups)
        norms = self._whole_norms([p for _, p in entries], [(p, p.grad) for _, p in entries])
        for (group, p), (w_norm, g_norm) in zip(entries, norms, strict=True):
            wd = group["weight_decay"]
            local_lr = trust_ratio(group["eta"] * w_norm, w_norm, g_norm + wd * w_norm)
            buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buffer.mul_(group["momentum"]).add_(p.grad.add(p, alpha=wd).mul_(group["lr"] * local_lr))
            p.sub_(buffer)
        return loss


class LAMB(_TrustRatioOptimizer):
    """You et al. 2019, Algorithm 2: Adam's moments with bias correction, ``r = m_hat / (sqrt(v_hat) + eps)
    + weight_decay * w``, ``w -= lr * ||w|| / ||r|| * r``. State: ``step``, ``exp_avg``, ``exp_avg_sq``."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, group: ProcessGroup | None = None,
                 split: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, group, split)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        entries = self._with_grads(self.param_groups)
        updates = [self._adam_direction(group, p) for group, p in entries]
        norms = self._whole_norms([p for _, p in entries], [(p, r) for (_, p), r in zip(entries, updates,
                                                                                         strict=True)])
        for (group, p), update, (w_norm, r_norm) in zip(entries, updates, norms, strict=True):
            p.sub_(update.mul_(group["lr"] * trust_ratio(w_norm, w_norm, r_norm)))
        return loss

    def _adam_direction(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """Update the moments of ``p``; returns ``r``, the bias-corrected Adam direction plus weight decay."""
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].double()  # on the host, kept a tensor: the corrections below read no number of it
        state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        m_hat = state["exp_avg"] / (1 - beta1**t)
        v_hat = state["exp_avg_sq"] / (1 - beta2**t)
        return (m_hat / (v_hat.sqrt() + group["eps"])).add_(p, alpha=group["weight_decay"])

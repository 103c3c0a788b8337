"""Optimizer and learning-rate schedule from the spec's [train] section."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence

import torch
from torch.distributed import ProcessGroup

from parallel.large_batch import LAMB, LARS


def learning_rate(base_lr: float, step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Linear warmup to ``base_lr``, then constant or cosine decay to zero at ``total_steps``."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr


def freeze_parameters(model: torch.nn.Module, patterns: Sequence[str]) -> list[bool]:
    """``train.freeze``: ``requires_grad = False`` on each parameter of ``model`` whose name (the single-device
    model's, on every rank) matches one of the fnmatch ``patterns``; returns, per pattern, whether it matched one
    here (on this rank's share: the caller combines the ranks' answers)."""
    matched = [False] * len(patterns)
    for name, param in model.named_parameters():
        hits = [i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)]
        for i in hits:
            matched[i] = True
        if hits:
            param.requires_grad_(False)
    return matched


def build_optimizer(
    train_cfg, parameters: Iterable[torch.nn.Parameter], tp_group: ProcessGroup | None = None,
    tp_split: Iterable[torch.nn.Parameter] = (),
) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``parameters``; lamb and lars take their layer norms whole over ``tp_group``
    for the parameters in ``tp_split`` (those split across it). No parameters (a pipeline stage whose parameters
    are all frozen) is an optimizer with nothing to step."""
    params = list(parameters)
    # torch's fused kernels (one launch for every tensor) where they exist: CUDA, float parameters
    fused = {"fused": True} if params and all(p.is_cuda and p.is_floating_point() for p in params) else {}
    params = params or [{"params": []}]
    if train_cfg.optimizer == "lamb":
        return LAMB(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, group=tp_group, split=tp_split)
    if train_cfg.optimizer == "lars":
        return LARS(params, lr=train_cfg.lr, momentum=train_cfg.momentum, weight_decay=train_cfg.weight_decay,
                    eta=train_cfg.trust_coefficient, group=tp_group, split=tp_split)
    if train_cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=train_cfg.lr, momentum=train_cfg.momentum, weight_decay=train_cfg.weight_decay
        )
    if train_cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, **fused)
    return torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, **fused)

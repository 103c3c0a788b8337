"""The built-in MLP, a plain single-device module with the model protocol's loss and metrics
(``jobs.models.protocol``)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from jobs.models.materialize import run_init, uninitialized


class MLP(nn.Sequential):
    """Linear layers with ReLU (and dropout) between them, each initialized as torch initializes an ``nn.Linear``,
    in order from the global generator: through ``run_init``, so that a meta build can be materialized shard by
    shard with the same values (``jobs.models.materialize``)."""

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int, dropout: float = 0.0):
        layers: list[nn.Module] = []
        widths = [in_features, *hidden_sizes, num_classes]
        for index, (width, out) in enumerate(itertools.pairwise(widths)):
            layers.append(uninitialized(functools.partial(nn.Linear, width, out)))
            if index < len(hidden_sizes):
                layers += [nn.ReLU(), *([nn.Dropout(dropout)] if dropout else [])]
        super().__init__(*layers)
        run_init((layer, nn.Linear.reset_parameters) for layer in self if isinstance(layer, nn.Linear))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    def metrics(self, output: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"accuracy": (output.argmax(dim=1) == targets).float().mean().item()}


def mlp(hidden_sizes: Sequence[int] = (128, 128), dropout: float = 0.0, in_features: int = 64,
        num_classes: int = 10) -> MLP:
    """The built-in MLP's entry (``model.kind = "mlp"``); the defaults fit the digits."""
    return MLP(in_features, hidden_sizes, num_classes, dropout)

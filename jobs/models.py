"""The built-in MLP, a plain single-device module with the model protocol's loss and metrics (``jobs.protocol``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int, dropout: float = 0.0):
        layers: list[nn.Module] = []
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    def metrics(self, output: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"accuracy": (output.argmax(dim=1) == targets).float().mean().item()}


def mlp(hidden_sizes: Sequence[int] = (128, 128), dropout: float = 0.0, in_features: int = 64,
        num_classes: int = 10) -> MLP:
    """The built-in MLP's entry (``model.kind = "mlp"``); the defaults fit the digits."""
    return MLP(in_features, hidden_sizes, num_classes, dropout)

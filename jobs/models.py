"""Built-in models, written as plain single-device modules."""

from __future__ import annotations

from collections.abc import Sequence

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

"""Real data sets that need no download, and the deterministic global batch order.

``digits`` is the UCI handwritten digits set (1797 8x8 images, 10 classes) that
scikit-learn ships as a CSV file. We read that file directly: importing
``sklearn.datasets`` costs about 2 s per rank, the CSV a few milliseconds.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpc.errors import ConfigError, LayoutError


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]


def digits_csv_path() -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.name='digits' needs scikit-learn installed (it ships the data file)")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


def load_digits(test_fraction: float = 0.2, split_seed: int = 0) -> Dataset:
    with gzip.open(digits_csv_path(), "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    features, labels = table[:, :-1] / 16.0, table[:, -1].astype(np.int64)
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    as_tensor = torch.from_numpy
    return Dataset(
        name="digits",
        x_train=as_tensor(features[train]),
        y_train=as_tensor(labels[train]),
        x_test=as_tensor(features[test]),
        y_test=as_tensor(labels[test]),
        num_classes=10,
    )


def load_dataset(name: str) -> Dataset:
    if name == "digits":
        return load_digits()
    raise ConfigError(f"data.name={name!r} is not a known data set (valid: digits)")


def global_batch_indices(num_samples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Sample indices of the global batch at ``step``.

    Each epoch is a fresh permutation seeded by (seed, epoch), and the function is
    pure in ``step``: every rank agrees on the batch without communicating, and a
    run resumed at step k sees exactly the batches it would have seen.
    """
    if batch_size > num_samples:
        raise ConfigError(f"data.batch_size={batch_size} is larger than the data set ({num_samples} samples)")
    per_epoch = num_samples // batch_size
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    return order[position * batch_size : (position + 1) * batch_size]


def dp_shard(indices: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """This data-parallel rank's contiguous slice of the global batch."""
    if len(indices) % dp_size:
        raise LayoutError(f"data.batch_size={len(indices)} is not divisible by dp={dp_size}")
    per_rank = len(indices) // dp_size
    return indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]

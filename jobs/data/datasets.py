"""Real data sets that need no download, and the deterministic global batch order.

``digits`` is the UCI handwritten digits set (1797 8x8 images, 10 classes) that
scikit-learn ships as a CSV file. We read that file directly: importing
``sklearn.datasets`` costs about 2 s per rank, the CSV a few milliseconds.

``licenses`` is English text for byte-level language models: the license texts
Debian installs with ``base-files`` (always present) in ``/usr/share/common-licenses``,
the regular files (not the GPL -> GPL-3 style links) concatenated in sorted name
order, about 230 KB. The last tenth of every file is held out for evaluation, so
each license is seen in both splits and no byte is in both.
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from hpc.errors import ConfigError, LayoutError


@dataclass(frozen=True)
class DataSplits:
    """What a data entry returns when it has a held-out set to evaluate on."""

    train: Any  # map-style: len() and [i] -> (input, target)
    held_out: Any = None


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


@dataclass(frozen=True)
class ByteCorpus:
    name: str
    train: torch.Tensor  # uint8, one long byte string
    test: torch.Tensor


LICENSES_DIR = Path("/usr/share/common-licenses")


def license_files(directory: Path = LICENSES_DIR) -> list[Path]:
    """The license texts, the regular files in sorted name order (the example tokenizer was trained on them)."""
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink())


def load_licenses(directory: Path = LICENSES_DIR, test_fraction: float = 0.1) -> ByteCorpus:
    files = license_files(directory)
    if not files:
        raise ConfigError(f"data.name='licenses' needs the license texts in {directory} (Debian package base-files)")
    train, test = bytearray(), bytearray()
    for path in files:
        text = path.read_bytes()
        cut = len(text) - int(len(text) * test_fraction)
        train += text[:cut]
        test += text[cut:]
    return ByteCorpus(
        name="licenses",
        train=torch.frombuffer(train, dtype=torch.uint8),
        test=torch.frombuffer(test, dtype=torch.uint8),
    )


def digits() -> DataSplits:
    """The built-in ``digits`` entry: the training images and the held-out test images."""
    data = load_digits()
    train, test = TensorDataset(data.x_train, data.y_train), TensorDataset(data.x_test, data.y_test)
    train.masks_targets = test.masks_targets = False  # every label counts
    return DataSplits(train, test)


class ByteWindows:
    """Map-style windows of ``seq_len + 1`` bytes every ``stride`` bytes of a text: item i is (inputs, next bytes)."""

    masks_targets = False  # every next byte counts: no -100 marks, so no count of counted targets to agree on

    def __init__(self, text: torch.Tensor, seq_len: int, stride: int = 1) -> None:
        if len(text) <= seq_len:
            raise ConfigError(f"model.seq_len={seq_len} is longer than the text ({len(text)} bytes)")
        self.text, self.seq_len, self.stride = text, seq_len, stride

    def __len__(self) -> int:
        return (len(self.text) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = byte_windows(self.text, np.array([index * self.stride]), self.seq_len)
        return inputs[0], targets[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = byte_windows(self.text, np.asarray(indices) * self.stride, self.seq_len)
        return list(zip(inputs, targets, strict=True))

    def batch_indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """Windows drawn anywhere in the text, with replacement: ``window_starts`` (stride 1)."""
        return window_starts(len(self.text), batch_size, self.seq_len, seed, step) // self.stride


def licenses(seq_len: int = 64) -> DataSplits:
    """The built-in ``licenses`` entry: random training windows, held-out windows tiling the held-out text."""
    corpus = load_licenses()
    return DataSplits(ByteWindows(corpus.train, seq_len), ByteWindows(corpus.test, seq_len, stride=seq_len))


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


def window_starts(num_bytes: int, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Start offsets of the global batch of ``seq_len + 1``-byte windows at ``step``.

    Pure in (seed, step) like ``global_batch_indices``: every rank draws the same
    windows without communicating, and ``dp_shard`` splits them the same way.
    """
    last = num_bytes - (seq_len + 1)
    if last < 0:
        raise ConfigError(f"model.seq_len={seq_len} is longer than the text ({num_bytes} bytes)")
    return np.random.default_rng([seed, step]).integers(0, last + 1, size=batch_size)


def byte_windows(data: torch.Tensor, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, each ``[len(starts), seq_len]`` int64."""
    offsets = torch.from_numpy(np.asarray(starts, dtype=np.int64)).unsqueeze(1) + torch.arange(seq_len + 1)
    windows = data[offsets].long()
    return windows[:, :-1], windows[:, 1:]

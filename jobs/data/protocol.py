"""The data protocol: how ``data.entry`` brings any data set (docs/USER_MODELS.md is the user's guide).

Data is a map-style data set (``len(data)``, ``data[i] -> (input, target)``, e.g. a
``torch.utils.data.TensorDataset``), or ``DataSplits(train, held_out)``. Batches are a
pure function of (seed, step): ``data.batch_indices(step, batch_size, seed)`` when the
data set defines it, else an epoch-wise permutation (``jobs.data.datasets.global_batch_indices``).
The built-in data sets are entries like any other (``BUILTIN_DATA``).

"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc.entry import call_entry, load_entry
from hpc.errors import ConfigError
from jobs.data.datasets import DataSplits
from jobs.data.tokens import TOKENS_ENTRY, entry_args

if TYPE_CHECKING:
    from hpc.config import JobSpec

BUILTIN_DATA = {"digits": "jobs.data.datasets:digits", "licenses": "jobs.data.datasets:licenses"}


def data_entry(spec: JobSpec) -> tuple[str, dict[str, Any]]:
    """The data's entry and keyword arguments: ``data.entry`` or the built-in ``data.name``."""
    data = spec.data
    if data.entry == TOKENS_ENTRY:
        return data.entry, entry_args(spec)
    if data.entry:
        return data.entry, dict(data.args)
    return BUILTIN_DATA[data.name], ({"seq_len": spec.model.seq_len} if data.name == "licenses" else {})


def build_data(spec: JobSpec) -> DataSplits:
    entry, args = data_entry(spec)
    data = call_entry(load_entry(entry, "data.entry"), args, entry, "data.entry")
    splits = data if isinstance(data, DataSplits) else DataSplits(data)
    for name, part in (("train", splits.train), ("held_out", splits.held_out)):
        if part is not None and not (hasattr(part, "__len__") and hasattr(part, "__getitem__")):
            raise ConfigError(f"data.entry={entry!r}: its {name} set must be map-style (len() and [i]), "
                              f"got {type(part).__name__}")
    if len(splits.train) == 0:
        raise ConfigError(f"data.entry={entry!r} returned an empty training set")
    sample = splits.train[0]
    if isinstance(splits.train, (str, bytes)) or not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ConfigError(f"data.entry={entry!r}: a sample of its train set must be an (inputs, targets) pair, got "
                          f"{type(sample).__name__} from {type(splits.train).__name__}")
    return splits

"""Pretrained weights of a transformers causal LM (``[model.args] pretrained = DIR``), from the safetensors
files ``save_pretrained`` writes: checked whole before any rank starts, then read by each rank slice by slice.

DIR holds ``model.safetensors``, or ``model.safetensors.index.json`` and the files its ``weight_map`` names
(``model-00001-of-00002.safetensors``, ...). ``open_weights`` reads the index and each file's header (the JSON
at the start of a safetensors file: names, dtypes, shapes, byte ranges; no tensor data) and checks that every
tensor the model saves is there, in the file the index names, with the model's shape and a floating-point
dtype: the first that is not is one ``ConfigError`` line naming the tensor and the file, as is a file or an
index that cannot be parsed. A tied weight the files hold under one of its names only (``save_pretrained``
leaves out a tied ``lm_head.weight``) is read under that name. Tensors of the files that the model does not
have are left unread, as ``from_pretrained`` leaves them (a config cut to fewer layers).

``StoredWeights.read(name, index)`` then reads a slice of one tensor, in its stored dtype:
``safe_open(...).get_slice(name)[index]`` reads only those bytes of the file. ``jobs.models.materialize`` calls it
for every tensor a rank's share holds, its TP shard's slice, and copies it into the model's float32 on the
rank's device (bf16 and fp16 widen to float32 exactly); a host build reads each tensor whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from hpc.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
              "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
FLOATS = ("F32", "BF16", "F16", "F64")  # what widens to (or narrows from F64 to) a float32 master exactly enough


@dataclass(frozen=True)
class Stored:
    """One tensor of the files: the file holding it (its name in DIR), its dtype and shape as stored."""

    file: str
    dtype: str
    shape: tuple[int, ...]


class StoredWeights:
    """The checked tensors of a pretrained directory, by the model's names (see the module docstring)."""

    def __init__(self, root: Path, tensors: dict[str, tuple[str, Stored]]) -> None:
        self.root = root
        self.tensors = tensors  # the model's name -> (the name in the files, where it is)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor | None:
        """The slice ``index`` of the model's tensor ``name`` as stored (dtype too); None when the files do not
        hold it (a non-persistent buffer: the model computes it)."""
        found = self.tensors.get(name)
        if found is None:
            return None
        stored_name, where = found
        with safe_open(str(self.root / where.file), framework="pt", device="cpu") as files:
            return files.get_slice(stored_name)[index] if index else files.get_tensor(stored_name)

    def load_whole(self, model: nn.Module) -> None:
        """Every tensor of ``model`` (built on the host) that the files hold, read whole into it."""
        import torch

        from jobs.models.materialize import named_tensors

        with torch.no_grad():
            for name, tensor in named_tensors(model).items():
                value = self.read(name, tuple(slice(None) for _ in tensor.shape))
                if value is not None:
                    tensor.copy_(value)


def open_weights(directory: str | Path, model: nn.Module) -> StoredWeights:
    """The weights of ``directory`` for ``model`` (built on any device, the meta one too), every tensor its
    state dict holds checked against the files; one ``ConfigError`` line for the first that does not fit."""
    root = Path(directory)
    where = f"model.args.pretrained={str(directory)!r}"
    files, listed_in = _weight_map(root, where)
    headers = {file: read_header(root / file, f"{where}: {file}") for file in sorted(set(files.values()))}
    state = model.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for name, tensor in state.items():
        names_of.setdefault(id(tensor), []).append(name)
    tensors = {}
    for name, tensor in state.items():
        stored_name = name if name in files else next(  # a tied weight: under any of its names
            (other for other in names_of[id(tensor)] if other in files), name)
        if stored_name not in files:
            raise ConfigError(f"{where}: {name} is missing from {listed_in}")
        stored = headers[files[stored_name]].get(stored_name)
        if stored is None:
            raise ConfigError(f"{where}: {stored_name} is missing from {files[stored_name]}")
        _check_fits(where, stored_name, stored, tensor)
        tensors[name] = (stored_name, stored)
    return StoredWeights(root, tensors)


def _check_fits(where: str, name: str, stored: Stored, tensor: torch.Tensor) -> None:
    if stored.shape != tuple(tensor.shape):
        raise ConfigError(f"{where}: {name} has shape {stored.shape} in {stored.file}, the config makes "
                          f"{tuple(tensor.shape)}")
    if tensor.is_floating_point() and stored.dtype not in FLOATS:
        raise ConfigError(f"{where}: {name} is {stored.dtype} in {stored.file}; the model's "
                          f"{str(tensor.dtype).removeprefix('torch.')} reads {', '.join(FLOATS)}")
    if not tensor.is_floating_point() and stored.dtype in FLOATS:
        raise ConfigError(f"{where}: {name} is {stored.dtype} in {stored.file}; the model holds "
                          f"{str(tensor.dtype).removeprefix('torch.')}")


def _weight_map(root: Path, where: str) -> tuple[dict[str, str], str]:
    """(tensor name -> the file holding it, what lists them): the index's ``weight_map``, or the single file's
    header. A file the index names must exist."""
    if (root / INDEX).exists():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{where}: {INDEX} is not an index of safetensors files "
                              f"({type(exc).__name__}: {_one_line(exc)})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{where}: {INDEX} is not an index of safetensors files (its weight_map is not "
                              "a table of tensor names to file names)")
        for file in sorted(set(weight_map.values())):
            if Path(file).name != file or not (root / file).is_file():
                raise ConfigError(f"{where}: {file}, named by {INDEX}, is not a file of the directory")
        return dict(weight_map), INDEX
    if (root / SINGLE).is_file():
        return dict.fromkeys(read_header(root / SINGLE, f"{where}: {SINGLE}"), SINGLE), SINGLE
    raise ConfigError(f"{where}: it holds neither {SINGLE} nor {INDEX} (save_pretrained writes them; "
                      "pytorch_model.bin is not read)")


def read_header(path: Path, what: str) -> dict[str, Stored]:
    """The tensors a safetensors file holds, from its header alone, checked as safetensors checks them when a rank
    opens the file: each a dtype, a shape and its bytes, the tensors' bytes tiling the data after the header
    without a gap or an overlap, ``__metadata__`` a table of strings; one ``ConfigError`` line starting with
    ``what`` when the file is not a safetensors file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError(f"__metadata__ is {_one_line(repr(metadata))[:60]}, not a table of strings")
        tensors = {name: _entry(path.name, name, fields) for name, fields in header.items()}
        _check_tiled(header, size - 8 - length)
        return tensors
    except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
        raise ConfigError(f"{what} is not a safetensors file ({type(exc).__name__}: {_one_line(exc)})") from None


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _entry(file: str, name: str, fields: dict) -> Stored:
    dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    if dtype not in ITEM_BYTES or not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise ValueError(f"{name}: dtype {dtype!r}, shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)
            and offsets[1] - offsets[0] == math.prod(shape) * ITEM_BYTES[dtype]):
        raise ValueError(f"{name}: data_offsets {offsets!r} for {dtype} {shape}")
    return Stored(file, dtype, tuple(shape))


def _check_tiled(header: dict, data_bytes: int) -> None:
    """The tensors' byte ranges, in order, cover the data after the header exactly (safetensors' own rule)."""
    end = 0
    for name, fields in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = fields["data_offsets"]
        if stop > data_bytes:
            raise ValueError(f"{name}: data_offsets [{begin}, {stop}] run past the file's {data_bytes} bytes of data")
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves bytes {end}-{begin} unused"
            raise ValueError(f"{name}: data_offsets [{begin}, {stop}] {what}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"the tensors' bytes end at {end}, the file's data at {data_bytes}")


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:200]

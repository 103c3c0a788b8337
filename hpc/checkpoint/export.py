"""``hpc ckpt export``: the global tensors of a checkpoint as one safetensors (or torch) file, or as the
safetensors files of a transformers model directory (``--format hf``: one file, or shards and their index).

safetensors is the format downstream tools load without executing code; ``.pt``
is for code that wants ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from hpc.checkpoint.format import CheckpointError
from hpc.checkpoint.load import open_checkpoint, read_tensor

SUFFIXES = (".safetensors", ".pt")
MAX_SHARD_BYTES = 5 << 30  # a model directory's files (transformers' save_pretrained wrote 5 GB shards for years)
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def export_tensors(step_dir: str | Path, dest: str | Path, only: str = "", force: bool = False) -> int:
    """Write the tensors whose name starts with ``only`` (prefix stripped) to ``dest``; returns how many. An
    existing ``dest`` is replaced only with ``force``."""
    import torch
    from safetensors.torch import save_file

    dest = Path(dest)
    if dest.suffix not in SUFFIXES:
        raise CheckpointError(f"--to {dest}: the file name must end in {' or '.join(SUFFIXES)}")
    check_destination(dest, directory=False)
    if not force and (dest.exists() or dest.is_symlink()):
        raise CheckpointError(f"--to {dest}: the file exists (pass --force to replace it)")
    index = open_checkpoint(step_dir)
    names = [name for name in sorted(index.tensors) if name.startswith(only)]
    if not names:
        raise CheckpointError(f"{index.path} has no tensor whose name starts with {only!r}")
    tensors = {name.removeprefix(only): read_tensor(index, name) for name in names}
    with _writing(dest) as partial:
        if dest.suffix == ".pt":
            torch.save(tensors, partial)
        else:
            save_file(tensors, partial, metadata={"step": str(index.step), "source": str(index.path)})
    return len(tensors)


def check_destination(dest: Path, directory: bool) -> None:
    """``--to``: a file to write in an existing directory, or a directory (made with its parents when missing);
    one line saying which part of the path is in the way."""
    if directory and dest.exists() and not dest.is_dir():
        raise CheckpointError(f"--to {dest}: not a directory (--format hf writes config.json and model.safetensors)")
    if not directory and dest.is_dir():
        raise CheckpointError(f"--to {dest}: a directory (give a file name ending in {' or '.join(SUFFIXES)})")
    parent = dest if directory else dest.parent
    existing = next(path for path in (parent, *parent.parents) if path.exists() or path == path.parent)
    if not existing.is_dir():
        raise CheckpointError(f"--to {dest}: {existing} is not a directory")
    if existing != parent and not directory:
        raise CheckpointError(f"--to {dest}: the directory {parent} does not exist")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"--to {dest}: cannot write in {existing} (permission denied)")


@contextlib.contextmanager
def _writing(dest: Path) -> Iterator[Path]:
    """The path to write ``dest``'s bytes to: a file beside it that replaces ``dest`` whole once written, so a
    write that fails (a full disk, a file-size limit, an I/O error) leaves what was there and says so in one
    line naming ``--to``, and a link at ``dest`` is replaced, not written through."""
    from safetensors import SafetensorError

    partial = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        yield partial
        os.replace(partial, dest)
    except (OSError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"--to {dest}: cannot write it ({' '.join(str(exc).split())[:200]})") from None
    finally:
        partial.unlink(missing_ok=True)


def export_model_dir(step_dir: str | Path, dest: Path, only: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """The tensors under ``only`` (prefix stripped) as the weights of a transformers model directory ``dest``:
    ``model.safetensors``, or, when they exceed ``max_shard_bytes``, ``model-00001-of-0000N.safetensors`` files
    of at most that size each (a larger tensor alone in its file), in the model's order, and
    ``model.safetensors.index.json`` naming each tensor's file: what ``save_pretrained`` writes and
    ``from_pretrained`` loads. Weight files of an earlier export that this one does not write are removed
    (beside an index, a stale ``model.safetensors`` would be loaded instead). Returns how many tensors."""
    from safetensors.torch import save_file

    index = open_checkpoint(step_dir)
    names = sorted((name for name in index.tensors if name.startswith(only)), key=_natural_order)
    if not names:
        raise CheckpointError(f"{index.path} has no tensor whose name starts with {only!r}")
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = index.tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    metadata = {"format": "pt", "step": str(index.step), "source": str(index.path)}
    for file, shard in zip(files, shards, strict=True):
        with _writing(dest / file) as partial:
            save_file({name.removeprefix(only): read_tensor(index, name) for name in shard}, partial, metadata)
    if len(files) > 1:
        weight_map = {name.removeprefix(only): file for file, shard in zip(files, shards, strict=True)
                      for name in shard}
        total = sum(index.tensors[name].nbytes for name in names)
        with _writing(dest / "model.safetensors.index.json") as partial:
            partial.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
                               + "\n")
    for stale in dest.iterdir():
        weights = stale.name == "model.safetensors" or SHARD_FILE.fullmatch(stale.name)
        if (weights and stale.name not in files) or (stale.name == "model.safetensors.index.json" and len(files) == 1):
            stale.unlink()
    return len(names)


def _natural_order(name: str) -> list[int | str]:
    """``layers.2`` before ``layers.10``: numbers compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

"""``hpc ckpt export``: the global tensors of a checkpoint as one safetensors (or torch) file.

safetensors is the format downstream tools load without executing code; ``.pt``
is for code that wants ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

from pathlib import Path

from hpc.checkpoint.format import CheckpointError
from hpc.checkpoint.load import open_checkpoint, read_tensor

SUFFIXES = (".safetensors", ".pt")


def export_tensors(step_dir: str | Path, dest: str | Path, only: str = "") -> int:
    """Write the tensors whose name starts with ``only`` (prefix stripped) to ``dest``; returns how many."""
    import torch

    dest = Path(dest)
    if dest.suffix not in SUFFIXES:
        raise CheckpointError(f"--to {dest}: the file name must end in {' or '.join(SUFFIXES)}")
    index = open_checkpoint(step_dir)
    names = [name for name in sorted(index.tensors) if name.startswith(only)]
    if not names:
        raise CheckpointError(f"{index.path} has no tensor whose name starts with {only!r}")
    tensors = {name.removeprefix(only): read_tensor(index, name) for name in names}
    if dest.suffix == ".pt":
        torch.save(tensors, dest)
    else:
        from safetensors.torch import save_file

        save_file(tensors, dest, metadata={"step": str(index.step), "source": str(index.path)})
    return len(tensors)

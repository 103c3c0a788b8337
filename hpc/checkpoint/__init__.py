"""Sharded HDF5 checkpoints: parallel atomic saves, resharding loads, verification, export.

Names resolve lazily (as in ``hpc``): ``hpc ckpt ls`` and ``verify`` need h5py but not
torch, and ``import hpc.checkpoint`` costs nothing until a name is used.
"""

from __future__ import annotations

from hpc.lazy import lazy_getattr

_EXPORTS = {name: module for module, names in {
    "hpc.checkpoint.format": ("CheckpointError", "CheckpointIndex", "read_index"),
    "hpc.checkpoint.pieces": ("Piece", "plan_writes"),
    "hpc.checkpoint.save": ("Checkpointer",),
    "hpc.checkpoint.load": ("open_checkpoint", "load_into", "load_rank_state", "read_tensor"),
    "hpc.checkpoint.discovery": ("list_checkpoints", "find_latest", "resolve_resume"),
    "hpc.checkpoint.verify": ("verify_checkpoint",),
    "hpc.checkpoint.export": ("export_tensors",),
}.items() for name in names}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)

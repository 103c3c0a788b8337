"""Sharded HDF5 checkpoints: parallel atomic saves, resharding loads, verification, export.

Names resolve lazily (as in ``hpc``): ``hpc ckpt ls`` and ``verify`` need h5py but not
torch, and ``import hpc.checkpoint`` costs nothing until a name is used.
"""

from __future__ import annotations

from hpc.lazy import lazy_getattr

_EXPORTS = {
    "CheckpointError": "hpc.checkpoint.format",
    "CheckpointIndex": "hpc.checkpoint.format",
    "read_index": "hpc.checkpoint.format",
    "Piece": "hpc.checkpoint.pieces",
    "plan_writes": "hpc.checkpoint.pieces",
    "Checkpointer": "hpc.checkpoint.save",
    "open_checkpoint": "hpc.checkpoint.load",
    "load_into": "hpc.checkpoint.load",
    "load_rank_state": "hpc.checkpoint.load",
    "read_tensor": "hpc.checkpoint.load",
    "list_checkpoints": "hpc.checkpoint.discovery",
    "find_latest": "hpc.checkpoint.discovery",
    "resolve_resume": "hpc.checkpoint.discovery",
    "verify_checkpoint": "hpc.checkpoint.verify",
    "export_tensors": "hpc.checkpoint.export",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)

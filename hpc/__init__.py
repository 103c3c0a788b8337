"""hpc-batch runtime: rank bootstrap, process-group mesh, job specs, launchers.

Names are resolved lazily so that ``import hpc`` (and ``hpc --help``) never pays
for importing torch; ``hpc.init()`` is the first call that does.
"""

from __future__ import annotations

from hpc.lazy import lazy_getattr

_EXPORTS = {
    "init": "hpc.runtime.bootstrap",
    "shutdown": "hpc.runtime.bootstrap",
    "World": "hpc.runtime.bootstrap",
    "RankInfo": "hpc.runtime.env",
    "detect_rank_info": "hpc.runtime.env",
    "JobSpec": "hpc.config",
    "load_spec": "hpc.config",
    "Mesh": "hpc.runtime.mesh",
    "MeshShape": "hpc.runtime.mesh",
    "build_mesh": "hpc.runtime.mesh",
    "resolve_layout": "hpc.runtime.mesh",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)

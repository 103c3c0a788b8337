"""hpc-batch runtime: rank bootstrap, process-group mesh, job specs, launchers; ``hpc.session()`` for your own script.

Names are resolved lazily so that ``import hpc`` (and ``hpc --help``) never pays
for importing torch; ``hpc.init()`` is the first call that does.
"""

from __future__ import annotations

from hpc.lazy import lazy_getattr

_EXPORTS = {name: module for module, names in {
    "hpc.runtime.bootstrap": ("init", "shutdown", "World"),
    "hpc.runtime.env": ("RankInfo", "detect_rank_info"),
    "hpc.config": ("JobSpec", "load_spec"),
    "hpc.runtime.mesh": ("Mesh", "MeshShape", "build_mesh", "resolve_layout"),
    "hpc.script": ("session", "Session"),
}.items() for name in names}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)

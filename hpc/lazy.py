"""Package names that import their module on first use, so that ``import hpc`` never pays for torch or h5py."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) resolving ``name`` from the module ``exports[name]`` names."""

    def getattr_(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return getattr_

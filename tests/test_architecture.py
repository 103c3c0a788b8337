"""The rules of docs/ARCHITECTURE.md, read from the source with ast so that they cannot silently rot.

Dependency direction: the CLI (``hpc.cli``) is the composition root and may import every
package; below it ``jobs -> parallel -> hpc`` and ``slurm -> hpc``, and inside ``jobs``
``bench -> train -> models -> data``; the rest of ``hpc`` imports nothing of ours outside
itself, and nothing outside the CLI imports the CLI. No module imports itself through
others (an import circle). Every import counts, also one inside a function or under
``TYPE_CHECKING``: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hpc", "parallel", "slurm", "jobs")
# What each layer may import of ours (its own package always).
JOBS_ORDER = ("jobs.examples", "jobs.bench", "jobs.train", "jobs.models", "jobs.data")  # each imports those after it
ALLOWED = {
    "hpc": {"hpc"},
    "parallel": {"parallel", "hpc"},
    "slurm": {"slurm", "hpc"},
    "jobs": {"jobs", "parallel", "hpc"},  # the package's own __init__
    **{part: {*JOBS_ORDER[i:], "parallel", "hpc"} for i, part in enumerate(JOBS_ORDER)},
}
# Read on login nodes by hpc --help, hpc submit --dry-run and hpc status: the standard library and each other only.
STDLIB_ONLY = ("hpc.config", "hpc.errors", "hpc.lazy", "hpc.rundir", "hpc.text")
HEAVY = ("torch", "numpy", "h5py")  # slurm/ runs on login nodes: sbatch generation must not need them
MAX_FUNCTION_LINES = 60
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports, absolute, wherever the import statement stands."""
    path = _sources()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in _sources())
    return found


def _ours(name: str) -> str | None:
    """The layer ``name`` belongs to: a package, or a part of ``jobs``."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    return ".".join(parts[:2]) if parts[0] == "jobs" and ".".join(parts[:2]) in JOBS_ORDER else parts[0]


def _is_cli(name: str) -> bool:
    return name == "hpc.cli" or name.startswith("hpc.cli.")


def test_every_package_imports_only_what_its_layer_allows() -> None:
    wrong = []
    for module in _sources():
        if _is_cli(module):
            continue
        layer = _ours(module)
        for name in sorted(_imports(module)):
            if _ours(name) and _ours(name) not in ALLOWED[layer]:
                wrong.append(f"{module} imports {name} ({layer} may import {', '.join(sorted(ALLOWED[layer]))})")
            elif _is_cli(name):
                wrong.append(f"{module} imports {name}: only the CLI imports the CLI")
    assert not wrong, "\n".join(wrong)


def test_slurm_never_imports_the_heavy_libraries() -> None:
    wrong = [f"{module} imports {name}" for module in _sources() if module.split(".")[0] == "slurm"
             for name in _imports(module) if name.split(".")[0] in HEAVY]
    assert not wrong, "\n".join(wrong)


def test_login_node_modules_use_only_the_standard_library() -> None:
    wrong = [f"{module} imports {name}" for module in STDLIB_ONLY for name in sorted(_imports(module))
             if name not in STDLIB_ONLY and name.split(".")[0] not in sys.stdlib_module_names]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others() -> None:
    """Import circles anywhere in the product: each is named, module by module."""
    graph = {m: sorted(n for n in _imports(m) if n in _sources() and n != m) for m in _sources()}
    circles, visiting, done = [], [], set()

    def visit(module: str) -> None:
        if module in visiting:
            circles.append(" -> ".join([*visiting[visiting.index(module):], module]))
            return
        if module in done:
            return
        visiting.append(module)
        for name in graph[module]:
            visit(name)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_circle_check_finds_a_planted_circle(monkeypatch) -> None:
    """The rule above is not vacuous: a datasets -> tokens -> datasets import is caught."""
    real = _imports

    def planted(module: str) -> set[str]:
        return real(module) | ({"jobs.data.tokens"} if module == "jobs.data.datasets" else set())

    monkeypatch.setattr(sys.modules[__name__], "_imports", planted)
    with pytest.raises(AssertionError, match=r"jobs\.data\.tokens -> jobs\.data\.datasets -> jobs\.data\.tokens"):
        test_no_module_imports_itself_through_others()


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for module, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines ({path.relative_to(ROOT)}:{node.lineno})")
    assert not long, "\n".join(long)


def _mapped_files() -> list[str]:
    """The files docs/ARCHITECTURE.md's rows name."""
    return re.findall(rf"`((?:{'|'.join(PACKAGES)})/[\w/]+\.(?:py|sh))`", ARCHITECTURE.read_text())


def test_architecture_table_names_files_that_exist() -> None:
    """Each concept row of docs/ARCHITECTURE.md points at one file; a moved file must move its row too."""
    paths = _mapped_files()
    assert len(paths) >= 30
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


def test_every_module_has_a_row_in_the_architecture_table() -> None:
    """The map is whole: a new module without a row is a concept nobody can find (``__init__`` files re-export)."""
    named = set(_mapped_files())
    modules = {str(path.relative_to(ROOT)) for path in _sources().values() if path.name != "__init__.py"}
    assert not modules - named, f"docs/ARCHITECTURE.md has no row for: {sorted(modules - named)}"

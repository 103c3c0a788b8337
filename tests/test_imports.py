"""What importing a module pulls in: the code that runs on login nodes stays free of torch, numpy and h5py.

Each check runs in a fresh interpreter, so that nothing this test process imported before counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "h5py")
# Appended to every snippet: which heavy modules and which hpc.cli modules it left loaded, as its last line.
REPORT = f"""
import json, sys
print(json.dumps({{"heavy": sorted(m for m in {HEAVY!r} if m in sys.modules),
                  "cli": sorted(m for m in sys.modules if m == "hpc.cli" or m.startswith("hpc.cli."))}}))
"""


def _loaded_after(snippet: str, env: dict[str, str] | None = None) -> dict:
    """Run ``snippet`` in a fresh interpreter: what it had loaded at the end, and the lines it printed (``output``)."""
    done = subprocess.run([sys.executable, "-c", snippet + REPORT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return {**json.loads(lines[-1]), "output": lines[:-1]}


def test_every_slurm_module_imports_without_torch_numpy_h5py_or_the_cli() -> None:
    loaded = _loaded_after(
        "import importlib, pkgutil, slurm\n"
        "for module in pkgutil.walk_packages(slurm.__path__, 'slurm.'):\n"
        "    importlib.import_module(module.name)\n"
        "    print(module.name)\n")
    assert {"slurm.job_registry", "slurm.submit", "slurm.sweep", "slurm.testbed.cluster",
            "slurm.testbed.netns"} <= set(loaded["output"])
    assert loaded["heavy"] == []
    assert loaded["cli"] == []


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit needs srun on PATH, even for a dry run")
def test_submit_dry_run_imports_no_torch_numpy_or_h5py(tmp_path: Path) -> None:
    spec = REPO / "tests" / "golden" / "submit_job.toml"
    loaded = _loaded_after(
        "import contextlib, io\n"
        "from hpc.cli.main import main\n"
        "script = io.StringIO()\n"
        "with contextlib.redirect_stdout(script):\n"
        f"    code = main(['submit', {str(spec)!r}, '--dry-run'])\n"
        "print(code, script.getvalue().splitlines()[0])\n",
        env={**os.environ, "HPC_HOME": str(tmp_path)})
    assert loaded["output"] == ["0 #!/bin/bash"]
    assert loaded["heavy"] == []

"""The command line: clear one-line errors before anything starts, and a fast --help."""

import subprocess
import sys
from pathlib import Path

import pytest

from hpc.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "mlp.toml"


def _error_of(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return code, err


def test_bad_toml_is_one_line_naming_the_file(tmp_path, capsys) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text("[train\nsteps = 3\n")
    code, err = _error_of(capsys, "run", "-n", "2", str(spec))
    assert code == 2 and f"{spec}: invalid TOML" in err


def test_bad_value_names_the_dotted_path_and_choices(tmp_path, capsys) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text('[train]\noptimizer = "lion"\n')
    code, err = _error_of(capsys, "run", str(spec))
    assert code == 2
    assert "train.optimizer must be one of sgd, adam, adamw, lamb, lars; got 'lion'" in err


def test_bad_override_is_named(capsys) -> None:
    code, err = _error_of(capsys, "run", str(EXAMPLE), "--set", "train.lr=-1")
    assert code == 2 and "--set train.lr=-1: train.lr must be > 0" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "4", "--set", "parallel.tp=3"], "does not divide the world size 4"),
        (["-n", "4", "--set", "parallel.dp=3"], "dp*tp*pp = 3*1*1 = 3 does not match the world size 4"),
        (["-n", "3"], "data.batch_size=128 is not divisible by dp=3"),
        (["-n", "0"], "-n must be at least 1"),
        (["-n", "8", "--launcher", "mpirun", "--hosts", "a:2,b:2"], "offers 4 slots, fewer than -n 8"),
        (["-n", "2", "--launcher", "local", "--hosts", "a:2"], "--hosts needs --launcher mpirun"),
        (["-n", "2", "--launcher", "local", "--bind-to", "core"], "--bind-to core needs --launcher mpirun"),
        (["-n", "2", "--launcher", "local", "--set", "parallel.transport=mpi"], "transport='mpi' needs --launcher"),
    ],
)
def test_bad_layouts_fail_before_launch(capsys, args, message) -> None:
    code, err = _error_of(capsys, "run", str(EXAMPLE), *args)
    assert code == 2 and message in err


def test_missing_spec(capsys, tmp_path) -> None:
    code, err = _error_of(capsys, "run", str(tmp_path / "nope.toml"))
    assert code == 2 and "no such job spec" in err


def test_help_does_not_import_torch() -> None:
    probe = (
        "import sys\n"
        "from hpc.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "try:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass\n"
        "import hpc\n"
        "heavy = [m for m in ('torch', 'numpy', 'mpi4py', 'h5py', 'submitit', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage: hpc" in done.stdout


def test_public_api_resolves_lazily() -> None:
    import hpc

    assert callable(hpc.init) and callable(hpc.shutdown) and callable(hpc.load_spec)
    with pytest.raises(AttributeError):
        hpc.not_a_thing  # noqa: B018

"""No traceback from any input (issue 16): specs, ``--set`` values, sweep files and odd paths, fuzzed.

Every run goes through ``hpc.cli.main.main`` in-process, as a user would type it, and ends in one
of two ways: exit 0 (a valid dry run: ``hpc run --dry-run --launcher local`` or ``hpc sweep
--executor local --dry-run``, which start nothing), or exit 2 with exactly one line on stderr
starting ``hpc: error:``. Never an exception, never a hang (an alarm ends each example). The
examples are derandomized so that CI sees the same ones every time.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import string
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc.cli.main import main
from hpc.config import JobSpec, SweepConfig, spec_to_dict
from slurm.sweep import toml_value

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SECONDS_PER_EXAMPLE = 10
RUN = ("run", "--dry-run", "--launcher", "local")
SWEEP = ("sweep", "--executor", "local", "--dry-run")
SCHEMA = spec_to_dict(JobSpec())  # {section: {key: default}}; defaults make a valid value of each key
SWEEP_DEFAULTS = {key: toml_value(value) for key, value in spec_to_dict(SweepConfig()).items()
                  if key not in ("base", "method", "dir")}
DEFAULTS = {f"{section}.{key}": toml_value(value) for section, table in SCHEMA.items() for key, value in table.items()}
DOTTED = list(DEFAULTS)
BASE = '[job]\nname = "fuzz"\n[model]\nhidden_sizes = [8]\n[data]\nbatch_size = 8\n[train]\nsteps = 2\n'


class Hang(Exception):
    """An example ran past SECONDS_PER_EXAMPLE."""


@contextlib.contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def expired(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _check_cli(*argv: str) -> tuple[int, str]:
    """Run ``hpc ARGV``; assert it answered in one of the two allowed ways."""
    out, err = io.StringIO(), io.StringIO()
    with _alarm(SECONDS_PER_EXAMPLE), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    lines = err.getvalue().splitlines()
    if code == 0:
        assert not lines, lines
    else:
        assert code == 2, (code, err.getvalue()[:500])
        assert len(lines) == 1 and lines[0].startswith("hpc: error: "), err.getvalue()[:500]
        assert len(lines[0]) < 1500, lines[0][:200]  # a path is echoed up to 1024 characters, a value up to 80
    return code, err.getvalue()


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A directory with a base spec and the odd files the paths below name."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "base.toml").write_text(BASE)
    os.mkfifo(root / "fifo.toml")
    (root / "big.toml").write_text("# padding\n" * 120_000)
    (root / "dir.toml").mkdir()
    (root / "loop.toml").symlink_to(root / "loop.toml")
    (root / "zero.toml").symlink_to("/dev/zero")
    (root / "devnull.toml").symlink_to("/dev/null")
    return root


ODD_PATHS = ("fifo.toml", "big.toml", "dir.toml", "loop.toml", "zero.toml", "devnull.toml", "missing.toml",
             "/dev/zero", "/dev/null", "/dev/full", "/proc/self/mem", "/dev/stdin", "bad\nname.toml", "x" * 5000)


@pytest.mark.parametrize("name", ODD_PATHS, ids=range(len(ODD_PATHS)))
def test_odd_paths_as_a_spec_a_sweep_or_a_sweep_base(place: Path, name: str) -> None:
    path = str(place / name)
    assert _check_cli(*RUN, path)[0] == 2
    assert _check_cli(*SWEEP, path)[0] == 2
    sweep = place / "odd-base.toml"
    sweep.write_text(f'[sweep]\nbase = {toml_value(path)}\n[params]\n"train.lr" = [0.1]\n')
    assert _check_cli(*SWEEP, str(sweep))[0] == 2


# --- values a file or a --set may hold ---------------------------------------------------------------

NASTY_TEXT = st.text(alphabet=st.sampled_from([*string.printable, "\x00", "\x1b", "\x7f", "\u0085", "é", "\U0001f600",
                                              "[", "]", "{", "}", '"', "'", "\\"]), max_size=40)


def _nested(depth: int, inner: str, kind: str) -> str:
    return ("[" * depth + inner + "]" * depth) if kind == "[" else ("{a=" * depth + inner + "}" * depth)


scalars = st.one_of(
    st.integers(-(2**70), 2**70).map(str), st.floats().map(toml_value), st.booleans().map(toml_value),
    NASTY_TEXT.map(toml_value), st.integers(100, 5000).map(lambda n: toml_value("a" * n)),
    st.sampled_from(["1979-05-27", "07:32:00", "inf", "nan", '"auto"', '"0"', '"00:00:00"', '"1-00:00"',
                     "\"echo 'x\"", '"999T"', '"a/b"', '"/' + "b" * 300 + '"', "[]", "{}", "[1, 2, 3]",
                     '["module load x", "echo \'"]']),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
    st.builds(_nested, st.integers(0, 80), scalars, st.sampled_from("[{")),
)
keys = st.one_of(st.sampled_from(DOTTED), st.sampled_from(list(SCHEMA)), NASTY_TEXT.filter(bool),
                 st.integers(1, 3000).map(lambda n: ".".join(["a"] * n)))


def _maybe(draw, valid: str, odd: st.SearchStrategy[str], broken: bool) -> str:
    """The valid value, or when the example is to be broken, sometimes an odd one."""
    return draw(st.one_of(st.just(valid), odd)) if broken else valid


@st.composite
def spec_texts(draw) -> str:
    """The schema's own sections and keys with valid values (a dry run) or values of every kind and depth;
    sometimes junk."""
    if draw(st.integers(0, 9)) == 0:
        return draw(NASTY_TEXT)
    broken, lines = draw(st.booleans()), []
    sections = [*SCHEMA, "nosuch"] if broken else [name for name in SCHEMA if name != "parallel"]
    for section in draw(st.lists(st.sampled_from(sections), max_size=4, unique=True)):
        lines.append(f"[{section}]")
        for key in draw(st.lists(st.sampled_from(list(SCHEMA.get(section, ["x"]))), max_size=4, unique=True)):
            lines.append(f"{key} = {_maybe(draw, DEFAULTS.get(f'{section}.{key}', '1'), values, broken)}")
    return "\n".join(lines) + "\n"


@FUZZ
@given(text=spec_texts())
def test_any_spec_file_is_a_dry_run_or_one_line(place: Path, text: str) -> None:
    path = place / "spec.toml"
    path.write_text(text, errors="surrogatepass")
    _check_cli(*RUN, str(path))


@FUZZ
@given(sets=st.lists(st.one_of(st.sampled_from(list(DEFAULTS.items())), st.tuples(keys, st.one_of(values, NASTY_TEXT))),
                     min_size=1, max_size=3))
def test_any_override_is_a_dry_run_or_one_line(place: Path, sets: list[tuple[str, str]]) -> None:
    overrides = [f"--set={key}={value}" for key, value in sets]
    _check_cli(*RUN, str(place / "base.toml"), *overrides)


@st.composite
def sweep_texts(draw) -> str:
    """A valid sweep (a dry run) or one with odd settings, keys and values: long lists, deep ones, ranges."""
    broken = draw(st.booleans())
    method = draw(st.sampled_from(["grid", "zip", "random", "bayes"] if broken else ["grid", "zip", "random"]))
    lines = ["[sweep]", 'base = "base.toml"', f'method = "{method}"', 'dir = "/nonexistent/fuzz-sweep"']
    for key in draw(st.lists(st.sampled_from(list(SWEEP_DEFAULTS)), max_size=3, unique=True)):
        odd = values if key != "samples" else st.integers(-1, 10**7).map(str)
        lines.append(f"{key} = {_maybe(draw, SWEEP_DEFAULTS[key], odd, broken)}")
    lines.append("[params]")
    sweepable = [key for key in DOTTED if key.startswith(("model.", "train.", "data.", "job.seed"))]
    names = st.one_of(st.sampled_from(sweepable), keys) if broken else st.sampled_from(sweepable)
    for key in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        length = draw(st.integers(0, 40))
        items = draw(st.lists(scalars, min_size=length, max_size=length))
        odd = st.one_of(st.just("[" + ", ".join(items) + "]"), values,
                        st.sampled_from(["{uniform = [0, 1]}", "{log_uniform = [0, 1]}", "{uniform = 3}"]))
        lines.append(f"{toml_value(key)} = {_maybe(draw, '[' + DEFAULTS.get(key, '1') + ']', odd, broken)}")
    return "\n".join(lines) + "\n"


@FUZZ
@given(text=sweep_texts(), sets=st.lists(st.tuples(st.sampled_from(DOTTED), values), max_size=2))
def test_any_sweep_file_is_a_dry_run_or_one_line(place: Path, text: str, sets: list[tuple[str, str]]) -> None:
    path = place / "sweep.toml"
    path.write_text(text, errors="surrogatepass")
    _check_cli(*SWEEP, str(path), *(f"--set={key}={value}" for key, value in sets))

"""Sweep files and their expansion (pure, no processes), and a sweep run on local ranks.

The same sweeps as Slurm job arrays run in tests/test_submit.py.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc.cli.main import main
from hpc.config import apply_overrides
from hpc.errors import ConfigError
from slurm.sweep import as_overrides, config_count, expand, load_sweep, plan, read_manifest

REPO = Path(__file__).resolve().parent.parent
BASE = """
[job]
name = "digits"
[model]
hidden_sizes = [16]
[data]
batch_size = 32
[train]
steps = 20
log_every = 100
"""


def _sweep(tmp_path: Path, text: str) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


# Dotted keys and their value lists, as they come out of a [params] table.
params = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}\.[a-z]{1,6}", fullmatch=True),
    st.lists(st.integers(-5, 5), min_size=1, max_size=4),
    min_size=1, max_size=4,
)


def _params_toml(table: dict[str, list]) -> str:
    return "\n".join(f'"{key}" = {json.dumps(values)}' for key, values in table.items())


@given(table=params)
def test_grid_is_every_combination_once_the_last_key_fastest(tmp_path_factory, table) -> None:
    path = _sweep(tmp_path_factory.mktemp("grid"), f'[sweep]\nbase = "base.toml"\n[params]\n{_params_toml(table)}')
    configs = expand(load_sweep(path))
    assert configs == [dict(zip(table, combo, strict=True)) for combo in itertools.product(*table.values())]
    assert len(configs) == math.prod(len(v) for v in table.values())


@given(table=params.filter(lambda t: len({len(v) for v in t.values()}) == 1))
def test_zip_pairs_the_lists(tmp_path_factory, table) -> None:
    path = _sweep(tmp_path_factory.mktemp("zip"),
                  f'[sweep]\nbase = "base.toml"\nmethod = "zip"\n[params]\n{_params_toml(table)}')
    configs = expand(load_sweep(path))
    length = len(next(iter(table.values())))
    assert configs == [{key: values[i] for key, values in table.items()} for i in range(length)]


@given(seed=st.integers(0, 2**32), samples=st.integers(1, 20))
def test_random_is_seeded_and_stays_in_its_lists_and_ranges(tmp_path_factory, seed, samples) -> None:
    text = (f'[sweep]\nbase = "base.toml"\nmethod = "random"\nseed = {seed}\nsamples = {samples}\n[params]\n'
            '"train.optimizer" = ["sgd", "adam"]\n"train.lr" = {log_uniform = [1e-4, 1e-1]}\n'
            '[params.train]\nmomentum = {uniform = [0.0, 0.9]}\n')
    sweep = load_sweep(_sweep(tmp_path_factory.mktemp("random"), text))
    configs = expand(sweep)
    assert configs == expand(sweep), "not reproducible"
    assert len(configs) == samples
    for config in configs:
        assert list(config) == ["train.optimizer", "train.lr", "train.momentum"]  # nested tables become dotted keys
        assert config["train.optimizer"] in ("sgd", "adam")
        assert 1e-4 <= config["train.lr"] <= 1e-1 and 0.0 <= config["train.momentum"] <= 0.9


json_values = st.recursive(
    st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.booleans() | st.text(),
    lambda inner: st.lists(inner, max_size=3), max_leaves=6,
)


@given(value=json_values)
def test_overrides_give_back_the_value_the_config_holds(value) -> None:
    (override,) = as_overrides({"a.b": value})
    assert apply_overrides({}, [override]) == {"a": {"b": value}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[params]\n"train.lr" = [0.1]', "sweep.base must name the job spec"),
        ('[sweep]\nbase = "base.toml"', "[params] is empty"),
        ('[sweep]\nbase = "base.toml"\nmethod = "bayes"\n[params]\n"train.lr" = [0.1]',
         "sweep.method must be one of grid, random, zip; got 'bayes'"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"slurm.nodes" = [1, 2]', "slurm.nodes is set by the sweep itself"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"job.name" = ["a"]', "job.name is set by the sweep itself"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"train.lr" = {uniform = [0, 1]}', 'range needs method = "random"'),
        ('[sweep]\nbase = "base.toml"\nmethod = "random"\n[params]\n"train.lr" = {log_uniform = [0, 1]}',
         "log_uniform takes [low, high] with 0 < low < high, got [0, 1]"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"train.lr" = []', "expected a non-empty list"),
        ('[sweep]\nbase = "base.toml"\nmethod = "zip"\n[params]\n"train.lr" = [1, 2]\n"train.steps" = [3]',
         "zip needs lists of one length, got train.lr: 2, train.steps: 1"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"train.lr" = [0.1]\n[grid]\n', "unknown table grid"),
        # issue 16: deep, odd or hostile input
        ('[sweep]\nbase = "base.toml"\n[params' + ".a" * 3000 + ']\n"x" = [1]\n', "nested more than 32 deep"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"train.lr" = [' + "[" * 3000 + "]" * 3000 + "]\n",
         "line 4: arrays and inline tables nested more than 32 deep"),
        ('params = 3\n[sweep]\nbase = "base.toml"\n', "params must be a table of dotted keys, got 3"),
        ('[sweep]\nbase = "base.toml"\n[params]\n"train.lr\\n" = 3\n', "params.'train.lr\\n': expected"),
        ('[sweep]\nbase = "base.toml"\nname = "a\\u0000b"\n[params]\n"train.lr" = [1]\n',
         "sweep.name must not contain control characters (NUL, newline, tab, ...), got 'a\\x00b'"),
        ('[sweep]\nbase = "base.toml"\ndir = "x\\nb"\n[params]\n"train.lr" = [1]\n',
         "sweep.dir must not contain control characters"),
    ],
)
def test_a_bad_sweep_file_is_one_line_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = _sweep(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        load_sweep(path)
    assert str(raised.value).startswith(str(path)) and message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_each_config_is_checked_against_the_base_spec_before_anything_runs(tmp_path: Path) -> None:
    path = _sweep(tmp_path, '[sweep]\nbase = "base.toml"\n[params]\n"train.lr" = [0.1, -1.0]')
    with pytest.raises(ConfigError, match=r"config 1 \(train.lr=-1.0\): .*train.lr must be > 0, got -1.0"):
        plan(load_sweep(path))
    path = _sweep(tmp_path, '[sweep]\nbase = "base.toml"\n[params]\n"train.lrr" = [0.1]')
    with pytest.raises(ConfigError, match=r"unknown key train.lrr \(did you mean train.lr\?"):
        plan(load_sweep(path))


def test_a_set_of_a_swept_key_is_refused_not_dropped(tmp_path: Path) -> None:
    """Each task's own value came after the --set, which silently lost; a key not swept is still taken."""
    path = _sweep(tmp_path, '[sweep]\nbase = "base.toml"\n[params]\n"train.lr" = [0.1, 0.2]')
    with pytest.raises(ConfigError) as refused:
        plan(load_sweep(path), ["train.lr=0.5"])
    assert str(refused.value) == (f"--set train.lr=0.5: {path} sweeps train.lr (params.train.lr), which would replace "
                                  "this value in every task: drop the --set, or the key from [params]")
    _, planned = plan(load_sweep(path), ["train.steps=5"])
    assert [(spec.train.steps, spec.train.lr) for _, spec in planned] == [(5, 0.1), (5, 0.2)]


def test_every_task_gets_its_own_run_directory_under_the_sweep(tmp_path: Path) -> None:
    path = _sweep(tmp_path, '[sweep]\nbase = "base.toml"\nname = "lr"\n[params]\n"train.lr" = [0.1, 0.2]')
    directory, planned = plan(load_sweep(path), [f"job.run_dir={tmp_path / 'runs'}"])
    assert directory == tmp_path / "runs" / "lr"
    assert [spec.run_path for _, spec in planned] == [directory / "task-000", directory / "task-001"]
    assert [spec.train.lr for _, spec in planned] == [0.1, 0.2]
    assert [task.run_path for task, _ in planned] == [spec.run_path for _, spec in planned]


# Task 1 cannot start: its checkpoint to resume from does not exist (found only when it runs).
FAILING_SWEEP = """
[sweep]
base = "base.toml"
name = "one-fails"
method = "zip"
[params]
"train.lr" = [0.1, 0.1]
"checkpoint.resume" = ["auto", "/no/such/checkpoint"]
"""


def _final_loss(world, spec_path: str, overrides: list[str]) -> float:
    """The single-process reference: the training loop called directly."""
    from hpc.config import load_spec
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    result, _ = train(load_spec(spec_path, overrides), world, build_mesh(resolve_layout("auto", 1, 1, 1), 0))
    return result.final_loss


@pytest.mark.slow
def test_local_executor_runs_every_config_and_marks_the_failed_one(tmp_path: Path) -> None:
    from tests.ranks import run_ranks

    path = _sweep(tmp_path, FAILING_SWEEP)
    runs = tmp_path / "runs"
    argv = [sys.executable, "-m", "hpc.cli.main", "sweep", str(path), "--executor", "local",
            "--set", f"job.run_dir={runs}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per rank, as the reference
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert done.returncode == 1, done.stderr  # a failed task makes the sweep fail
    cause = "failed: CheckpointError: checkpoint.resume=/no/such/checkpoint: no complete checkpoint there"
    traceback = runs / "one-fails" / "task-001" / "failures" / "rank-00000.traceback"
    assert re.search(rf"task 1 failed: rank 0 \(host \S+\) {cause} \(traceback: {traceback}\); rank 0 \(host \S+\) "
                     "exited with code 1\n", done.stderr), done.stderr
    manifest = read_manifest(runs / "one-fails")
    assert [(t.get("state"), t["params"]["checkpoint.resume"]) for t in manifest["tasks"]] == [
        ("COMPLETED", "auto"), ("FAILED", "/no/such/checkpoint")]
    result = json.loads((runs / "one-fails" / "task-000" / "result.json").read_text())
    assert not (runs / "one-fails" / "task-001" / "result.json").exists()
    reference = run_ranks(1, _final_loss, str(tmp_path / "base.toml"), [f"job.run_dir={tmp_path / 'ref'}"])[0]
    assert result["final_loss"] == reference
    table = done.stdout[done.stdout.index("sweep one-fails (local ranks): 1 completed, 1 failed"):].splitlines()
    assert table[1].split() == ["TASK", "STATE", "train.lr", "checkpoint.resume", "STEP", "LOSS", "final_loss", "(min)"]
    assert table[2].split()[:2] == ["0", "COMPLETED"] and table[3].split()[:3] == ["1", "FAILED", "!"]
    assert re.fullmatch(rf"task 1: rank 0 \(host \S+\) {cause} -- see: {traceback}", table[4]), table


# --- input limits (issue 16) -----------------------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("\n".join(f'"train.x{i}" = [{", ".join(["1"] * 10)}]' for i in range(10)),
         "grid makes 10000000000 configs, more than the limit of 1000 (MAX_SWEEP_CONFIGS"),
        ('"train.lr" = [' + ", ".join(["0.1"] * 1001) + "]", "grid makes 1001 configs, more than the limit of 1000"),
    ],
)
def test_a_sweep_is_counted_before_it_is_expanded(tmp_path: Path, params: str, message: str) -> None:
    path = _sweep(tmp_path, f'[sweep]\nbase = "base.toml"\n[params]\n{params}\n')
    with pytest.raises(ConfigError) as raised:
        load_sweep(path)
    assert str(raised.value).startswith(f"{path}: {message}") and "\n" not in str(raised.value)


def test_random_samples_are_capped_in_the_sweep_table(tmp_path: Path) -> None:
    path = _sweep(tmp_path, '[sweep]\nbase = "base.toml"\nmethod = "random"\nsamples = 1000000\n[params]\n'
                            '"train.lr" = [0.1]\n')
    with pytest.raises(ConfigError, match=r"sweep.samples must be <= 1000, got 1000000$"):
        load_sweep(path)


@given(table=params, method=st.sampled_from(["grid", "zip", "random"]), samples=st.integers(1, 30))
def test_the_count_is_the_number_of_configs(tmp_path_factory, table, method, samples) -> None:
    if method == "zip":
        table = {key: values[:1] for key, values in table.items()}
    text = f'[sweep]\nbase = "base.toml"\nmethod = "{method}"\nsamples = {samples}\n[params]\n{_params_toml(table)}'
    sweep = load_sweep(_sweep(tmp_path_factory.mktemp("count"), text))
    assert config_count(sweep) == len(expand(sweep))


def test_a_sweep_file_that_is_a_pipe_or_a_device_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "sweep.toml"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with pytest.raises(ConfigError, match="not a regular file: a sweep file must be a TOML file"):
            load_sweep(path)


toml_values = st.recursive(
    st.integers(-(2**63), 2**63 - 1) | st.floats() | st.booleans() | st.text() | st.dates()
    | st.times().map(lambda t: t.replace(fold=0)) | st.datetimes().map(lambda t: t.replace(fold=0)),  # as TOML reads
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=6,
)


@given(value=toml_values)
def test_every_toml_value_a_sweep_may_hold_comes_back_through_an_override(value) -> None:
    """Dates, inline tables, inf and nan too: JSON would write them as text TOML cannot read."""
    (override,) = as_overrides({"a.b": value})
    back = apply_overrides({}, [override])["a"]["b"]
    assert repr(back) == repr(value)  # nan != nan, but its repr is stable


def _sweep_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A local sweep's directory with one task, and that task's run directory."""
    run = tmp_path / "sweep" / "task-000"
    run.mkdir(parents=True)
    manifest = {"name": "s", "source": "s.toml", "base": "base.toml", "executor": "local", "job_id": None, "ranks": 1,
                "settings": {"metric": "final_loss", "goal": "min"},
                "tasks": [{"index": 0, "params": {"train.lr": 0.1}, "run_path": str(run), "overrides": [], "args": []}]}
    (tmp_path / "sweep" / "sweep.json").write_text(json.dumps(manifest))
    return tmp_path / "sweep", run


@pytest.mark.parametrize(("manifest", "problem"), [
    ("garbage", "Expecting value: line 1 column 1 (char 0)"), ("[]", "not a JSON object"), ("{}", "no name"),
    ('{"name": "s", "job_id": null, "settings": {}, "tasks": []}', "settings lacks its metric or goal"),
    ('{"name": "s", "job_id": 12, "settings": {}, "tasks": []}', "job_id has type int"),
    ('{"name": "s", "job_id": null, "settings": {"metric": "m", "goal": "min"}, "tasks": [{"index": 0}]}',
     "task 0 lacks its index, params or run_path"),
])
def test_a_damaged_sweep_record_is_one_line_naming_it(tmp_path: Path, capsys, manifest: str, problem: str) -> None:
    directory, _ = _sweep_dir(tmp_path)
    (directory / "sweep.json").write_text(manifest)
    for action in ("status", "results"):
        assert main(["sweep", action, str(directory)]) == 2
        assert capsys.readouterr().err == (f"hpc: error: {directory / 'sweep.json'}: not a sweep record hpc sweep "
                                           f"wrote ({problem})\n")


@pytest.mark.parametrize(("result", "message"), [
    ("garbage", "{run}/result.json: not a result hpc wrote (Expecting value: line 1 column 1 (char 0))"),
    ("[1]", "{run}/result.json: not a result hpc wrote (not a JSON object)"),
    ('{"final_loss": "abc"}', "sweep.metric 'final_loss' in {run}/result.json is not a number: 'abc'"),
    ('{"loss": 1.0}', "sweep.metric 'final_loss' is not in {run}/result.json (it has loss)"),
])
def test_a_damaged_task_result_is_one_line_naming_it(tmp_path: Path, capsys, result: str, message: str) -> None:
    directory, run = _sweep_dir(tmp_path)
    (run / "result.json").write_text(result)
    assert main(["sweep", "results", str(directory)]) == 2
    assert capsys.readouterr().err == f"hpc: error: {message.format(run=run)}\n"
    (run / "result.json").write_text('{"final_loss": 0.5}')
    assert main(["sweep", "results", str(directory)]) == 0
    assert "0.5" in capsys.readouterr().out

"""Sweeps: a base job spec plus a search over dotted keys, expanded into configs, one run directory each.

A sweep file (``jobs/examples/sweep.toml``)::

    [sweep]
    base = "mlp.toml"          # the job spec, relative to this file
    method = "grid"            # grid | random | zip
    metric = "final_loss"      # a key of each task's result.json; goal = "min" or "max"
    max_concurrent = 2         # array tasks running at once

    [params]
    "train.lr" = [0.1, 0.05]
    "model.hidden_sizes" = [[64], [128, 64]]
    "train.momentum" = {uniform = [0.0, 0.9]}   # random only: uniform, log_uniform

grid is the product of the lists (the last key varies fastest), zip pairs them up, random
draws ``samples`` configs with ``random.Random(seed)``: one item of a list, or a value of a
range. :func:`expand` is pure. Config i runs as the base spec with its values as ``--set``
overrides in ``DIR/task-i`` (``job.run_dir`` and ``job.name`` are the sweep's), where the
ranks write ``metrics.jsonl`` and ``result.json``. ``DIR/sweep.json`` records the configs,
the executor and the array's job id; ``hpc sweep status|results DIR`` read it, the result
files and, for Slurm, sacct.

The base may be your own training script instead (``base = "train.py"``, see hpc/script.py):
then each key of ``[params]`` is one of the options the script declares with argparse
(``"lr" = [0.1, 0.02]`` passes ``--lr 0.1``; a list value passes its items after the option,
``true`` the bare flag, ``false`` nothing), read from its source (:func:`script_options`), and
the file may hold the script's resources as ``[slurm]`` and ``[job]`` (``run_dir`` only) tables.
Task i runs the script with ``HPC_RUN_PATH=DIR/task-i``.

Running one (``hpc sweep``): a :class:`SweepRun` holds every task checked and what each runs (the CLI, the
composition root, passes in the srun tasks' entry point and the layout check: slurm imports neither jobs nor the
CLI); :func:`submit_sweep` submits it as one job array, :func:`run_locally` one task after the other on local
ranks; both record the manifest, which :func:`report` and :func:`metric_points` read back.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import itertools
import json
import math
import os
import random
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.config import (
    MAX_SWEEP_CONFIGS,
    JobSpec,
    SweepConfig,
    load_spec,
    read_toml,
    show_path,
    show_text,
    show_value,
    table_from_dict,
)
from hpc.errors import ConfigError, RankFailedError
from hpc.rundir import RESULT_FILE, last_metrics, read_failures, read_result, summarize_failures, write_json
from slurm.job_registry import FAILED_STATES, JobLookupError, JobRecord, Registry, failure_line, sacct_states
from slurm.submit import check_resources, job_ranks, make_executor, rank_argv, submit_array

MANIFEST = "sweep.json"
DISTRIBUTIONS = ("uniform", "log_uniform")
RESERVED = ("job.name", "job.run_dir")  # each task's own run directory
SCRIPT_TABLES = ("slurm", "job")  # a script's resources, in a sweep file whose base is a script
MAX_SCRIPT_BYTES = 16 << 20  # a script read for its options


@dataclass(frozen=True)
class Sweep:
    settings: SweepConfig
    params: tuple[tuple[str, Any], ...]  # (dotted key, list of values or {distribution: [low, high]})
    source: Path  # the sweep file
    resources: Mapping[str, Any] = field(default_factory=dict)  # a script base's [slurm] and [job] tables

    @property
    def script(self) -> bool:
        """Whether the base is a training script (its options are swept) rather than a job spec."""
        return self.settings.base.endswith(".py")

    @property
    def base(self) -> Path:
        # realpath, not Path.resolve: a symlink loop is then the spec's "cannot read", not a RuntimeError.
        return Path(os.path.realpath(self.source.parent / self.settings.base))

    @property
    def name(self) -> str:
        return self.settings.name or self.source.stem

    @property
    def label(self) -> str:
        """The sweep file as errors name it: one short line, whatever the file is called."""
        return show_path(self.source)


@dataclass(frozen=True)
class Task:
    index: int
    params: dict[str, Any]
    run_path: Path
    overrides: tuple[str, ...]  # every --set of the task, the sweep's own included
    args: tuple[str, ...] = ()  # a script base's arguments for the task


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (the configs themselves are checked against the base spec by :func:`plan`)."""
    source = Path(path)
    label = show_path(source)
    data = read_toml(source, "sweep file")
    settings = table_from_dict(SweepConfig, data.get("sweep", {}), "sweep", label)
    valid = ("sweep", "params", *(SCRIPT_TABLES if settings.base.endswith(".py") else ()))
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"{label}: unknown table {show_text(unknown[0])} (valid: {', '.join(valid)})")
    if not settings.base:
        raise ConfigError(f"{label}: sweep.base must name the job spec (or the script) to start from")
    if not isinstance(data.get("params", {}), dict):
        raise ConfigError(f"{label}: params must be a table of dotted keys, got {show_value(data['params'])}")
    params = tuple(_flatten(data.get("params", {})))
    if not params:
        raise ConfigError(f"{label}: [params] is empty: nothing to search")
    for key, values in params:
        _check_param(label, settings.method, key, values)
    if settings.method == "zip" and len({len(values) for _, values in params}) > 1:
        lengths = ", ".join(f"{key}: {len(values)}" for key, values in params)
        raise ConfigError(f"{label}: zip needs lists of one length, got {show_text(lengths, 200)}")
    sweep = Sweep(settings, params, source, {name: data[name] for name in SCRIPT_TABLES if name in data})
    count = config_count(sweep)
    if count > MAX_SWEEP_CONFIGS:
        raise ConfigError(f"{label}: {settings.method} makes {count} configs, more than the limit of "
                          f"{MAX_SWEEP_CONFIGS} (MAX_SWEEP_CONFIGS: a Slurm job array's default MaxArraySize "
                          "is 1001); split the sweep")
    return sweep


def config_count(sweep: Sweep) -> int:
    """How many configs :func:`expand` makes, counted without making them (a grid multiplies quickly)."""
    method = sweep.settings.method
    if method == "random":
        return sweep.settings.samples
    lengths = [len(values) for _, values in sweep.params]
    return math.prod(lengths) if method == "grid" else min(lengths)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``"train.lr" = [...]`` and ``[params.train] lr = [...]`` alike, as dotted keys."""
    for key, value in table.items():
        if isinstance(value, dict) and not (len(value) == 1 and next(iter(value)) in DISTRIBUTIONS):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_param(source: str, method: str, key: str, values: Any) -> None:
    where = f"{source}: params.{show_text(key)}"
    if key.startswith("slurm.") or key in RESERVED:
        raise ConfigError(f"{where}: {show_text(key)} is set by the sweep itself (every array task gets the same "
                          "resources and its own run directory)")
    if isinstance(values, dict):
        (kind, bounds), = values.items()
        if method != "random":
            raise ConfigError(f"{where}: a {kind} range needs method = \"random\" ({method} takes lists)")
        numbers = isinstance(bounds, list) and len(bounds) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
        if not numbers or not bounds[0] < bounds[1] or (kind == "log_uniform" and bounds[0] <= 0):
            low = "0 < low" if kind == "log_uniform" else "low"
            raise ConfigError(f"{where}: {kind} takes [low, high] with {low} < high, got {show_value(bounds)}")
    elif not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: expected a non-empty list of values or, for random, "
                          f"{{uniform = [low, high]}} or {{log_uniform = [low, high]}}; got {show_value(values)}")


def expand(sweep: Sweep) -> list[dict[str, Any]]:
    """Every config of the sweep, as {dotted key: value}, in a fixed order."""
    keys = [key for key, _ in sweep.params]
    values = [value for _, value in sweep.params]
    method = sweep.settings.method
    if method == "grid":
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
    if method == "zip":
        return [dict(zip(keys, combo, strict=True)) for combo in zip(*values, strict=True)]
    rng = random.Random(sweep.settings.seed)
    return [{key: _draw(value, rng) for key, value in sweep.params} for _ in range(sweep.settings.samples)]


def _draw(values: Any, rng: random.Random) -> Any:
    if isinstance(values, list):
        return rng.choice(values)
    (kind, (low, high)), = values.items()
    if kind == "log_uniform":
        return math.exp(rng.uniform(math.log(low), math.log(high)))
    return rng.uniform(low, high)


def as_overrides(config: Mapping[str, Any]) -> list[str]:
    """``--set`` strings, whose values hpc.config reads back as TOML."""
    return [f"{key}={toml_value(value)}" for key, value in config.items()]


def toml_value(value: Any) -> str:
    """A TOML literal. Hand-written because JSON, TOML for numbers, booleans and lists, writes strings
    TOML rejects (characters past U+FFFF as surrogate pairs, DEL unescaped); tomli-w is no dependency of ours.
    Whatever a sweep file may hold comes back: inline tables, dates and times, inf and nan."""
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(ch, ch) for ch in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_value(str(key))} = {toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # inf, -inf, nan: TOML's spelling, not JSON's Infinity
    return json.dumps(value)


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", **{chr(c): f"\\u{c:04x}" for c in (*range(0x20), 0x7F)}}


def plan(sweep: Sweep, overrides: Sequence[str] = ()) -> tuple[Path, list[tuple[Task, JobSpec]]]:
    """The sweep directory and every task with its spec, each config checked against the base spec.

    ``overrides`` (``hpc sweep --set``) apply to every task, before its own values.
    """
    swept = {key for key, _ in sweep.params}
    for override in overrides:  # the task's own values come after: a --set of a swept key would be dropped
        key = override.partition("=")[0].strip()
        if key in swept:
            raise ConfigError(f"--set {show_text(override)}: {sweep.label} sweeps {key} (params.{key}), which would "
                              "replace this value in every task: drop the --set, or the key from [params]")
    base = load_spec(sweep.base, overrides)
    directory = Path(sweep.settings.dir or Path(base.job.run_dir) / sweep.name).absolute()
    configs = expand(sweep)
    width = max(3, len(str(len(configs) - 1)))
    planned = []
    for index, config in enumerate(configs):
        run_path = directory / f"task-{index:0{width}d}"
        own = as_overrides({**config, "job.run_dir": str(directory), "job.name": run_path.name})
        task = Task(index, config, run_path, (*overrides, *own))
        try:
            spec = load_spec(sweep.base, task.overrides)
        except ConfigError as exc:
            raise ConfigError(f"{sweep.label}: config {index} ({show_text(_describe(config), 200)}): {exc}") from None
        planned.append((task, spec))
    return directory, planned


def plan_script(
    sweep: Sweep, run_dir: str, options: Collection[str], args: Sequence[str] = ()
) -> tuple[Path, list[Task]]:
    """The sweep directory and every task of a script sweep: ``args`` (``hpc sweep ... -- ARGS``), then the
    config as options; every key must be one of the script's ``options``."""
    for key, _ in sweep.params:
        if _option(key) not in options:
            declared = ", ".join(sorted(options)) or "none: it declares no argparse options"
            raise ConfigError(f"{sweep.label}: params.{show_text(key)}: {_option(key)} is not an option of "
                              f"{show_path(sweep.base)} (its options: {show_text(declared, 200)})")
    directory = Path(sweep.settings.dir or Path(run_dir) / sweep.name).absolute()
    configs = expand(sweep)
    width = max(3, len(str(len(configs) - 1)))
    tasks = [Task(index, config, directory / f"task-{index:0{width}d}", (), (*args, *option_args(sweep, config)))
             for index, config in enumerate(configs)]
    return directory, tasks


def _option(key: str) -> str:
    return key if key.startswith("-") else f"--{key}"


def option_args(sweep: Sweep, config: Mapping[str, Any]) -> list[str]:
    """A config as a script's arguments: ``--key value``, a list's items after ``--key``, a bare flag for true."""
    argv: list[str] = []
    for key, value in config.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(item, (dict, list)) for item in values):
            raise ConfigError(f"{sweep.label}: params.{show_text(key)}: a script option takes numbers, strings, "
                              f"booleans or a list of them, got {show_value(value)}")
        if value is True or value is False:
            argv += [_option(key)] if value else []
        else:
            argv += [_option(key), *(str(item) for item in values)]
    return argv


def script_options(path: Path) -> set[str]:
    """The option strings a script declares with argparse (``add_argument("--lr", ...)``), read from its source
    without running it."""
    label = show_path(path)
    try:
        with open(path, "rb") as handle:
            source = handle.read(MAX_SCRIPT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"script {label}: cannot read it: {exc.strerror}") from None
    if len(source) > MAX_SCRIPT_BYTES:
        raise ConfigError(f"script {label}: larger than {MAX_SCRIPT_BYTES >> 20} MiB")
    try:
        tree = ast.parse(source, label)
    except (SyntaxError, ValueError) as exc:
        where = f" at line {exc.lineno}" if getattr(exc, "lineno", None) else ""
        raise ConfigError(f"script {label}: not valid Python{where}") from None
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            and arg.value.startswith("-")}


def _describe(config: Mapping[str, Any]) -> str:
    return ", ".join(as_overrides(config))


@dataclass(frozen=True)
class SweepRun:
    """A sweep ready to start, every check passed but Slurm's submission: its tasks, the resources each gets, what
    each array task's ranks call (``entry(argvs[i])``) and each task's command line on local ranks."""

    sweep: Sweep
    directory: Path
    tasks: list[Task]
    resources: JobSpec  # slurm.* and job.*: every task's
    entry: Callable[[list[str]], None]  # what every srun task calls (submitit pickles a reference to it)
    argvs: list[list[str]]
    commands: list[tuple[str, ...]]

    @property
    def ranks(self) -> int:
        return job_ranks(self.resources.slurm)


def spec_run(sweep: Sweep, overrides: Sequence[str], entry: Callable[[list[str]], None],
             check_layout: Callable[[JobSpec, int], object], ask_slurm: bool) -> SweepRun:
    """A sweep over a job spec, its ranks running ``hpc-rank`` (``entry`` in a Slurm task): each config checked
    against the spec and by ``check_layout`` on the ranks every task gets, and the resources by Slurm when
    ``ask_slurm``."""
    directory, planned = plan(sweep, overrides)
    resources = planned[0][1]  # slurm.* is never swept: every task has the same resources
    if ask_slurm:
        check_resources(resources.slurm)
    for task, spec in planned:
        try:
            check_layout(spec, job_ranks(resources.slurm))
        except ConfigError as exc:
            raise type(exc)(f"{sweep.label}: config {task.index}: {exc}") from None
    tasks = [task for task, _ in planned]
    argvs = [rank_argv(str(sweep.base), task.overrides) for task in tasks]
    return SweepRun(sweep, directory, tasks, resources, entry, argvs,
                    [(sys.executable, "-m", "hpc.cli.rank", *argv) for argv in argvs])


def check_fresh(directory: Path) -> None:
    """Refuse to run a sweep into a directory that holds one."""
    if (directory / MANIFEST).exists():
        raise ConfigError(f"{directory} already holds a sweep: remove it, or give this one another sweep.name or "
                          "sweep.dir")


def array_executor(run: SweepRun):
    """submitit's executor of the sweep's job array: logs in DIR/slurm, at most ``max_concurrent`` tasks at once."""
    return make_executor(run.directory / "slurm", run.resources.slurm, run.sweep.name,
                         array_parallelism=run.sweep.settings.max_concurrent)


def submit_sweep(run: SweepRun, executor) -> str:
    """Every task as one job array, then the manifest and the job registry's record; the array's job id."""
    job_id = submit_array(executor, run.entry, run.argvs)
    write_manifest(run.directory, run.sweep, run.tasks, "slurm", run.ranks, job_id)
    Registry.default().add(JobRecord(job_id, run.sweep.name, run.ranks, str(run.directory / "slurm"),
                                     tuple(str(task.run_path) for task in run.tasks), array=True))
    return job_id


def run_locally(run: SweepRun, started: Callable[[Task], None],
                failed: Callable[[Task, RankFailedError], None]) -> None:
    """One task after the other, each on ``run.ranks`` local ranks exactly as ``hpc run --launcher local``, its
    outcome recorded in the manifest; ``started`` hears of each task before it starts, ``failed`` of each failure."""
    from hpc.runtime.launch import launch_ranks

    write_manifest(run.directory, run.sweep, run.tasks, "local", run.ranks)
    for task, argv in zip(run.tasks, run.commands, strict=True):
        started(task)
        try:
            launch_ranks(run.ranks, argv, "local", [], None, "plain", False, task.run_path)
        except RankFailedError as exc:
            record_outcome(run.directory, task.index, "FAILED", str(exc))
            failed(task, exc)
        else:
            record_outcome(run.directory, task.index, "COMPLETED")


def describe(task: Task) -> str:
    """A task's own arguments: a script's, or its config as ``--set`` overrides."""
    return " ".join(task.args or as_overrides(task.params))


def write_manifest(directory: Path, sweep: Sweep, tasks: Sequence[Task], executor: str, ranks: int,
                   job_id: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / MANIFEST, {
        "name": sweep.name, "source": str(sweep.source.resolve()), "base": str(sweep.base),
        "settings": dataclasses.asdict(sweep.settings), "executor": executor, "job_id": job_id, "ranks": ranks,
        "tasks": [{"index": t.index, "params": t.params, "run_path": str(t.run_path), "overrides": list(t.overrides),
                   "args": list(t.args)} for t in tasks],
    })


def read_manifest(directory: str | Path) -> dict:
    """``write_manifest``'s record; one line naming the file where it is damaged or not ours."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise ConfigError(f"{directory}: not a sweep directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
        problem = _manifest_problem(manifest)
    except (OSError, ValueError) as exc:
        problem = " ".join(str(exc).split())[:120]
    if problem:
        raise ConfigError(f"{path}: not a sweep record hpc sweep wrote ({problem})")
    return manifest


def _manifest_problem(manifest: object) -> str:
    """What the readers of a manifest rely on and it lacks, or ""."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    for key, kinds in (("name", str), ("job_id", (str, type(None))), ("settings", dict), ("tasks", list)):
        if not isinstance(manifest.get(key, 0), kinds):
            return f"no {key}" if key not in manifest else f"{key} has type {type(manifest[key]).__name__}"
    if not all(isinstance(manifest["settings"].get(key), str) for key in ("metric", "goal")):
        return "settings lacks its metric or goal"
    for position, task in enumerate(manifest["tasks"]):
        if not (isinstance(task, dict) and task.get("index") == position and isinstance(task.get("params"), dict)
                and isinstance(task.get("run_path"), str)):
            return f"task {position} lacks its index, params or run_path"
    return ""


def record_outcome(directory: Path, index: int, state: str, error: str | None = None) -> None:
    """What the local executor learnt about task ``index`` (Slurm's tasks are in sacct)."""
    manifest = read_manifest(directory)
    manifest["tasks"][index].update({"state": state, "error": error})
    write_json(directory / MANIFEST, manifest)


def task_states(manifest: Mapping[str, Any], sacct: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Each task's state: sacct's for an array task, else what the local executor recorded, else from its files."""
    job_id, states = manifest["job_id"], []
    for task in manifest["tasks"]:
        known = sacct.get(f"{job_id}_{task['index']}", {}).get("State") if job_id else task.get("state")
        states.append(known or ("COMPLETED" if read_result(Path(task["run_path"])) else "PENDING"))
    return states


def failure_lines(manifest: Mapping[str, Any], states: Sequence[str]) -> list[str]:
    """For each failed task, the first rank that failed for a reason of its own (hpc/runtime/abort.py) and where to
    read more: ``hpc logs`` of its array task, or the traceback a local task's rank left in its run directory."""
    job_id, lines = manifest["job_id"], []
    log_dir = _log_dir(job_id) if job_id else None
    for task, state in zip(manifest["tasks"], states, strict=True):
        if state not in FAILED_STATES:
            continue
        index, run_path = task["index"], Path(task["run_path"])
        if job_id:
            line = failure_line(f"{job_id}_{index}", run_path, f"task {index} (job {job_id}_{index})", log_dir)
        elif summary := summarize_failures(read_failures(run_path)):
            line = f"task {index}: {summary.text}" + (f" -- see: {summary.traceback}" if summary.traceback else "")
        else:
            line = f"task {index}: {task['error']}" if task.get("error") else None
        lines += [line] if line else []
    return lines


def _log_dir(job_id: str) -> str | None:
    """Where the job array's logs are (srun's lines name the tasks that died without a record), as the registry of
    the machine that submitted it says; None elsewhere."""
    try:
        return Registry.default().get(job_id).log_dir
    except (JobLookupError, OSError, ValueError, TypeError, KeyError):
        return None


def table(manifest: Mapping[str, Any], states: Sequence[str], ranked: bool) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per task; ranked: completed tasks best first by the metric, the rest after."""
    metric, goal = manifest["settings"]["metric"], manifest["settings"]["goal"]
    keys = list(manifest["tasks"][0]["params"]) if manifest["tasks"] else []
    rows = []
    for task, state in zip(manifest["tasks"], states, strict=True):
        run_path = Path(task["run_path"])
        result = read_result(run_path) or {}
        metrics = last_metrics(run_path) or {}
        value = _metric_of(result, metric, run_path)
        marked = f"{state} !" if state in FAILED_STATES else state
        cells = [task["index"], marked, *(toml_value(task["params"][k]) for k in keys),
                 metrics.get("step", "-"), _number(metrics.get("loss")), _number(value)]
        rows.append((value, task["index"], [str(c) for c in cells]))
    if ranked:
        sign = 1 if goal == "min" else -1
        rows.sort(key=lambda r: (r[0] is None, sign * r[0] if r[0] is not None else 0, r[1]))
    header = ["TASK", "STATE", *keys, "STEP", "LOSS", f"{metric} ({goal})"]
    return header, [cells for _, _, cells in rows]


def _metric_of(result: Mapping[str, Any], metric: str, run_path: Path) -> float | None:
    """A task's ``sweep.metric`` from its result (None: no result yet); one line where it is missing or no number."""
    value = result.get(metric)
    if result and value is None:
        raise ConfigError(f"sweep.metric {metric!r} is not in {run_path / RESULT_FILE} "
                          f"(it has {', '.join(sorted(result))})")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"sweep.metric {metric!r} in {run_path / RESULT_FILE} is not a number: {str(value)[:60]!r}")
    return value


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


@dataclass(frozen=True)
class Report:
    """What ``hpc sweep status|results`` prints: a line of counts, the table, each failed task's first cause."""

    title: str
    header: list[str]
    rows: list[list[str]]
    failures: list[str]
    failed: bool  # a task failed: the command exits non-zero, so scripts notice


def report(directory: Path, ranked: bool) -> Report:
    """The sweep in ``directory`` now: sacct's states of its array tasks (or the local executor's), ``ranked``:
    completed tasks best first by the metric."""
    manifest = read_manifest(directory)
    states = task_states(manifest, sacct_states([manifest["job_id"]]) if manifest["job_id"] else {})
    header, rows = table(manifest, states, ranked)
    counts = ", ".join(f"{states.count(state)} {state.lower()}" for state in dict.fromkeys(states))
    where = f"job array {manifest['job_id']}" if manifest["job_id"] else "local ranks"
    return Report(f"sweep {manifest['name']} ({where}): {counts}", header, rows, failure_lines(manifest, states),
                  any(state in FAILED_STATES for state in states))


def metric_points(directory: Path) -> tuple[list[tuple[dict[str, Any], float]], str]:
    """(each task's params and its metric, over the tasks that have a result; the metric and its goal)."""
    manifest = read_manifest(directory)
    metric, goal = manifest["settings"]["metric"], manifest["settings"]["goal"]
    points = [(task["params"], _metric_of(result, metric, Path(task["run_path"]))) for task in manifest["tasks"]
              if (result := read_result(Path(task["run_path"]))) is not None]
    if not points:
        raise ConfigError(f"{directory}: no task has a result yet: nothing to plot")
    return points, f"{metric} ({goal})"

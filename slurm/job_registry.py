"""What ``hpc status``, ``hpc logs`` and ``hpc cancel`` need: submitted jobs, their Slurm states, their files.

Slurm knows a job's state but not where our job keeps its logs and metrics (sacct has no
output path, and comments are not stored by default), so ``hpc submit`` and ``hpc sweep``
record each job in a registry: one JSON file per job under ``$HPC_HOME/jobs`` (default
``~/.hpc/jobs``) on the submitting machine. States come from sacct, which keeps finished
jobs too (squeue forgets them within minutes); submitit's own sacct parser reads its output,
array ranges such as ``12_[3-5%2]`` included.

Run directories hold what the ranks write: ``metrics.jsonl`` (one line per step, rank 0),
``result.json`` (the final measures, written by ``hpc-rank`` when training ends) and
``failures/`` (why each failing rank failed, hpc/runtime/abort.py): ``hpc status`` and
``hpc logs`` lead with the first rank that failed for a reason of its own. A rank killed by a
signal (the out-of-memory killer, a segfault in a CUDA kernel) or ending in ``os._exit`` records
nothing; srun says which task ended so and how (``srun: error: vm: task 2: Killed``, in the
batch script's output, which is rank 0's log), and when no rank recorded a failure of its own that
line leads: ``rank 2 (host vm) was killed by SIGKILL (signal 9: often the out-of-memory killer)``.
sacct cannot say it: a step's ExitCode is one task's (srun's choice), not the task that died first.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hpc.errors import HpcError
from hpc.observe.report import straggler_rows
from hpc.rundir import METRICS_FILE, death_record, last_metrics, read_failures, summarize_failures, write_json

SACCT_FIELDS = ("JobID", "JobName", "State", "Elapsed", "NodeList", "ExitCode")
DONE_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                         "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
FAILED_STATES = DONE_STATES - {"COMPLETED"}
# srun's report of tasks that ended badly: "srun: error: vm: task 2: Killed", "... tasks 0-1,3: Exited with exit code 1"
SRUN_TASKS_ENDED = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+?)(?: \(core dumped\))?\s*$", re.M)
SRUN_TASK_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
SRUN_EXITED = re.compile(r"Exited with exit code (\d+)")
ATTEMPT_START = "Starting with JobEnvironment("  # submitit's first line in each task's log (rank 0's: the batch log)
LOG_TAIL_BYTES = 1 << 18  # srun's lines come last in the batch log
RESTARTS_FILE = "restarts.jsonl"  # slurm/restart.py's decisions, one JSON line each, in the run directory


class JobLookupError(HpcError):
    """A job id that was not submitted from here, or a Slurm command that failed."""


@dataclass(frozen=True)
class JobRecord:
    """One submission: a job, or a job array whose task i runs in ``run_paths[i]``."""

    job_id: str
    name: str
    ranks: int  # per task
    log_dir: str
    run_paths: tuple[str, ...]
    array: bool = False

    def run_path(self, job_id: str) -> Path:
        """The run directory of ``job_id``: this job, or one task ``A_T`` of this array."""
        _, _, task = job_id.partition("_")
        if self.array != bool(task):
            wanted = f"a task of array {self.job_id}, e.g. {self.job_id}_0" if self.array else f"job {self.job_id}"
            raise JobLookupError(f"{job_id}: name {wanted}")
        index = int(task) if task else 0
        if not 0 <= index < len(self.run_paths):
            raise JobLookupError(f"array {self.job_id} has tasks 0 to {len(self.run_paths) - 1}, not {task}")
        return Path(self.run_paths[index])

    def task_ids(self) -> list[str]:
        return [f"{self.job_id}_{i}" for i in range(len(self.run_paths))] if self.array else [self.job_id]


class Registry:
    """Jobs submitted from this machine, one JSON file each."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def default(cls, environ: Mapping[str, str] = os.environ) -> Registry:
        home = environ.get("HPC_HOME") or str(Path("~/.hpc").expanduser())
        return cls(Path(home) / "jobs")

    def add(self, record: JobRecord) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json(self.root / f"{record.job_id}.json", dataclasses.asdict(record))

    def get(self, job_id: str) -> JobRecord:
        """The record of a job id, or of the array an ``A_T`` task id belongs to."""
        base = job_id.partition("_")[0]
        path = self.root / f"{base}.json"
        if not base.isdigit() or not path.exists():
            raise JobLookupError(f"job {job_id} was not submitted with hpc submit or hpc sweep from here "
                                 f"(no record in {self.root})")
        return _load(path)

    def recent(self, limit: int = 20) -> list[JobRecord]:
        """The newest ``limit`` records (files named by a job id; anything else there is not ours)."""
        paths = [p for p in self.root.glob("*.json") if p.stem.isdigit()] if self.root.is_dir() else []
        return [_load(p) for p in sorted(paths, key=lambda p: int(p.stem), reverse=True)[:limit]]


RECORD_TYPES = {"job_id": str, "name": str, "ranks": int, "log_dir": str, "run_paths": list, "array": bool}


def _load(path: Path) -> JobRecord:
    """The record in ``path``; one line naming the file where it is not one ``add`` wrote (damaged, edited)."""
    try:
        data = json.loads(path.read_text())
        problem = _record_problem(data)
    except (OSError, ValueError) as exc:  # unreadable, a directory, not JSON, not UTF-8
        problem = " ".join(str(exc).split())[:120]
    if problem:
        raise JobLookupError(f"{path} is not a job record hpc submit or hpc sweep wrote ({problem}): move it out of "
                             f"{path.parent}")
    return JobRecord(**{**data, "run_paths": tuple(data["run_paths"])})


def _record_problem(data: object) -> str:
    if not isinstance(data, dict):
        return "not a JSON object"
    missing = [key for key in RECORD_TYPES if key not in data and key != "array"]
    if missing:
        return f"no {missing[0]}"
    unknown = sorted(set(data) - set(RECORD_TYPES))
    if unknown:
        return f"an unknown key {unknown[0]}"
    for key, kind in RECORD_TYPES.items():
        value = data.get(key, False)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{key} is not of type {kind.__name__}"
    return "" if all(isinstance(p, str) for p in data["run_paths"]) else "run_paths holds a non-string"


def slurm_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """Run a Slurm client command; its error becomes one line."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=environ, timeout=60)
    except FileNotFoundError:
        raise JobLookupError(f"{argv[0]} not found: is this a Slurm login node?") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise JobLookupError(f"{argv[0]} failed: {message[-1] if message else f'exit status {done.returncode}'}")
    return done.stdout


def sacct_states(job_ids: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """sacct's fields for every job and array task of ``job_ids``, keyed ``"12"`` or ``"12_3"``.

    ``State`` is one word (sacct writes ``CANCELLED by 0``); jobs sacct does not know yet are absent.
    """
    from submitit.slurm.slurm import SlurmInfoWatcher

    bases = sorted({job_id.partition("_")[0] for job_id in job_ids})
    if not bases:
        return {}
    out = slurm_command(["sacct", "-X", "--parsable2", "-o", ",".join(SACCT_FIELDS), "-j", ",".join(bases)], environ)
    info = SlurmInfoWatcher().read_info(out)
    return {job_id: {**fields, "State": fields["State"].split(" ")[0]} for job_id, fields in info.items()}


def status_rows(records: Sequence[JobRecord], states: Mapping[str, Mapping[str, str]]) -> list[list[str]]:
    """One row per job or array task: id, name, state, elapsed, nodes, last step, last loss."""
    rows = []
    for record in records:
        for job_id in record.task_ids():
            fields = states.get(job_id, {})
            metrics = last_metrics(record.run_path(job_id)) or {}
            rows.append([job_id, record.name, fields.get("State", "UNKNOWN"), fields.get("Elapsed", "-"),
                         fields.get("NodeList", "-"), str(metrics.get("step", "-")),
                         f"{metrics['loss']:.4f}" if "loss" in metrics else "-"])
    return rows


STATUS_HEADER = ("JOB", "NAME", "STATE", "ELAPSED", "NODES", "STEP", "LOSS")


def status_report(registry: Registry, job_id: str | None) -> tuple[list[str], list[list[str]]] | None:
    """``hpc status``: (a line per job or array task whose ranks failed, and why; a status row each) of ``job_id``
    (``A_T``: that array task alone) or of the recent jobs; None when none was submitted from here."""
    records = [registry.get(job_id)] if job_id else registry.recent()
    if not records:
        return None
    rows = status_rows(records, sacct_states(r.job_id for r in records))
    only = job_id if job_id and "_" in job_id else None
    if only:
        rows = [row for row in rows if row[0] == only]
    return failure_lines(records, only), rows


def ended(job_id: str) -> bool:
    """Whether sacct says the job (or array task) is over."""
    return sacct_states([job_id]).get(job_id, {}).get("State") in DONE_STATES


def no_log_reason(job_id: str, path: Path) -> str:
    """Why a job has no log: not started yet, or ended without one (Slurm could not open it on the node)."""
    fields = sacct_states([job_id]).get(job_id, {})
    if fields.get("State") not in DONE_STATES:
        return f"no log yet: {path} (has job {job_id} started? hpc status {job_id})"
    private = " (/tmp is private to each node)" if path.is_relative_to("/tmp") else ""
    return (f"job {job_id} ended {fields['State']} (exit code {fields.get('ExitCode', '?')}) on "
            f"{fields.get('NodeList', '?')} without writing {path}: Slurm could not create it on the node, so that "
            f"rank never started; job.run_dir must be a directory every node shares{private}")


def step_failures(run_path: Path, job_id: str, log_dir: str | Path | None, since: float = 0.0) -> list[dict]:
    """The failure records of job ``job_id`` none older than ``since``, and when none is a rank's own, the death
    record of the task srun (its lines in the logs in ``log_dir``) saw end without one."""
    records = read_failures(run_path, job_id, since)
    if log_dir is not None and all(record.get("peer_lost") for record in records):
        death = srun_death(batch_log_tail(Path(log_dir), job_id), {record["rank"] for record in records}, job_id)
        records += [death] if death else []
    return records


def failure_line(job_id: str, run_path: Path, label: str | None = None,
                 log_dir: str | Path | None = None) -> str | None:
    """``job 12: rank 1 (host vm, step 5) failed: RuntimeError: ... -- see: hpc logs 12 --rank 1`` (``label`` in
    place of ``job 12``), or None when no rank of the job recorded a failure since its last restart inside the
    allocation and srun (its lines in the logs in ``log_dir``) reported no task that ended without one."""
    restarted = [entry["failed_at"] for entry in read_restarts(run_path, job_id) if entry["restart"]]
    summary = summarize_failures(step_failures(run_path, job_id, log_dir, max(restarted, default=0.0)))
    if summary is None:
        return None
    return f"{label or f'job {job_id}'}: {summary.text} -- see: hpc logs {job_id} --rank {summary.rank}"


def failure_lines(records: Sequence[JobRecord], only: str | None = None) -> list[str]:
    """Per job or array task (or just ``only``): a line per restart inside its allocation, then one if its ranks
    recorded a failure since, or srun saw one die; then one per rank named a straggler."""
    ids = [(record, job_id) for record in records for job_id in record.task_ids() if only in (None, job_id)]
    lines = []
    for record, job_id in ids:
        run_path = record.run_path(job_id)
        lines += [f"job {job_id}: {describe_restart(run_path, entry)}" for entry in read_restarts(run_path, job_id)]
        line = failure_line(job_id, run_path, log_dir=record.log_dir)
        lines += [line] if line else []
        lines += [f"job {job_id}: {name} {text}" for name, text in straggler_rows(named_stragglers(run_path))]
    return lines


def named_stragglers(run_path: Path) -> list[dict]:
    """The metrics records that name stragglers (hpc/observe/straggler.py), read without parsing every step's."""
    try:
        with (run_path / METRICS_FILE).open() as handle:
            return [json.loads(line) for line in handle if '"stragglers"' in line]
    except (OSError, ValueError):
        return []


def read_restarts(run_path: Path, job_id: str | None = None) -> list[dict]:
    """The restart decisions recorded in ``run_path`` (of ``job_id`` only, when given), oldest first."""
    try:
        lines = (run_path / RESTARTS_FILE).read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and job_id in (None, record.get("job_id")):
            records.append(record)
    return records


def restart_recovery(run_path: Path, entry: dict) -> tuple[int | None, float | None]:
    """(steps lost: run again after the restart, seconds from the failure to the next step's end) of one restart,
    from metrics.jsonl's steps and times; None where the run has not logged a step since."""
    before, after = None, None
    try:
        lines = (run_path / METRICS_FILE).read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        try:
            metrics = json.loads(line)
        except ValueError:
            continue
        if not isinstance(metrics.get("time"), int | float):
            continue
        if metrics["time"] <= entry["failed_at"]:
            before = metrics["step"]
        elif after is None:
            after = metrics
    if after is None:
        return None, None
    lost = None if before is None else max(0, before - after["step"] + 1)
    return lost, after["time"] - entry["failed_at"]


def describe_restart(run_path: Path, entry: dict) -> str:
    """``restart 1 of 2 (without node node1): rank 2 (host node1) was killed by SIGKILL ...; 3 steps lost, next
    step 9.4 s after the failure``, or why it did not restart."""
    if not entry["restart"]:  # the failure line that follows names the cause
        return f"not restarted: {entry['reason']}"
    lost, seconds = restart_recovery(run_path, entry)
    tail = "" if seconds is None else f"; {lost} step{'s' * (lost != 1)} lost, next step {seconds:.1f} s after it"
    return f"{entry['reason']}: {entry['cause']}{tail}"


def srun_death(log: str, recorded: Iterable[int], job_id: str) -> dict | None:
    """The death record (hpc/rundir.py) of the task that srun's lines in ``log`` say ended badly and that left no
    record of its own (not in ``recorded``): signals by strsignal's words, exits by their code. Tasks srun names
    alone come before those it names together (ranks it killed itself once the first died), then srun's order."""
    words = {text: number for number in signal.Signals if (text := signal.strsignal(number))}
    found, recorded = [], set(recorded)
    for index, (host, tasks, status) in enumerate(match.groups() for match in SRUN_TASKS_ENDED.finditer(log)):
        exited = SRUN_EXITED.fullmatch(status)
        returncode = int(exited[1]) if exited else -words[status] if status in words else None
        ranks = [rank for rank in _task_ranks(tasks) if rank not in recorded]
        if returncode is not None and ranks:
            found.append(((len(ranks) > 1, index, ranks[0]), death_record(ranks[0], host, returncode, "srun",
                                                                         job_id=job_id)))
    return min(found, key=lambda pair: pair[0])[1] if found else None


def _task_ranks(tasks: str) -> list[int]:
    """srun's task list ``0-1,3`` as ranks."""
    spans = SRUN_TASK_RANGE.findall(tasks)
    return [rank for first, last in spans for rank in range(int(first), int(last or first) + 1)]


def batch_log_tail(log_dir: Path, job_id: str) -> str:
    """The end of the batch script's output (srun's own lines; rank 0's log too), from the job's latest start."""
    from slurm.submit import log_path

    try:
        with log_path(log_dir, job_id, 0).open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - LOG_TAIL_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return text[max(0, text.rfind(ATTEMPT_START)):]


def follow(path: Path, finished: Callable[[], bool], out: TextIO = sys.stdout, poll_s: float = 0.5) -> None:
    """Print ``path`` and what is appended to it until the job is over (``tail -f`` that knows when to stop)."""
    offset = 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
    while True:
        over = finished()  # asked before reading, so the last lines written before the end are printed
        if path.exists():
            with path.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            offset += len(chunk)
            out.write(decoder.decode(chunk))
            out.flush()
        if over:
            return
        time.sleep(poll_s)

"""The files of a run directory (``<job.run_dir>/<job.name>``) and the small helpers that write and read them.

Ranks write them, ``hpc status``/``hpc report``/sweeps read them, from a login node too:
stdlib only, so that reading a run never imports torch, numpy or h5py.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, NamedTuple

from hpc.errors import ConfigError

CHECKPOINTS_DIR = "checkpoints"  # the persistent checkpoints, unless checkpoint.dir says otherwise
METRICS_FILE = "metrics.jsonl"  # rank 0: one JSON object per step
RANKS_DIR = "ranks"  # every rank's totals, ranks/rank-XXXXX.json, written when a run ends
TIMELINE_FILE = "timeline.json"  # the Chrome trace of every rank, with train.timeline
RESULT_FILE = "result.json"  # the final measures, written by hpc-rank; sweeps rank tasks by them
FAILURES_DIR = "failures"  # failures/rank-XXXXX.json (and .traceback) from each rank that failed: hpc/runtime/abort.py
STALL_EXIT = 76  # a rank the stall inspector aborted (hpc/observe/stall.py) exits with it
STALLED = "CollectiveStalled"  # a failure record's type when it is the stall inspector's report (hpc/errors.py)
# What usually sends the signals that kill a rank without a Python exception.
SIGNAL_CAUSES = {"SIGKILL": "often the out-of-memory killer",
                 "SIGSEGV": "a crash in native code: a CUDA kernel, an extension, a library",
                 "SIGBUS": "a bad memory access: often a full /dev/shm or a truncated memory-mapped file",
                 "SIGABRT": "native code called abort(): a failed assertion or an uncaught C++ exception",
                 "SIGILL": "an instruction this CPU lacks: a binary built for another machine",
                 "SIGFPE": "an arithmetic fault in native code"}


def write_json(path: Path, value: Any) -> None:
    """A small JSON file that appears whole or not at all, its content already on disk."""
    partial = path.with_name(path.name + ".part")
    with open(partial, "w") as handle:
        json.dump(value, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def last_metrics(run_path: Path) -> dict | None:
    """The last step rank 0 logged, or None before the first."""
    path = run_path / METRICS_FILE
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # the first line read may be cut, the last one half written
            continue
    return None


def read_result(run_path: Path) -> dict | None:
    """The run's result.json (written whole by ``write_json``), None before there is one; one line naming the
    file where it is not a JSON object (edited, or another program's)."""
    path = run_path / RESULT_FILE
    if not path.exists():
        return None
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a result hpc wrote ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(result, dict):
        raise ConfigError(f"{path}: not a result hpc wrote (not a JSON object)")
    return result


FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"  # failures/<prefix><rank>: NCCL's dump on a timeout


def enable_flight_recorder(run_path: Path, environ: MutableMapping[str, str]) -> None:
    """NCCL's flight recorder on (each process group's last collectives: sequence numbers, states, sizes) and
    dumped into ``failures/`` when a collective times out, which torch's ``fr_trace`` reads to say who never
    entered what; a variable the user set wins, under either name. Before the process group exists: NCCL reads
    them then. Torch 2.8 and later read the ``TORCH_FR_`` names and warn on every rank when the older
    ``TORCH_NCCL_`` ones are set, so only the new ones are set here."""
    environ.setdefault("TORCH_FR_BUFFER_SIZE", environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"))
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "TORCH_FR_DUMP_TEMP_FILE" not in environ and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in environ:
        try:
            (run_path / FAILURES_DIR).mkdir(parents=True, exist_ok=True)
        except OSError:  # the run directory's own check names it; the dump then goes where torch puts it
            return
        environ["TORCH_FR_DUMP_TEMP_FILE"] = str(run_path / FAILURES_DIR / FLIGHT_RECORDER_PREFIX)


def write_failure(run_path: Path, rank: int, record: dict, traceback_text: str | None) -> Path:
    """A failing rank's record and its traceback beside it (None: no traceback, a launcher's record of a rank that
    died without one), each whole or absent; no fsync: the process is about to exit, not the machine (what it wrote
    survives it), and its peers are being torn down meanwhile."""
    directory = run_path / FAILURES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank:05d}.json"
    traceback_path = path.with_suffix(".traceback") if traceback_text is not None else None
    if traceback_path is not None:
        replace_text(traceback_path, traceback_text)
    replace_text(path, json.dumps({**record, "rank": rank, "traceback": traceback_path and str(traceback_path)}))
    return path


def death_record(rank: int, host: str | None, returncode: int, launcher: str, **where: object) -> dict:
    """What a launcher (ours, mpirun, srun) knows of a rank that ended without recording why: where it ran and how it
    ended (``returncode`` as Popen gives it: below zero, killed by that signal); ``where``: job_id, world_size, time."""
    return {"host": host, "exit": returncode, "launcher": launcher, "peer_lost": False, "step": None, **where,
            "rank": rank}


def describe_exit(returncode: int) -> str:
    """``was killed by SIGKILL (signal 9: often the out-of-memory killer)``, ``exited with code 3``: how a process
    ended, from its status as Popen gives it (below zero: killed by that signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"was killed by signal {-returncode}"
        cause = SIGNAL_CAUSES.get(name)
        return f"was killed by {name} (signal {-returncode}{f': {cause}' if cause else ''})"
    if returncode == STALL_EXIT:
        return f"exited with code {returncode} (aborted by the stall inspector: see its report above)"
    return f"exited with code {returncode}"


def describe_death(rank: int, host: str | None, returncode: int, recorded: bool = True) -> str:
    """``rank 2 (host vm) was killed by SIGKILL (signal 9: often the out-of-memory killer)``: one rank's end as its
    launcher saw it, the same words under every launcher; ``recorded=False``: it left no record of why."""
    where = f" (host {host})" if host else ""
    silent = " without recording why" if not recorded and returncode > 0 and returncode != STALL_EXIT else ""
    return f"rank {rank}{where} {describe_exit(returncode)}{silent}"


def replace_text(path: Path, text: str) -> None:
    """``path`` holding ``text``, replaced whole: a reader (or a write that fails) never meets half of it."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    partial.write_text(text, errors="replace")
    os.replace(partial, path)


def read_failures(run_path: Path, job_id: str | None = None, since: float = 0.0) -> list[dict]:
    """The failure records of job ``job_id`` (None: the job that recorded the latest failure), none older than
    ``since``; a run directory is reused by later jobs of the same name, so each record says its job."""
    records = []
    for path in sorted((run_path / FAILURES_DIR).glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int) and record.get("time", 0.0) >= since:
            records.append(record)
    if job_id is None and records:
        job_id = max(records, key=lambda r: r.get("time", 0.0)).get("job_id")
    return [record for record in records if record.get("job_id") == job_id]


class FailureSummary(NamedTuple):
    text: str  # one line: who failed and why
    rank: int  # the rank whose log to read first
    traceback: str | None  # its traceback file, when it left a record
    died: bool = False  # text is a launcher's account of a rank that died without a record (death_record)


def describe_failure(record: dict) -> str:
    """``rank 1 (host vm, step 5) failed: RuntimeError: deliberate failure``, or for a launcher's record of a death
    (death_record): ``rank 2 (host vm) was killed by SIGKILL (signal 9: often the out-of-memory killer)``, or the
    stall inspector's report: ``rank 0 (vm) has waited 8 s in all-reduce (#14 on channel tp group [0, 1]) at step
    2; not arrived: rank 1 (vm, step 2, in forward for 9 s)...``."""
    if isinstance(record.get("exit"), int):
        return describe_death(record["rank"], record.get("host"), record["exit"], recorded=False)
    if record.get("type") == STALLED:  # the stall inspector's report names the rank, its host and step itself
        return str(record.get("message", ""))
    where = [f"host {record['host']}"] if record.get("host") else []
    where += [f"step {record['step']}"] if record.get("step") else []
    places = f" ({', '.join(where)})" if where else ""
    return f"rank {record['rank']}{places} failed: {record.get('type', 'error')}: {record.get('message', '')}"


def summarize_failures(records: list[dict]) -> FailureSummary | None:
    """The first rank that failed for a reason of its own (the earliest by its clock); else which ranks only saw a
    peer vanish, and which left no record at all (killed by a signal, out of memory: the likely culprits)."""
    if not records:
        return None
    own = [record for record in records if not record.get("peer_lost")]
    if own:
        first = min(own, key=lambda r: (r.get("time", 0.0), r["rank"]))
        died = isinstance(first.get("exit"), int)
        return FailureSummary(describe_failure(first), first["rank"], first.get("traceback"), died)
    lost = sorted(record["rank"] for record in records)
    size = max([record.get("world_size") or 0 for record in records] + [lost[-1] + 1])
    silent = sorted(set(range(size)) - set(lost))
    sample = min(records, key=lambda r: (r.get("time", 0.0), r["rank"]))
    text = (f"no rank recorded a failure of its own; {_ranks(lost)} only saw a peer vanish "
            f"({sample.get('type', 'error')}: {sample.get('message', '')})")
    if silent:
        text += f"; {_ranks(silent)} left no record (killed by a signal? out of memory?)"
    return FailureSummary(text, silent[0], None) if silent else FailureSummary(text, lost[0], sample.get("traceback"))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def node_scratch(base: str = "") -> Path:
    """A node's own disk for a run's node-local files (the local checkpoint tier, the health check's write):
    ``base`` when given, else Slurm's job-local ``$SLURM_TMPDIR`` where the site sets one, else the temporary
    directory."""
    import tempfile

    return Path(base or os.environ.get("SLURM_TMPDIR") or tempfile.gettempdir())

"""Start a job's ranks: local processes we supervise, or one mpirun command.

The local launcher is torchrun's job done with the one guarantee users miss most:
when any rank dies, every other rank is stopped within seconds and the launcher
exits non-zero naming the rank that died first, instead of the survivors hanging
in a collective until a 30-minute timeout. Each rank runs in its own session so a
rank and anything it started are stopped together.

Under mpirun, Open MPI already aborts the job when a rank dies; we build the
command line (root, oversubscription, binding, environment with -x) and turn its
``--tag-output`` prefixes into the same ``[rank]`` prefixes as the local launcher.

A rank that dies without a Python exception (a signal: the out-of-memory killer, a
segfault in a CUDA kernel; or ``os._exit``) records nothing itself: the launcher that saw
it die (our wait status, mpirun's exit report) records it in the run's failures directory
(hpc/rundir.py ``death_record``), so ``hpc run`` and every later reader lead with it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hpc.errors import ConfigError, RankFailedError
from hpc.rundir import death_record, describe_death, describe_exit, read_failures, summarize_failures, write_failure
from hpc.runtime.abort import this_host
from hpc.runtime.env import Launcher, detect_rank_info

STOP_GRACE_S = 5.0
OUTPUT_DRAIN_S = 5.0  # how long a stopped launch's last lines may take to arrive
# Variables a rank needs from the launching shell; -x copies their current values.
FORWARDED_PREFIXES = ("HPC_", "NCCL_", "GLOO_", "TORCH_", "CUDA_", "OMP_", "MKL_")
FORWARDED_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "MASTER_ADDR", "MASTER_PORT")
# Open MPI 4.1 sometimes repeats the tag just before the newline, so every tag is removed.
MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<(?:stdout|stderr)>:")
# Open MPI's (4 and 5) exit reports: a rank killed by a signal, and the first rank to exit non-zero.
MPI_RANK_DIED = re.compile(r"rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
MPI_NONZERO = re.compile(r"exited with non-zero status")
MPI_PROCESS = re.compile(r"Process name:\s*\[\S*,(\d+)\]\s*$")
MPI_EXIT_CODE = re.compile(r"Exit code:\s*(\d+)")


@dataclass(frozen=True)
class RankCommand:
    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # additions to the launcher's environment

    def shell_line(self) -> str:
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{assignments} {shlex.join(self.argv)}"


def rank_argv(spec_path: str, overrides: Sequence[str]) -> tuple[str, ...]:
    """What every rank runs; the launcher's own interpreter, so virtualenvs carry over."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return (sys.executable, "-m", "hpc.cli.rank", spec_path, *sets)


def usable_cpus(affinity: Collection[int] | None = None) -> int:
    """The CPUs this process may run on: its affinity mask (set by Slurm's task plugin, mpirun --bind-to,
    taskset, a container's cpuset), not the machine's count, which os.cpu_count() gives."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, len(affinity))


def threads_per_rank(ranks_on_node: int, cpus: int | None = None) -> int:
    """Each of ``ranks_on_node`` ranks sharing ``cpus`` (default: this process's usable CPUs) gets an equal share."""
    return max(1, (cpus or usable_cpus()) // ranks_on_node)


def rank_threads(environ: Mapping[str, str], affinity: Collection[int] | None = None) -> int:
    """A rank's torch threads when OMP_NUM_THREADS does not say, from where it runs, under every launcher.

    An srun task gets Slurm's ``--cpus-per-task`` (SLURM_CPUS_PER_TASK), at most its affinity mask;
    any other rank an equal share of its mask with the ranks on its node (hpc run and mpirun's
    ranks inherit the launcher's mask, or are bound by it).
    """
    info = detect_rank_info(environ)
    cpus = usable_cpus(affinity)
    per_task = environ.get("SLURM_CPUS_PER_TASK", "") if info.launcher is Launcher.SLURM else ""
    if per_task.isdigit() and int(per_task) > 0:
        return min(int(per_task), cpus)
    return threads_per_rank(info.local_size, cpus)


def exit_status(returncode: int) -> int:
    """What a shell reports for a process that ended with Popen's ``returncode``: 128 + the signal when killed."""
    return returncode if returncode > 0 else 128 - returncode


class RankDied(RankFailedError):
    """The first rank to end badly, as its launcher saw it: where it ran and how it ended (``returncode`` as Popen
    gives it: below zero, killed by that signal), ``at`` when; ``aftermath`` what the launcher did then."""

    def __init__(self, rank: int, host: str | None, returncode: int, at: float, aftermath: str = "") -> None:
        super().__init__(f"{describe_death(rank, host, returncode)}{aftermath}", exit_code=exit_status(returncode))
        self.rank, self.host, self.returncode, self.at, self.aftermath = rank, host, returncode, at, aftermath
        self.also: list[RankDied] = []  # other ranks that had ended badly when the launcher saw this one


def local_commands(
    n: int, argv: tuple[str, ...], environ: Mapping[str, str], port: int, job_id: str, progress: str
) -> list[RankCommand]:
    common = {
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HPC_JOB_ID": job_id,
        "HPC_PROGRESS": progress,
        "PYTHONUNBUFFERED": "1",
    }
    if "GLOO_SOCKET_IFNAME" not in environ:
        common["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are here; never pick a slow or absent NIC
    if "OMP_NUM_THREADS" not in environ:
        common["OMP_NUM_THREADS"] = str(threads_per_rank(n))
    return [
        RankCommand(rank, argv, {"RANK": str(rank), "LOCAL_RANK": str(rank), **common}) for rank in range(n)
    ]


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``a:4,b:4`` (slots default to 1) as (host, slots) pairs."""
    hosts = []
    for item in spec.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ConfigError(f"--hosts: {item!r} is not HOST or HOST:SLOTS with SLOTS >= 1")
        hosts.append((name, int(slots or 1)))
    return hosts


def mpirun_command(
    n: int,
    argv: tuple[str, ...],
    environ: Mapping[str, str],
    hosts: Sequence[tuple[str, int]] = (),
    bind_to: str | None = None,
    progress: str = "plain",
    is_root: bool = False,
    cpus: int | None = None,
) -> list[str]:
    slots = sum(s for _, s in hosts) if hosts else (cpus or usable_cpus())
    oversubscribe = n > slots
    ranks_per_node = max(s for _, s in hosts) if hosts else n
    command = ["mpirun", "-np", str(n), "--tag-output"]
    if hosts:
        command += ["--host", ",".join(f"{h}:{s}" for h, s in hosts)]
    if is_root:
        command.append("--allow-run-as-root")
    if oversubscribe:
        command += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    command += ["--map-by", "slot", "--bind-to", bind_to or ("none" if oversubscribe or not hosts else "socket")]
    forwarded = sorted(
        name for name in environ if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)
    )
    for name in forwarded:
        command += ["-x", name]
    settings = {"HPC_PROGRESS": progress, "PYTHONUNBUFFERED": "1"}
    if "OMP_NUM_THREADS" not in environ:
        settings["OMP_NUM_THREADS"] = str(threads_per_rank(ranks_per_node, cpus))
    for name, value in settings.items():
        if name not in forwarded:
            command += ["-x", f"{name}={value}"]
    return command + list(argv)


def has_open_mpi() -> bool:
    return shutil.which("mpirun") is not None and shutil.which("ompi_info") is not None


def _pump(source: BinaryIO, sink: BinaryIO, lock: threading.Lock, relabel: Callable[[bytes], bytes]) -> None:
    """Copy a child's output a line at a time, relabelled; ``\\r`` ends a line too (progress bars)."""
    pending = b""
    while chunk := os.read(source.fileno(), 65536):
        pending += chunk
        while (cut := _first_terminator(pending)) >= 0:
            line, pending = pending[: cut + 1], pending[cut + 1 :]
            with lock:
                sink.write(relabel(line))
                sink.flush()
    if pending:
        with lock:
            sink.write(relabel(pending + b"\n"))
            sink.flush()
    source.close()


def _first_terminator(data: bytes) -> int:
    positions = [p for p in (data.find(b"\n"), data.find(b"\r")) if p >= 0]
    return min(positions) if positions else -1


def rank_prefixer(rank: int, width: int) -> Callable[[bytes], bytes]:
    prefix = f"[{rank:>{width}}] ".encode()
    return lambda line: prefix + line


def _start(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        list(argv),
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_process_groups(procs: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> set[int]:
    """SIGTERM every process group still alive, SIGKILL what is left after the grace period; returns the indices of
    the processes it had to SIGKILL."""
    killed: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for index, proc in enumerate(procs):
            if proc.poll() is None:
                killed |= {index} if sig == signal.SIGKILL else set()
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    for proc in procs:
        proc.wait()
        try:  # grandchildren that outlived their rank
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


class _Watch:
    """Pump every output stream and report each exit, in order, on ``exits``. A process's exit can be seen before
    its last lines are read (mpirun prints which rank died just before it exits): ``drain`` waits for them."""

    def __init__(self, procs: Sequence[subprocess.Popen], relabels: Sequence[Callable[[bytes], bytes]]) -> None:
        lock = threading.Lock()
        self.exits: queue.Queue = queue.Queue()
        self._pumps = []
        for index, (proc, relabel) in enumerate(zip(procs, relabels, strict=True)):
            for source, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                pump = threading.Thread(target=_pump, args=(source, sink, lock, relabel), daemon=True)
                pump.start()
                self._pumps.append(pump)
            threading.Thread(target=lambda i=index, p=proc: self.exits.put((i, p.wait())), daemon=True).start()

    def drain(self, timeout_s: float = OUTPUT_DRAIN_S) -> None:
        """Read what the stopped processes wrote to the end, for at most ``timeout_s`` (a leaked grandchild in
        another process group may hold a pipe open)."""
        deadline = time.monotonic() + timeout_s
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


def run_local(commands: Sequence[RankCommand]) -> None:
    """Run every rank to completion; on the first failure stop the rest and raise naming it, with the other ranks
    that ended by themselves meanwhile (``also``): the first exit seen may be a peer's that saw a rank die whose own
    end the kernel had not finished (a large process killed by a signal is torn down for a while after its sockets
    close)."""
    width = len(str(len(commands) - 1))
    procs = [_start(c.argv, c.env) for c in commands]
    watch = _Watch(procs, [rank_prefixer(c.rank, width) for c in commands])
    failure, killed = None, set()
    try:
        for _ in procs:
            index, code = watch.exits.get()
            if code != 0:
                failure = (index, code, time.time())
                break
    finally:
        killed = stop_process_groups(procs)
        watch.drain()
    if failure is not None:
        index, code, at = failure
        others = len(commands) - 1
        stopped = f"; stopped the other {others} rank{'s' * (others != 1)}" if others else ""
        first = RankDied(commands[index].rank, this_host(), code, at, stopped)
        first.also = [RankDied(commands[i].rank, this_host(), proc.returncode, at, stopped)
                      for i, proc in enumerate(procs) if i != index and _ended_itself(proc.returncode, i in killed)]
        raise first


def _ended_itself(returncode: int, killed: bool) -> bool:
    """Whether a rank we stopped (SIGTERM, whose default action it keeps; SIGKILL when ``killed``) had ended badly by
    itself: any other status than ours."""
    return returncode not in (0, -signal.SIGTERM) and not (killed and returncode == -signal.SIGKILL)


class MpirunReport:
    """The ranks that mpirun reports dead, first first: ``mpirun noticed that process rank 2 with PID N on node vm
    exited on signal 9 (Killed).``, or the block under ``mpirun detected that one or more processes exited with
    non-zero status`` (``Process name: [[16356,1],2]`` then ``Exit code: 3``), whose host is where the mapping put
    the rank."""

    def __init__(self, host_of: Callable[[int], str | None]) -> None:
        self.host_of = host_of
        self.deaths: list[RankDied] = []
        self._nonzero = False
        self._rank: int | None = None

    @property
    def first(self) -> RankDied | None:
        """The first death reported, the later ones as its ``also``."""
        if not self.deaths:
            return None
        self.deaths[0].also = self.deaths[1:]
        return self.deaths[0]

    def read(self, line: str) -> None:
        if match := MPI_RANK_DIED.search(line):
            self.deaths.append(RankDied(int(match[1]), match[2], -int(match[3]), time.time()))
        elif MPI_NONZERO.search(line):
            self._nonzero = True
        elif self._nonzero and (match := MPI_PROCESS.search(line)):
            self._rank = int(match[1])
        elif self._rank is not None and (match := MPI_EXIT_CODE.search(line)):
            self.deaths.append(RankDied(self._rank, self.host_of(self._rank), int(match[1]), time.time()))
            self._nonzero, self._rank = False, None


def mpirun_host(rank: int, hosts: Sequence[tuple[str, int]] = ()) -> str | None:
    """Where ``mpirun --map-by slot`` starts ``rank``: this host without --hosts, else the hosts' slots filled in
    order; None past their slots (oversubscribed: Open MPI's own placement)."""
    if not hosts:
        return this_host()
    for name, slots in hosts:
        if rank < slots:
            return name
        rank -= slots
    return None


def run_mpirun(command: Sequence[str], env: Mapping[str, str] | None = None,
               hosts: Sequence[tuple[str, int]] = ()) -> None:
    report = MpirunReport(lambda rank: mpirun_host(rank, hosts))

    def relabel(line: bytes) -> bytes:
        report.read(line.decode(errors="replace"))
        tagged = MPI_TAG.search(line)
        return b"[%s] %s" % (tagged[1], MPI_TAG.sub(b"", line)) if tagged else line

    proc = _start(command, env or {})
    watch = _Watch([proc], [relabel])
    try:
        _, code = watch.exits.get()
    finally:
        stop_process_groups([proc])
        watch.drain()  # the report is complete only once mpirun's last lines are read
    if code != 0:
        raise report.first or RankFailedError(f"mpirun {describe_exit(code)}", exit_code=exit_status(code))


def new_job_id() -> str:
    return f"local-{os.getpid()}-{int(time.time())}"


def default_launcher() -> str:
    """mpirun when Open MPI is installed, else our local launcher: what every command uses unless told."""
    return "mpirun" if has_open_mpi() else "local"


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def launch_ranks(n: int, argv, launcher: str, hosts, bind_to: str | None, progress: str, dry_run: bool,
                 run_path: Path | None = None) -> None:
    """Start ``argv`` on n ranks with the chosen launcher (or print the command lines). When a rank fails, the
    error names the first rank that failed for a reason of its own, from the records the ranks left in
    ``run_path`` (hpc/runtime/abort.py), before the launcher's own account (which rank exited first)."""
    from hpc.runtime.bootstrap import free_port

    if bind_to and launcher != "mpirun":  # the local launcher binds nothing: refused, not ignored
        raise ConfigError(f"--bind-to {bind_to} needs --launcher mpirun (the local launcher leaves placement to the "
                          "kernel)")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # a stopped launcher stops its ranks (run_* clean up)
    job_id, started = new_job_id(), time.time()
    if dry_run:
        if launcher == "mpirun":
            print(shlex.join(mpirun_command(n, argv, os.environ, hosts, bind_to, progress, is_root=os.geteuid() == 0)))
        else:
            print("\n".join(c.shell_line() for c in local_commands(n, argv, os.environ, free_port(), job_id, progress)))
        return
    try:
        if launcher == "mpirun":  # the ranks' HPC_JOB_ID labels their failure records; -x forwards HPC_*
            environ = {**os.environ, "HPC_JOB_ID": job_id}
            command = mpirun_command(n, argv, environ, hosts, bind_to, progress, is_root=os.geteuid() == 0)
            run_mpirun(command, environ, hosts)
        else:
            run_local(local_commands(n, argv, os.environ, free_port(), job_id, progress))
    except RankFailedError as exc:
        died = record_death(run_path, exc, launcher, job_id, n, started) if isinstance(exc, RankDied) else None
        raise named_failure(died or exc, run_path, job_id, started) from None


def record_death(run_path: Path | None, death: RankDied, launcher: str, job_id: str, world_size: int,
                 since: float) -> RankDied | None:
    """The launcher's record, in the run directory, of ``death`` when that rank left no record of why it failed; when
    it only saw a peer vanish, of the first of ``death.also`` that left none: that one, or None."""
    if run_path is None:
        return None
    records = {record["rank"]: record for record in read_failures(run_path, job_id, since)}
    chain = (death, *death.also) if records.get(death.rank, {}).get("peer_lost") else (death,)
    silent = [ended for ended in chain if ended.rank not in records]
    if not silent:
        return None
    first = silent[0]
    record = death_record(first.rank, first.host, first.returncode, launcher, job_id=job_id, world_size=world_size,
                          time=first.at)
    try:
        write_failure(run_path, first.rank, record, None)
    except OSError as error:  # the error still names the rank; only later readers miss it
        print(f"hpc: could not record rank {first.rank}'s end in {run_path}: {error}", file=sys.stderr, flush=True)
    return first


def named_failure(exc: RankFailedError, run_path: Path | None, job_id: str, since: float) -> RankFailedError:
    """``exc`` led by the first rank of job ``job_id`` that failed for a reason of its own, as recorded; a rank that
    died without a record of its own is the launcher's account alone (``rank 2 (host vm) was killed by ...``)."""
    summary = summarize_failures(read_failures(run_path, job_id, since)) if run_path is not None else None
    if summary is None:
        return exc
    if summary.died and isinstance(exc, RankDied):
        return RankFailedError(f"{summary.text}{exc.aftermath}", exit_code=exc.exit_code)
    where = f" (traceback: {summary.traceback})" if summary.traceback else ""
    return RankFailedError(f"{summary.text}{where}; {exc}", exit_code=exc.exit_code)


def launch_for_rows(n: int, launcher: str, rank_argv, parent: str | None = None) -> list[dict]:
    """Start ``python *rank_argv(out, scratch)`` on n ranks; rank 0 writes its rows to ``out``, returned here."""
    with tempfile.TemporaryDirectory(prefix="hpc-bench-", dir=parent) as scratch:
        out = os.path.join(scratch, "rows.json")
        argv = (sys.executable, *rank_argv(out, scratch))
        launch_ranks(n, argv, launcher, hosts=[], bind_to=None, progress="off", dry_run=False)
        with open(out) as handle:
            return json.load(handle)

"""Launchers: command lines (pure), then real runs that must fail fast and leave nothing behind."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.errors import ConfigError
from hpc.runtime import launch

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "mlp.toml"
ARGV = ("python", "-m", "hpc.cli.rank", "job.toml")
needs_mpi = pytest.mark.skipif(not launch.has_open_mpi(), reason="Open MPI is not installed")


def test_local_commands_give_each_rank_its_identity() -> None:
    commands = launch.local_commands(3, ARGV, {}, 29555, "local-1", "plain")
    assert [c.env["RANK"] for c in commands] == ["0", "1", "2"]
    assert [c.env["LOCAL_RANK"] for c in commands] == ["0", "1", "2"]
    for command in commands:
        assert command.env["WORLD_SIZE"] == "3" and command.env["MASTER_PORT"] == "29555"
        assert command.env["GLOO_SOCKET_IFNAME"] == "lo"
        assert command.argv == ARGV


def test_local_commands_respect_the_users_settings() -> None:
    (command,) = launch.local_commands(1, ARGV, {"GLOO_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "7"}, 1, "j", "tty")
    assert "GLOO_SOCKET_IFNAME" not in command.env and "OMP_NUM_THREADS" not in command.env


def test_threads_are_split_between_ranks() -> None:
    assert launch.threads_per_rank(4, cpus=16) == 4
    assert launch.threads_per_rank(4, cpus=2) == 1


SRUN_TASK = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0", "SLURM_CPUS_PER_TASK": "8"}
LOCAL_RANK = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    ("environ", "affinity", "threads"),
    [
        ({**SRUN_TASK, "SLURM_CPUS_PER_TASK": "1"}, range(64), 1),  # --cpus-per-task, not the node's 64 CPUs
        ({**SRUN_TASK, "SLURM_CPUS_PER_TASK": "8"}, {0, 1, 2, 3}, 4),  # never past the affinity mask
        (SRUN_TASK, range(16), 8),  # no --cpus-per-task: the mask shared by the 2 tasks on this node
        ({**BATCH_SCRIPT, **LOCAL_RANK}, range(8), 4),  # hpc run inside a job: the job's per-task CPUs are not ours
        (LOCAL_RANK, {0, 1}, 1),  # hpc run on 2 usable CPUs, whatever os.cpu_count() says
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, {0, 1}, 1),  # at least one
        ({}, {5}, 1),
    ],
)
def test_rank_threads_follow_slurms_cpus_per_task_and_the_affinity_mask(environ, affinity, threads) -> None:
    assert launch.rank_threads(environ, affinity) == threads


def test_launchers_count_the_cpus_this_process_may_use_not_the_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert launch.usable_cpus() == 4
    assert {c.env["OMP_NUM_THREADS"] for c in launch.local_commands(2, ARGV, {}, 1, "j", "tty")} == {"2"}
    assert "-x OMP_NUM_THREADS=1" in " ".join(launch.mpirun_command(4, ARGV, {}))
    assert launch.rank_threads(LOCAL_RANK) == 2


def test_mpirun_command_for_bare_metal_hosts() -> None:
    env = {"PATH": "/bin", "NCCL_IB_HCA": "mlx5", "HOME": "/root", "HPC_X": "1"}
    command = launch.mpirun_command(8, ARGV, env, hosts=[("a", 4), ("b", 4)], is_root=True, cpus=64)
    line = " ".join(command)
    assert command[:3] == ["mpirun", "-np", "8"]
    assert "--host a:4,b:4" in line and "--allow-run-as-root" in line
    assert "--oversubscribe" not in line and "--bind-to socket" in line
    assert "-x PATH" in line and "-x NCCL_IB_HCA" in line and "-x HPC_X" in line and "HOME" not in line
    assert "-x OMP_NUM_THREADS=16" in line
    assert tuple(command[-len(ARGV):]) == ARGV


def test_mpirun_command_oversubscribes_a_small_machine() -> None:
    command = launch.mpirun_command(4, ARGV, {}, cpus=2, bind_to=None)
    line = " ".join(command)
    assert "--oversubscribe" in line and "--bind-to none" in line and "--allow-run-as-root" not in line


@pytest.mark.parametrize(("spec", "expected"), [("a:4,b:2", [("a", 4), ("b", 2)]), ("node1", [("node1", 1)])])
def test_parse_hosts(spec, expected) -> None:
    assert launch.parse_hosts(spec) == expected


@pytest.mark.parametrize("spec", ["a:0", "a:x", ":4", "a:4,,b"])
def test_parse_hosts_rejects_malformed(spec) -> None:
    with pytest.raises(ConfigError, match="--hosts"):
        launch.parse_hosts(spec)


def test_describe_exit() -> None:
    assert launch.describe_exit(3) == "exited with code 3"
    assert launch.describe_exit(-9) == "was killed by SIGKILL (signal 9: often the out-of-memory killer)"
    assert launch.describe_exit(-10) == "was killed by SIGUSR1 (signal 10)"
    assert launch.describe_exit(-100) == "was killed by signal 100"
    assert "stall inspector" in launch.describe_exit(76)


def test_ranks_that_ended_by_themselves_while_being_stopped_come_with_the_first_failure(monkeypatch) -> None:
    """A killed rank's sockets close before the kernel has torn the whole process down, so a peer that saw it vanish
    can exit first: the launcher also names the ranks that ended by themselves while it stopped them (any status
    but its own SIGTERM, or SIGKILL after the grace period)."""
    code = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[1] != 'term' "
            "else None; time.sleep(float(sys.argv[2])); os.kill(os.getpid(), 9) if sys.argv[1] == 'kill' else None; "
            "time.sleep(60) if sys.argv[1] == 'stuck' else os._exit(int(sys.argv[3]))")
    ranks = [("exit", "0.2", "1"), ("kill", "1", "0"), ("term", "60", "0"), ("stuck", "0", "0"), ("exit", "1", "3")]
    commands = [launch.RankCommand(rank, (sys.executable, "-c", code, *args), {}) for rank, args in enumerate(ranks)]
    stop = launch.stop_process_groups
    monkeypatch.setattr(launch, "stop_process_groups", lambda procs: stop(procs, grace_s=2.0))
    with pytest.raises(launch.RankDied) as raised:
        launch.run_local(commands)
    assert (raised.value.rank, raised.value.returncode) == (0, 1)
    assert [(also.rank, also.returncode) for also in raised.value.also] == [(1, -9), (4, 3)]


def test_pump_prefixes_lines_and_carriage_returns(tmp_path) -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"a\nbar 1\rbar 2\rtail")
    os.close(write_fd)
    out = tmp_path / "out"
    with open(read_fd, "rb") as source, out.open("wb") as sink:
        launch._pump(source, sink, __import__("threading").Lock(), launch.rank_prefixer(3, 2))
    assert out.read_bytes() == b"[ 3] a\n[ 3] bar 1\r[ 3] bar 2\r[ 3] tail\n"


# --- real runs -------------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _rank_pid(pids: set[int], rank: int) -> int | None:
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hpc.cli.rank" in cmdline and (
            f"RANK={rank}".encode() in environ or f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ
        ):
            return pid
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _hpc(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpc.cli.main", *args]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(_hpc(*args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "wire"),
    [
        ("local", ["--set", "parallel.compression=bf16"]),
        pytest.param("mpirun", ["--set", "parallel.transport=mpi", "--set", "parallel.compression=int8"],
                     marks=needs_mpi),
    ],
)
def test_run_trains_and_prefixes_output(tmp_path, launcher, wire) -> None:
    done = _run("run", "-n", "2", "--launcher", launcher, str(EXAMPLE), "--set", "train.steps=40",
                "--set", f"job.run_dir={tmp_path}", *wire)
    assert done.returncode == 0, done.stderr
    summary = re.search(r"^\[0\] summary: 40 steps .* final loss (\S+) \| held-out loss \S+ \| held-out accuracy",
                        done.stdout, re.M)
    assert summary, done.stdout
    assert float(summary[1]) < 2.0
    assert re.search(r"^\[0\] step 20/40 loss", done.stdout, re.M)
    assert len((tmp_path / "mlp-digits" / "metrics.jsonl").read_text().splitlines()) == 40


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", pytest.param("mpirun", marks=needs_mpi)])
def test_killed_rank_stops_the_job_fast_and_is_named(tmp_path, launcher) -> None:
    proc = subprocess.Popen(
        _hpc("run", "-n", "4", "--launcher", launcher, str(EXAMPLE), "--set", "train.steps=1000000",
             "--set", f"job.run_dir={tmp_path}"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for line in proc.stdout:  # wait until training is under way on every rank
            if "step 20/" in line:
                break
        pids = _descendants(proc.pid)
        victim = _rank_pid(pids, 2)
        assert victim is not None, "rank 2 not found among the launcher's processes"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 30
    assert re.search(r"^hpc: error: rank 2 \(host \S+\) was killed by SIGKILL \(signal 9: often the out-of-memory "
                     r"killer\)", stderr, re.M), stderr
    time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)], "processes left behind"


@pytest.mark.slow
@needs_mpi
def test_pipeline_messages_over_mpi_train_the_gpt_like_torch_transport(tmp_path) -> None:
    gpt = EXAMPLE.with_name("gpt.toml")
    layout = ("parallel.tp=1", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
              "parallel.microbatches=4", "train.steps=6", f"job.run_dir={tmp_path}")
    summaries = {}
    for transport in ("torch", "mpi"):
        done = _run("run", "-n", "2", "--launcher", "mpirun", str(gpt), "--set", f"parallel.transport={transport}",
                    *(arg for setting in layout for arg in ("--set", setting)))
        assert done.returncode == 0, done.stderr
        summaries[transport] = re.search(r"final loss (\S+) \| held-out loss (\S+)", done.stdout)[0]
    assert summaries["mpi"] == summaries["torch"]


@pytest.mark.slow
def test_a_rank_aborted_by_a_library_names_itself_and_shows_where_its_threads_were(tmp_path) -> None:
    script = tmp_path / "abort_on_rank1.py"
    script.write_text("import os\nimport hpc\n\nwith hpc.session() as run:\n"
                      "    if run.rank == 1:\n        os.abort()  # what a C++ std::terminate ends in\n"
                      "    run.finish()\n")
    done = _run("run", "-n", "2", "--launcher", "local", str(script), timeout=90)
    assert done.returncode != 0
    assert re.search(r"rank 1 \(host \S+\) was killed by SIGABRT \(signal 6: native code called abort\(\)",
                     done.stderr), done.stderr
    assert "[1] Fatal Python error: Aborted" in done.stderr, done.stderr
    assert re.search(r"^\[1\] .*File \".*abort_on_rank1.py\", line 6", done.stderr, re.M), done.stderr


@pytest.mark.slow
def test_dry_run_prints_commands_and_starts_nothing(tmp_path) -> None:
    done = _run("run", "-n", "2", "--launcher", "local", "--dry-run", str(EXAMPLE), "--set", "train.lr=0.01",
                "--set", f"job.run_dir={tmp_path}")
    assert done.returncode == 0
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and "RANK=0 " in lines[0] and "RANK=1 " in lines[1]
    assert "--set train.lr=0.01" in lines[0]
    assert not (tmp_path / "mlp-digits").exists()


@needs_mpi
def test_mpirun_dry_run_is_the_exact_command(tmp_path) -> None:
    done = _run("run", "-n", "4", "--launcher", "mpirun", "--hosts", "a:2,b:2", "--dry-run", str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("mpirun -np 4 ") and "--host a:2,b:2" in done.stdout
    assert shutil.which(done.stdout.split()[0])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", pytest.param("mpirun", marks=needs_mpi)])
def test_exception_on_one_rank_aborts_the_others(tmp_path, launcher) -> None:
    """Only rank 0 writes metrics: a directory where its metrics.jsonl goes fails rank 0 alone while
    the other ranks wait for it in the gradient all-reduce; they must be taken down, not hang.
    (Every rank makes the run directory itself, so an unwritable run_dir would fail them all.)"""
    (tmp_path / "blocked" / "metrics.jsonl").mkdir(parents=True)
    started = time.monotonic()
    done = _run("run", "-n", "2", "--launcher", launcher, str(EXAMPLE), "--set", f"job.run_dir={tmp_path}",
                "--set", "job.name=blocked", timeout=90)
    assert done.returncode != 0
    assert time.monotonic() - started < 60
    assert re.search(r"^\[0\] hpc-rank: rank 0: error: .*Is a directory: .*metrics\.jsonl", done.stderr + done.stdout,
                     re.M)
    # MPI_Abort: mpirun reports the abort, not an exit status
    assert re.search(r"rank 0 \(host \S+\) exited with code 1", done.stderr) or launcher == "mpirun", done.stderr


def test_a_run_directory_that_cannot_be_made_is_one_line_naming_it_and_the_host(tmp_path: Path) -> None:
    import socket

    from hpc.errors import HpcError
    from hpc.run_session import make_run_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(HpcError) as raised:
        make_run_dir(tmp_path / "file" / "run")
    message = str(raised.value)
    assert message.startswith(f"cannot create the run directory {tmp_path / 'file' / 'run'} on "
                              f"{socket.gethostname()}: Not a directory;") and "\n" not in message

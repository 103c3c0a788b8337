"""Which rank failed, and why: each failing rank's record in the run directory (hpc/runtime/abort.py, hpc/rundir.py),
the first own-cause failure chosen from them, and how ``hpc status``, ``hpc logs``, ``hpc sweep status`` and
``hpc run`` lead with it; a rank that died without a record (a signal, ``os._exit``) as its launcher tells it (our
wait status, mpirun's exit report, srun's task lines). Fast: no torch and no cluster here; tests/test_submit.py and
tests/test_slurm_failures.py run failing jobs on Slurm and under hpc run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.rundir import death_record, describe_death, read_failures, summarize_failures, write_failure
from hpc.runtime.abort import is_peer_lost

REPO = Path(__file__).resolve().parent.parent
GLOO_CLOSED = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\n"
               "This may indicate a possible application crash on rank 0 or a network set up issue.")


def _record(rank: int, time: float, peer_lost: bool, job_id: str = "12", **more) -> dict:
    kind, message = ("RuntimeError", GLOO_CLOSED.splitlines()[0]) if peer_lost else ("ValueError", f"bad on {rank}")
    return {"job_id": job_id, "world_size": 4, "host": "vm", "step": 5, "type": kind, "message": message,
            "peer_lost": peer_lost, "time": time, "rank": rank, **more}


@pytest.mark.parametrize(("error", "lost"), [
    (RuntimeError(GLOO_CLOSED), True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection reset by peer"), True),
    (RuntimeError("NCCL communicator was aborted on rank 2."), True),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation"), True),
    (ConnectionResetError(104, "reset"), True),
    (BrokenPipeError(32, "pipe"), True),
    (RuntimeError("deliberate failure on rank 1 at step 5"), False),
    (ValueError("shapes (3,) and (4,) do not match"), False),
    (MemoryError(), False),
])
def test_a_peer_vanishing_is_told_from_a_failure_of_ones_own(error: BaseException, lost: bool) -> None:
    assert is_peer_lost(error) is lost


def test_our_own_errors_name_their_cause_even_when_their_words_sound_like_a_lost_peer() -> None:
    from hpc.errors import ConfigError

    assert not is_peer_lost(ConfigError("train.health_check_timeout_s must be positive"))


def test_the_earliest_failure_of_its_own_wins_over_earlier_lost_peers() -> None:
    records = [_record(0, 10.0, True), _record(3, 10.5, False), _record(1, 10.2, False), _record(2, 9.9, True)]
    summary = summarize_failures(records)
    assert summary.text == "rank 1 (host vm, step 5) failed: ValueError: bad on 1" and summary.rank == 1


def test_without_a_failure_of_its_own_it_names_who_lost_a_peer_and_who_left_no_record() -> None:
    summary = summarize_failures([_record(0, 2.0, True), _record(2, 1.0, True, traceback="/t/rank-00002.traceback"),
                                  _record(3, 3.0, True)])
    assert summary.text == ("no rank recorded a failure of its own; ranks 0, 2, 3 only saw a peer vanish "
                            f"(RuntimeError: {GLOO_CLOSED.splitlines()[0]}); rank 1 left no record "
                            "(killed by a signal? out of memory?)")
    assert (summary.rank, summary.traceback) == (1, None)
    everyone = summarize_failures([_record(r, 1.0 + r, True, traceback=f"/t/{r}") for r in range(4)])
    assert "left no record" not in everyone.text and (everyone.rank, everyone.traceback) == (0, "/t/0")
    assert summarize_failures([]) is None


def test_records_are_per_job_and_a_reused_run_directory_keeps_the_latest(tmp_path: Path) -> None:
    write_failure(tmp_path, 0, _record(0, 1.0, False, job_id="11"), "old")
    write_failure(tmp_path, 1, _record(1, 5.0, False, job_id="12"), "Traceback ...\nValueError: bad on 1\n")
    write_failure(tmp_path, 2, _record(2, 6.0, True, job_id="12"), "lost")
    (tmp_path / "failures" / "rank-00003.json").write_text("{cut")  # a torn file is skipped, never fatal
    assert [r["rank"] for r in read_failures(tmp_path, "11")] == [0]
    latest = read_failures(tmp_path)
    assert [r["rank"] for r in latest] == [1, 2] and read_failures(tmp_path, "12", since=5.5)[0]["rank"] == 2
    assert Path(latest[0]["traceback"]).read_text().endswith("ValueError: bad on 1\n")
    assert read_failures(tmp_path / "none") == [] and not list(tmp_path.glob("failures/*.part"))


RAISING_RANK = """
import sys
from pathlib import Path
from hpc.observe.probe import Probe
from hpc.runtime.abort import FailureSite, run_as_rank

def step(probe):
    probe.set_step(5)
    raise RuntimeError("deliberate failure on rank 1 at step 5\\nsecond line")

site = FailureSite()

def body():
    site.run_path = Path(sys.argv[1])
    step(Probe())

run_as_rank(body, site)
"""


def test_a_failing_rank_records_itself_before_it_exits(tmp_path: Path) -> None:
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "HPC_JOB_ID": "local-1", "SLURMD_NODENAME": "node7"}
    done = subprocess.run([sys.executable, "-c", RAISING_RANK, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 1 and "hpc-rank: rank 1: error: deliberate failure" in done.stderr
    record = json.loads((tmp_path / "failures" / "rank-00001.json").read_text())
    assert {k: record[k] for k in ("rank", "world_size", "job_id", "host", "step", "type", "message", "peer_lost")} == {
        "rank": 1, "world_size": 2, "job_id": "local-1", "host": "node7", "step": 5, "type": "RuntimeError",
        "message": "deliberate failure on rank 1 at step 5", "peer_lost": False}
    assert "in step\n" in Path(record["traceback"]).read_text()


def _hpc(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc.cli.main", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_hpc_logs_leads_with_the_rank_that_failed_and_the_command_for_its_log(tmp_path: Path) -> None:
    from slurm.job_registry import JobRecord, Registry, failure_lines

    run = tmp_path / "run"
    Registry(tmp_path / "home" / "jobs").add(JobRecord("12", "failing", 4, str(run / "slurm"), (str(run),)))
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "12_0_log.out").write_text(f"hpc-rank: rank 0: error: {GLOO_CLOSED}\n")
    for rank, time, lost in ((0, 2.0, True), (1, 1.0, False), (2, 2.1, True)):
        write_failure(run, rank, _record(rank, time, lost), "")
    lead = "job 12: rank 1 (host vm, step 5) failed: ValueError: bad on 1 -- see: hpc logs 12 --rank 1"
    env = {**os.environ, "HPC_HOME": str(tmp_path / "home")}
    shown = _hpc(env, "logs", "12")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == lead and shown.stdout.splitlines()[-1] == lead
    assert _hpc(env, "logs", "12", "--rank", "0").stdout == f"hpc-rank: rank 0: error: {GLOO_CLOSED}\n"
    assert failure_lines(Registry.default(env).recent()) == [lead]


def test_sweep_status_names_each_failed_tasks_first_failing_rank(tmp_path: Path) -> None:
    from slurm.sweep import failure_lines

    tasks = [{"index": i, "run_path": str(tmp_path / f"task-{i:03d}"), "error": "rank 0 exited with code 1"}
             for i in range(3)]
    write_failure(Path(tasks[1]["run_path"]), 1, _record(1, 1.0, False, job_id="local-9"), "")
    local = {"job_id": None, "tasks": tasks}
    assert failure_lines(local, ["COMPLETED", "FAILED", "FAILED"]) == [
        f"task 1: rank 1 (host vm, step 5) failed: ValueError: bad on 1 -- see: {tmp_path}/task-001/failures/"
        "rank-00001.traceback", "task 2: rank 0 exited with code 1"]
    write_failure(Path(tasks[2]["run_path"]), 0, _record(0, 1.0, False, job_id="40_2"), "")
    assert failure_lines({"job_id": "40", "tasks": tasks}, ["COMPLETED", "COMPLETED", "FAILED"]) == [
        "task 2 (job 40_2): rank 0 (host vm, step 5) failed: ValueError: bad on 0 -- see: hpc logs 40_2 --rank 0"]


KILLED = "was killed by SIGKILL (signal 9: often the out-of-memory killer)"


def test_a_rank_that_died_without_a_record_leads_as_its_launcher_tells_it() -> None:
    killed = death_record(2, "vm", -9, "mpirun", job_id="12", world_size=4, time=1.5)
    records = [_record(0, 2.0, True), _record(1, 1.0, True), killed, _record(3, 2.1, True)]
    assert summarize_failures(records) == (f"rank 2 (host vm) {KILLED}", 2, None, True)
    exited = death_record(2, "vm", 3, "local", job_id="12", world_size=4, time=1.5)
    assert summarize_failures([exited]).text == "rank 2 (host vm) exited with code 3 without recording why"
    raised_first = summarize_failures([_record(1, 1.0, False), killed])  # its own failure, before the death
    assert raised_first.text == "rank 1 (host vm, step 5) failed: ValueError: bad on 1" and not raised_first.died
    assert describe_death(0, None, -11) == ("rank 0 was killed by SIGSEGV (signal 11: a crash in native code: a CUDA "
                                            "kernel, an extension, a library)")
    stalled = describe_death(1, "vm", 76, recorded=False)
    assert stalled.endswith("exited with code 76 (aborted by the stall inspector: see its report above)")


def test_the_launcher_records_a_death_only_for_a_rank_that_left_no_record(tmp_path: Path) -> None:
    from hpc.runtime.launch import RankDied, named_failure, record_death

    write_failure(tmp_path, 1, _record(1, 1.0, False, job_id="local-1"), "Traceback ...")
    raised = RankDied(1, "vm", 1, at=2.0, aftermath="; stopped the other 3 ranks")
    record_death(tmp_path, raised, "local", "local-1", 4, since=0.0)  # rank 1 recorded why: kept as it is
    assert str(named_failure(raised, tmp_path, "local-1", 0.0)).startswith(
        "rank 1 (host vm, step 5) failed: ValueError: bad on 1 (traceback: ")
    killed = RankDied(2, "vm", -9, at=3.0, aftermath="; stopped the other 3 ranks")
    record_death(tmp_path / "run", killed, "local", "local-2", 4, since=0.0)
    [record] = read_failures(tmp_path / "run", "local-2")
    assert {k: record[k] for k in ("rank", "host", "exit", "launcher", "world_size", "time", "traceback")} == {
        "rank": 2, "host": "vm", "exit": -9, "launcher": "local", "world_size": 4, "time": 3.0, "traceback": None}
    named = named_failure(killed, tmp_path / "run", "local-2", 0.0)
    assert (str(named), named.exit_code) == (f"rank 2 (host vm) {KILLED}; stopped the other 3 ranks", 137)
    assert [path.name for path in (tmp_path / "run" / "failures").iterdir()] == ["rank-00002.json"]
    seen_first = RankDied(1, "vm", 1, at=3.1, aftermath="; stopped the other 3 ranks")  # it saw rank 2 vanish
    seen_first.also = [RankDied(2, "vm", -9, at=3.1, aftermath="; stopped the other 3 ranks")]
    write_failure(tmp_path / "race", 1, _record(1, 3.0, True, job_id="local-3"), "lost")
    died = record_death(tmp_path / "race", seen_first, "local", "local-3", 4, since=0.0)
    named = named_failure(died, tmp_path / "race", "local-3", 0.0)
    assert (str(named), named.exit_code) == (f"rank 2 (host vm) {KILLED}; stopped the other 3 ranks", 137)
    raised.also = [RankDied(3, "vm", -9, at=3.1)]  # rank 1 raised: what else ended is not recorded
    assert record_death(tmp_path, raised, "local", "local-1", 4, since=0.0) is None
    assert [r["rank"] for r in read_failures(tmp_path, "local-1")] == [1]


# What Open MPI 4.1 printed when rank 2 of 4 was SIGKILLed, and when it called os._exit(3) (rank 1 saw it and
# called MPI_Abort); Open MPI 5's prterun names processes [prterun-vm-1234@1,2].
MPIRUN_KILLED = ["-" * 74, "mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 (Killed).",
                 "-" * 74]
MPIRUN_EXITED = ["MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD", "with errorcode 1.", "-" * 74,
                 "mpirun detected that one or more processes exited with non-zero status, thus causing",
                 "the job to be terminated. The first process to do so was:", "", "  Process name: [[16356,1],2]",
                 "  Exit code:    3", "-" * 74]


@pytest.mark.parametrize(("lines", "death"), [
    (MPIRUN_KILLED, (2, "vm", -9)),
    (MPIRUN_EXITED, (2, "b", 3)),
    (["prterun noticed that process rank 3 with PID 4711 on node n7 exited on signal 11 (Segmentation fault)."],
     (3, "n7", -11)),
    (["prterun detected that one or more processes exited with non-zero status", "Process name: [prterun-vm-1@1,1]",
      "Exit code: 4"], (1, "a", 4)),
    (["MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD", "Exit code: 1"], None),
])
def test_mpiruns_exit_report_names_the_first_rank_that_died(lines: list[str], death: tuple | None) -> None:
    from hpc.runtime.launch import MpirunReport, mpirun_host

    report = MpirunReport(lambda rank: mpirun_host(rank, [("a", 2), ("b", 2)]))
    for line in [*lines, *MPIRUN_KILLED[1:2]] if death else lines:  # a later report comes after the first
        report.read(line + "\n")
    first = report.first
    assert (first and (first.rank, first.host, first.returncode)) == death
    assert not death or [(also.rank, also.returncode) for also in first.also] == [(2, -9)]


def test_mpiruns_last_line_is_read_before_its_report_is(capfd) -> None:
    """mpirun prints which rank died just before it exits; seen exiting, its last lines may still be unread."""
    from hpc.runtime.launch import RankDied, run_mpirun

    filler = "".join(f"[vm:{i}] a long trace line {'x' * 40}\n" for i in range(1200))
    report = "\n".join(MPIRUN_KILLED) + "\n"
    stand_in = f"import os; os.write(2, ({filler!r} + {report!r}).encode()); os._exit(137)"
    with pytest.raises(RankDied) as died:
        run_mpirun([sys.executable, "-c", stand_in])
    assert (died.value.rank, died.value.host, died.value.returncode) == (2, "vm", -9)
    assert capfd.readouterr().err.splitlines()[-2:] == MPIRUN_KILLED[1:]


def test_mpirun_places_ranks_on_the_hosts_slots_in_order() -> None:
    import socket

    from hpc.runtime.launch import mpirun_host

    assert [mpirun_host(rank, [("a", 2), ("b", 1)]) for rank in range(4)] == ["a", "a", "b", None]
    assert mpirun_host(3) == os.environ.get("SLURMD_NODENAME", socket.gethostname())


ATTEMPT = ("submitit INFO (2026-11-27 20:40:04,822) - Starting with JobEnvironment(job_id=12, hostname=vm, "
           "local_rank=0(4), node=0(2), global_rank=0(4))\n")
# rank 0's log, which is also the batch script's output: srun's lines of a requeued job's two starts
SRUN_LOG = (f"{ATTEMPT}srun: error: vm: task 1: Segmentation fault (core dumped)\n{ATTEMPT}"
            f"hpc-rank: rank 0: error: {GLOO_CLOSED}\nsrun: error: vm: tasks 0-1,3: Exited with exit code 1\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=12.0\nsrun: error: node2: task 2: Killed\n"
            "srun: Force Terminated StepId=12.0\n")


def test_srun_names_the_task_that_died_without_a_record() -> None:
    from slurm.job_registry import srun_death

    assert srun_death(SRUN_LOG, [0, 1, 3], "12") == death_record(2, "node2", -9, "srun", job_id="12")
    assert srun_death(SRUN_LOG, [], "12")["rank"] == 1  # alone on its line: srun's killing of the rest comes after
    assert srun_death(SRUN_LOG, [0, 1, 2, 3], "12") is None and srun_death("", [], "12") is None
    together = "srun: error: vm: tasks 0,2: Killed\nsrun: error: vm: task 3: Exited with exit code 3\n"
    assert srun_death(together, [], "12") == death_record(3, "vm", 3, "srun", job_id="12")
    assert srun_death("srun: error: vm: task 5: Segmentation fault (core dumped)\n", [], "12")["exit"] == -11


def test_status_logs_and_sweep_status_name_the_task_srun_saw_killed(tmp_path: Path, monkeypatch) -> None:
    from slurm import sweep
    from slurm.job_registry import JobRecord, Registry, failure_lines

    run, home = tmp_path / "run", tmp_path / "home"
    Registry(home / "jobs").add(JobRecord("12", "dying", 4, str(run / "slurm"), (str(run),)))
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "12_0_log.out").write_text(SRUN_LOG)
    for rank in (0, 1, 3):
        write_failure(run, rank, _record(rank, 2.0 + rank, True), "")
    lead = f"job 12: rank 2 (host node2) {KILLED} -- see: hpc logs 12 --rank 2"
    env = {**os.environ, "HPC_HOME": str(home)}
    shown = _hpc(env, "logs", "12")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == lead and shown.stdout.splitlines()[-1] == lead
    assert failure_lines(Registry.default(env).recent()) == [lead]
    monkeypatch.setenv("HPC_HOME", str(home))
    Registry.default().add(JobRecord("40", "sweep", 4, str(run / "slurm"), (str(run),), array=True))
    (run / "slurm" / "40_0_0_log.out").write_text(SRUN_LOG.replace("job_id=12", "job_id=40_0"))
    for rank in (0, 1, 3):
        write_failure(run, rank, _record(rank, 2.0 + rank, True, job_id="40_0"), "")
    tasks = [{"index": 0, "run_path": str(run)}]
    assert sweep.failure_lines({"job_id": "40", "tasks": tasks}, ["FAILED"]) == [
        f"task 0 (job 40_0): rank 2 (host node2) {KILLED} -- see: hpc logs 40_0 --rank 2"]


def test_nccls_flight_recorder_is_on_and_dumps_into_the_failures_directory_unless_the_user_chose(tmp_path) -> None:
    from hpc.rundir import FAILURES_DIR, FLIGHT_RECORDER_PREFIX, enable_flight_recorder

    environ: dict[str, str] = {}
    enable_flight_recorder(tmp_path, environ)
    assert environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert not any(name.startswith("TORCH_NCCL_") and name != "TORCH_NCCL_DUMP_ON_TIMEOUT" for name in environ)
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / FAILURES_DIR / FLIGHT_RECORDER_PREFIX)
    assert (tmp_path / FAILURES_DIR).is_dir()
    chosen = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr-"}
    enable_flight_recorder(tmp_path / "other", chosen)
    assert chosen["TORCH_FR_BUFFER_SIZE"] == "0" and chosen["TORCH_FR_DUMP_TEMP_FILE"] == "/scratch/fr-"
    assert not (tmp_path / "other").exists()

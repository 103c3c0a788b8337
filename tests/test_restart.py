"""Restart inside the allocation (slurm/restart.py, issue 42): the decision from what a failed step left, the batch
script's ``srun`` function run by bash against a stand-in srun, and on the local Slurm a job whose rank is killed
mid-run that restarts in its allocation and ends at the parameters of a job never killed, and a user's exception at
the same step that is retried once, not twice."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from hpc.config import SlurmConfig
from hpc.rundir import write_failure
from slurm.job_registry import RESTARTS_FILE, describe_restart, read_restarts, restart_recovery
from slurm.restart import Failure, decide, failure_of, srun_options, step_loop
from tests.test_slurm_failures import DYING_MODEL, FAILING_MODEL, SPEC
from tests.test_submit import _hpc, _submitted, _wait_done


def _failure(kind: str, step: int | None = 5, host: str | None = "node1", error: str | None = None) -> Failure:
    return Failure("rank 1 failed", 1, host, step, kind, error)


def _slurm(**given) -> SlurmConfig:
    return SlurmConfig(**{"nodes": 2, "max_restarts": 3, **given})


def test_a_node_death_excludes_the_node_while_spares_last_then_ends_naming_it() -> None:
    first = decide(_failure("node"), [], _slurm(spare_nodes=1))
    assert first.restart and (first.exclude, first.nodes) == (("node1",), 2) and "without node node1" in first.reason
    again = decide(_failure("node", host="node2"), [{"restart": True, "exclude": ["node1"]}], _slurm(spare_nodes=1))
    assert not again.restart and again.reason == "no spare node left to replace node2 (slurm.spare_nodes = 1 " \
                                                 "taken; slurm.elastic is off)"
    in_place = decide(_failure("node"), [], _slurm())  # no spares at all: the same nodes, the node may be fine
    assert in_place.restart and (in_place.exclude, in_place.nodes) == ((), 2)
    assert not decide(_failure("node"), [{"restart": True, "exclude": []}] * 3, _slurm(spare_nodes=1)).restart


def test_elastic_goes_on_with_the_nodes_that_remain_once_the_spares_are_taken() -> None:
    spared = decide(_failure("node"), [], _slurm(spare_nodes=1, elastic=True))
    assert (spared.exclude, spared.nodes) == (("node1",), 2)
    shrunk = decide(_failure("node", host="node2"), [{"restart": True, "exclude": ["node1"]}],
                    _slurm(spare_nodes=1, elastic=True))
    assert shrunk.restart and (shrunk.exclude, shrunk.nodes) == (("node1", "node2"), 1) and "elastic" in shrunk.reason
    alone = decide(_failure("node", host="node0"), [], _slurm(nodes=1, elastic=True))
    assert not alone.restart and alone.reason == "no node left without node0"
    assert srun_options(1, 4, ("node1", "node2")) == "--nodes=1 --ntasks=4 --exclude=node1,node2"


def test_a_users_error_is_not_retried_but_a_lone_exception_is() -> None:
    assert not decide(_failure("config", error="ConfigError"), [], _slurm()).restart
    once = decide(_failure("exception", error="RuntimeError"), [], _slurm())
    assert once.restart and once.exclude == ()  # an exception is no node's fault
    previous = [{"restart": True, "error": "RuntimeError", "step": 5, "exclude": []}]
    twice = decide(_failure("exception", error="RuntimeError"), previous, _slurm())
    assert not twice.restart and "same RuntimeError at the same step" in twice.reason
    assert decide(_failure("exception", step=9, error="RuntimeError"), previous, _slurm()).restart


def test_the_failure_is_the_first_own_record_else_srun_s_account_of_a_silent_death(tmp_path: Path) -> None:
    since = time.time() - 1
    write_failure(tmp_path, 0, {"job_id": "7", "time": since + 0.5, "peer_lost": True, "type": "DistError",
                                "message": "Connection closed by peer", "host": "node0", "step": 4}, None)
    log = tmp_path / "slurm"
    log.mkdir()
    (log / "7_0_log.out").write_text("Starting with JobEnvironment(...)\nsrun: error: node1: task 1: Killed\n")
    failure = failure_of(tmp_path, log, "7", since)
    assert (failure.kind, failure.rank, failure.host) == ("node", 1, "node1") and "SIGKILL" in failure.text
    write_failure(tmp_path, 1, {"job_id": "7", "time": since + 0.2, "peer_lost": False, "type": "ConfigError",
                                "message": "model.args: no such argument", "host": "node1", "step": None}, None)
    assert failure_of(tmp_path, log, "7", since).kind == "config"
    assert failure_of(tmp_path, log, "7", time.time() + 1).kind == "node"  # records older than the step: not its
    write_failure(tmp_path, 0, {"job_id": "7", "time": since + 0.1, "peer_lost": False, "type": "CollectiveStalled",
                                "message": "rank 0 (node0) has waited 9 s ...; not arrived: rank 1 (node1, ...)",
                                "host": "node0", "step": 4, "blamed_hosts": ["node1"]}, None)
    stalled = failure_of(tmp_path, log, "7", since)
    assert (stalled.kind, stalled.rank, stalled.host) == ("node", 0, "node1")  # the rank waited for, not the waiter


def test_steps_lost_and_the_time_to_the_next_step_come_from_the_metrics(tmp_path: Path) -> None:
    failed_at = 1000.0
    lines = [{"step": s, "time": 990.0 + s} for s in range(1, 8)] + [{"step": s, "time": 1005.0 + s} for s in (7, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    entry = {"failed_at": failed_at, "restart": True, "reason": "restart 1 of 2", "cause": "rank 1 was killed"}
    assert restart_recovery(tmp_path, entry) == (1, 12.0)  # step 7 ran again; it ended 12 s after the failure
    assert describe_restart(tmp_path, entry) == "restart 1 of 2: rank 1 was killed; 1 step lost, next step 12.0 s " \
                                                "after it"


FAKE_SRUN = """#!/bin/bash
# Stands in for srun: records its arguments and attempt; the first step dies as srun reports a killed task.
echo "$HPC_RESTART_ATTEMPT $*" >> "$CALLS"
if [ "$HPC_RESTART_ATTEMPT" = 0 ]; then
    echo "Starting with JobEnvironment(...)" >> "$LOG"
    echo "srun: error: node1: task 1: Killed" >> "$LOG"
    exit 9
fi
exit 0
"""


def test_the_batch_scripts_srun_runs_the_step_again_without_the_dead_node(tmp_path: Path) -> None:
    """The generated function, run by bash: srun (a stand-in) fails once, slurm/restart.py decides, the second
    step runs with the dead node excluded on the spare, sized to the job's nodes, and the script ends 0."""
    bin_dir, run, logs = tmp_path / "bin", tmp_path / "run", tmp_path / "run" / "slurm"
    for directory in (bin_dir, logs):
        directory.mkdir(parents=True)
    fake = bin_dir / "srun"
    fake.write_text(FAKE_SRUN)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    slurm = SlurmConfig(nodes=2, ntasks_per_node=2, max_restarts=2, spare_nodes=1)
    script = "\n".join([*step_loop(slurm, run, logs), "srun --unbuffered python -m job"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "CALLS": str(tmp_path / "calls"), "LOG": str(logs / "77_0_log.out"), "PYTHONPATH": str(Path.cwd())}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["0 --nodes=2 --ntasks=4 --unbuffered python -m job",
                     "1 --nodes=2 --ntasks=4 --exclude=node1 --unbuffered python -m job"]
    [entry] = read_restarts(run, "77")
    assert (entry["restart"], entry["host"], entry["exclude"]) == (True, "node1", ["node1"])
    assert "hpc: restart 1 of 2, without node node1 (spare 1 of 1 taken): rank 1 (host node1) was killed by " \
           "SIGKILL" in done.stderr
    assert not step_loop(SlurmConfig(), run, logs)  # max_restarts 0: no function, srun as submitit writes it


def test_spares_are_allocated_beside_the_nodes_and_survive_a_node_failure(tmp_path: Path) -> None:
    from slurm.submit import executor_parameters

    slurm = SlurmConfig(nodes=2, gpus_per_node=4, max_restarts=2, spare_nodes=1)
    loop = step_loop(slurm, tmp_path, tmp_path / "slurm")
    params = executor_parameters(slurm, "job", restart_loop=loop)
    assert params["nodes"] == 3 and params["additional_parameters"]["no_kill"] is True
    assert params["setup"][-len(loop):] == loop and 'options="--nodes=2 --ntasks=8"' in "\n".join(loop)
    assert "no_kill" not in executor_parameters(SlurmConfig(nodes=2, max_restarts=2), "job")["additional_parameters"]


# --- on the local Slurm ----------------------------------------------------------------------------------------

RESTART_SPEC = SPEC.replace("steps = 20", "steps = 12").replace("[slurm]", "[checkpoint]\nevery_steps = 3\n[slurm]")
KILLED_ONCE = DYING_MODEL.replace("if dist.get_rank() == die_rank and len(calls) == die_step:",
                                  'if (dist.get_rank() == die_rank and len(calls) == die_step\n'
                                  '                    and os.environ.get("HPC_RESTART_ATTEMPT") == "0"):')


def _job(cluster, name: str, model: str, source: str) -> tuple[dict[str, str], Path, Path]:
    """(env, spec, runs) of a job named ``name`` whose model entry is ``source``, written as ``model``.py."""
    state = cluster.state
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "HPC_HOME": str(state / f"hpc-home-{name}")}
    (state / f"{model}.py").write_text(source)
    spec = state / f"{name}.toml"
    spec.write_text(RESTART_SPEC.replace("failing_model:build", f"{model}:build"))
    return env, spec, state / f"{name}-runs"


def _assert_same_final_parameters(runs: Path, ours: str, reference: str) -> None:
    import torch

    from hpc.checkpoint import open_checkpoint, read_tensor

    mine, theirs = (open_checkpoint(runs / name / "checkpoints" / "step-00000012") for name in (ours, reference))
    assert set(mine.tensors) == set(theirs.tensors)
    for name in mine.tensors:
        assert torch.equal(read_tensor(mine, name), read_tensor(theirs, name)), name


@pytest.mark.slow
def test_a_killed_rank_restarts_in_the_allocation_and_ends_as_the_job_never_killed(slurm_cluster) -> None:
    """Rank 1 of 2 is SIGKILLed at step 8 of the first step: the job restarts in its allocation from step 6's
    checkpoint, completes, and its final parameters equal a job's never killed, bit for bit; hpc status says so."""
    state = slurm_cluster.state
    env, spec, runs = _job(slurm_cluster, "restart", "killed_once", KILLED_ONCE)
    common = ("--ntasks-per-node", "2", "--max-restarts", "1", "--set", f"job.run_dir={runs}",
              "--set", "model.args.die_rank=1", "--set", "model.args.die_step=8")
    killed = _submitted(_hpc(env, "submit", str(spec), *common, "--set", "job.name=killed", cwd=state))
    never = _submitted(_hpc(env, "submit", str(spec), *common, "--set", "job.name=never",
                            "--set", "model.args.die_step=0", cwd=state))
    assert _wait_done(env, killed) == {killed: "COMPLETED"} and _wait_done(env, never) == {never: "COMPLETED"}
    [entry] = read_restarts(runs / "killed", killed)
    assert entry["restart"] and entry["rank"] == 1 and entry["exclude"] == []
    steps = [json.loads(line)["step"] for line in (runs / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [*range(1, 8), *range(7, 13)], steps  # step 8 never ended; from step 6's checkpoint: 7 again
    status = _hpc(env, "status", killed).stdout.splitlines()
    assert status[0].startswith(f"job {killed}: restart 1 of 1: rank 1 (host {slurm_cluster.nodes[0]}) was killed "
                                "by SIGKILL") and "1 step lost, next step" in status[0], status
    assert status[2].split()[:3] == [killed, "killed", "COMPLETED"], status
    _assert_same_final_parameters(runs, "killed", "never")


@pytest.mark.slow
def test_an_exception_at_the_same_step_twice_is_not_retried_a_third_time(slurm_cluster) -> None:
    state = slurm_cluster.state
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "HPC_HOME": str(state / "hpc-home-restart-user")}
    (state / "failing_model.py").write_text(FAILING_MODEL)
    spec, runs = state / "user-error.toml", state / "user-error-runs"
    spec.write_text(SPEC)  # no checkpoint: each restart starts from step 0 and fails at step 5 again
    job = _submitted(_hpc(env, "submit", str(spec), "--ntasks-per-node", "2", "--max-restarts", "3",
                          "--set", f"job.run_dir={runs}", cwd=state))
    assert _wait_done(env, job) == {job: "FAILED"}
    entries = read_restarts(runs / "failing", job)
    assert [(e["restart"], e["error"], e["step"]) for e in entries] == [(True, "RuntimeError", 5),
                                                                         (False, "RuntimeError", 5)]
    status = _hpc(env, "status", job).stdout.splitlines()
    assert status[1] == f"job {job}: not restarted: the same RuntimeError at the same step as before: the user's, " \
                        "not retried", status
    assert status[2].startswith(f"job {job}: rank 1 (host {slurm_cluster.nodes[0]}, step 5) failed: RuntimeError")
    assert (runs / "failing" / RESTARTS_FILE).exists()


@pytest.mark.slow
def test_a_dead_node_is_excluded_and_the_spare_takes_its_place(slurm_cluster_3nodes) -> None:
    """2 nodes and 1 spare, a rank a node: node 1's rank is SIGKILLed at step 8; the step runs again on nodes 0 and
    2 from step 6's checkpoint and ends at a 2-node job's parameters, bit for bit."""
    cluster = slurm_cluster_3nodes
    state, nodes = cluster.state, cluster.nodes
    env, spec, runs = _job(cluster, "spare", "killed_once", KILLED_ONCE)
    common = ("--nodes", "2", "--set", f"job.run_dir={runs}", "--set", "model.args.die_rank=1",
              "--set", "model.args.die_step=8")
    spared = _submitted(_hpc(env, "submit", str(spec), *common, "--max-restarts", "1", "--spare-nodes", "1",
                             "--set", "job.name=spared", cwd=state))
    never = _submitted(_hpc(env, "submit", str(spec), *common, "--set", "model.args.die_step=0",
                            "--set", "job.name=never", cwd=state))
    assert _wait_done(env, spared) == {spared: "COMPLETED"} and _wait_done(env, never) == {never: "COMPLETED"}
    [entry] = read_restarts(runs / "spared", spared)
    assert (entry["host"], entry["exclude"]) == (nodes[1], [nodes[1]]), entry
    steps = subprocess.run(["sacct", "-n", "-P", "-j", spared, "-o", "JobID,NodeList"], env=env, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    step_nodes = [line.split("|")[1] for line in steps if line.split("|")[0] in (f"{spared}.0", f"{spared}.1")]
    assert step_nodes == ["hpcnode[0-1]", "hpcnode[0,2]"], steps
    _assert_same_final_parameters(runs, "spared", "never")


@pytest.mark.slow
def test_a_node_failing_its_health_check_is_excluded_before_step_1(slurm_cluster_3nodes) -> None:
    """Node 1's scratch is a full 1 MiB tmpfs (mounted in its namespace): its health check fails before any step,
    the restart runs on nodes 0 and 2, and every step runs once."""
    from slurm.testbed import cluster as testbed

    cluster = slurm_cluster_3nodes
    state, nodes = cluster.state, cluster.nodes
    slurmd = next(d for d in testbed.daemons(testbed.read_record(state)) if d.name == f"slurmd-{nodes[1]}")
    (state / "nodes" / nodes[1] / "tmp" / "hpc-scratch").mkdir(exist_ok=True)
    in_node = ["nsenter", "-t", str(slurmd.pid), "-m"]
    subprocess.run([*in_node, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/tmp/hpc-scratch"], check=True)
    try:
        env = {**cluster.env, "OMP_NUM_THREADS": "1", "HPC_HOME": str(state / "hpc-home-health"),
               "SLURM_TMPDIR": "/tmp/hpc-scratch"}
        spec, runs = state / "health.toml", state / "health-runs"
        spec.write_text(RESTART_SPEC.replace('[model]\nentry = "failing_model:build"', "[model]"))
        job = _submitted(_hpc(env, "submit", str(spec), "--nodes", "2", "--max-restarts", "1", "--spare-nodes", "1",
                              "--set", "train.health_check=true", "--set", f"job.run_dir={runs}", cwd=state))
        assert _wait_done(env, job) == {job: "COMPLETED"}
    finally:
        subprocess.run([*in_node, "umount", "/tmp/hpc-scratch"], check=True)
    [entry] = read_restarts(runs / "failing", job)
    assert (entry["error"], entry["host"], entry["step"], entry["exclude"]) == ("NodeUnhealthy", nodes[1], None,
                                                                               [nodes[1]]), entry
    assert "scratch /tmp/hpc-scratch is not writable: No space left on device" in entry["cause"]
    steps = [json.loads(line)["step"] for line in (runs / "failing" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))


KILLED_ONCE_EVER = DYING_MODEL.replace("def build(die_rank=2, die_step=2, how=\"kill\"):",
                                       "def build(die_rank=2, die_step=2, how=\"kill\", stamp=\"\"):").replace(
    "if dist.get_rank() == die_rank and len(calls) == die_step:",
    "if dist.get_rank() == die_rank and len(calls) == die_step and not os.path.exists(stamp):\n"
    "                open(stamp, \"w\").close()")


@pytest.mark.slow
def test_elastic_goes_on_with_one_node_and_ends_as_a_run_that_changed_its_layout_there(slurm_cluster_3nodes) -> None:
    """2 nodes, no spare, elastic: node 1's rank is SIGKILLed at step 8; the step runs again on node 0 alone (dp 2 ->
    1, the same global batch) from step 6's checkpoint, and ends at the parameters of a job killed alike and then
    resubmitted on one node, bit for bit."""
    cluster = slurm_cluster_3nodes
    state, nodes = cluster.state, cluster.nodes
    env, spec, runs = _job(cluster, "elastic", "killed_once_ever", KILLED_ONCE_EVER)

    def submit(name: str, *options: str) -> str:
        return _submitted(_hpc(env, "submit", str(spec), *options, "--set", f"job.run_dir={runs}", "--set",
                               f"job.name={name}", "--set", "model.args.die_rank=1", "--set", "model.args.die_step=8",
                               "--set", f"model.args.stamp={state / f'{name}.killed'}", cwd=state))

    elastic = submit("elastic", "--nodes", "2", "--max-restarts", "1", "--elastic")
    killed = submit("reference", "--nodes", "2")
    assert _wait_done(env, elastic) == {elastic: "COMPLETED"} and _wait_done(env, killed) == {killed: "FAILED"}
    resubmitted = submit("reference", "--nodes", "1")
    assert _wait_done(env, resubmitted) == {resubmitted: "COMPLETED"}
    [entry] = read_restarts(runs / "elastic", elastic)
    assert (entry["host"], entry["exclude"], entry["nodes"]) == (nodes[1], [nodes[1]], 1), entry
    steps = subprocess.run(["sacct", "-n", "-P", "-j", elastic, "-o", "JobID,NodeList"], env=env, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert [line.split("|")[1] for line in steps if line.split("|")[0] in (f"{elastic}.0", f"{elastic}.1")] == [
        "hpcnode[0-1]", "hpcnode0"], steps
    _assert_same_final_parameters(runs, "elastic", "reference")


SLOWED_MODEL = '''
import time

import torch
import torch.distributed as dist


class Slowed(torch.nn.Linear):
    def __init__(self, rank, sleep_s):
        super().__init__(64, 10)
        self.slowed, self.sleep_s = rank, sleep_s

    def forward(self, x):
        if dist.get_rank() == self.slowed:
            time.sleep(self.sleep_s)
        return super().forward(x)

    def loss(self, output, targets):
        return torch.nn.functional.cross_entropy(output, targets)


def build(rank=1, sleep_s=0.05):
    return Slowed(rank, sleep_s)
'''


@pytest.mark.slow
def test_a_rank_slowed_on_purpose_is_named_by_hpc_status(slurm_cluster_3nodes) -> None:
    """2 nodes of one rank: node 1's rank sleeps 50 ms in every forward; the job's metrics name it, with its host,
    and so does hpc status."""
    cluster = slurm_cluster_3nodes
    state, nodes = cluster.state, cluster.nodes
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "HPC_HOME": str(state / "hpc-home-slowed")}
    (state / "slowed_model.py").write_text(SLOWED_MODEL)
    spec, runs = state / "slowed.toml", state / "slowed-runs"
    spec.write_text(SPEC.replace("failing_model:build", "slowed_model:build").replace("batch_size = 64",
                                                                                      "batch_size = 12"))
    threshold = ("--set", "train.straggler_threshold=1.5")  # of two ranks, the median is their mean: below 2x
    job = _submitted(_hpc(env, "submit", str(spec), "--nodes", "2", "--set", f"job.run_dir={runs}",
                          "--set", "train.steps=12", "--set", "train.straggler_every=4", *threshold, cwd=state))
    assert _wait_done(env, job) == {job: "COMPLETED"}
    status = _hpc(env, "status", job).stdout.splitlines()
    assert status[0].startswith(f"job {job}: straggler: rank 1 on {nodes[1]}, from step "), status
    assert status[1].split()[0] == "JOB" and len(status) == 3, status


@pytest.mark.slow
def test_a_spare_resumes_from_the_node_local_tier_through_the_peer_copies(slurm_cluster_3nodes) -> None:
    """Local checkpoints every 2 steps in each node's private /tmp, the persistent one every 10: node 1's rank is
    killed at step 8, the spare (node 2, an empty /tmp) gets its shards from node 0's peer copies, resumes at step
    6 (not 0), and the job ends bit for bit equal to one never killed."""
    cluster = slurm_cluster_3nodes
    env, spec, runs = _job(cluster, "local", "killed_once", KILLED_ONCE)
    tiers = ("--set", "checkpoint.every_steps=10", "--set", "checkpoint.local_every_steps=2")
    common = ("--nodes", "2", "--set", f"job.run_dir={runs}", "--set", "model.args.die_rank=1",
              "--set", "model.args.die_step=8", *tiers)
    spared = _submitted(_hpc(env, "submit", str(spec), *common, "--max-restarts", "1", "--spare-nodes", "1",
                             "--set", "job.name=spared", cwd=cluster.state))
    never = _submitted(_hpc(env, "submit", str(spec), *common, "--set", "model.args.die_step=0",
                            "--set", "job.name=never", cwd=cluster.state))
    assert _wait_done(env, spared) == {spared: "COMPLETED"} and _wait_done(env, never) == {never: "COMPLETED"}
    [entry] = read_restarts(runs / "spared", spared)
    assert entry["exclude"] == [cluster.nodes[1]], entry
    steps = [json.loads(line)["step"] for line in (runs / "spared" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [*range(1, 8), *range(7, 13)], steps  # from the local step 6: the persistent tier had none
    log = (runs / "spared" / "slurm" / f"{spared}_0_log.out").read_text()
    assert "/hpc-local/spared-" in log and "step-00000006 at step 6" in log
    _assert_same_final_parameters(runs, "spared", "never")


HUNG_ONCE = KILLED_ONCE.replace("os.kill(os.getpid(), 9)  # as the out-of-memory killer does",
                                "__import__('time').sleep(3600)  # hangs: a frozen GPU, a wedged filesystem")


@pytest.mark.slow
def test_a_hung_rank_is_aborted_by_the_stall_inspector_and_its_node_replaced(slurm_cluster_3nodes) -> None:
    """Node 1's rank hangs in step 8: rank 0's stall inspector aborts the step after 5 s naming it, the restart
    blames node 1 (the rank that never arrived, not the one that waited) and the spare takes its place."""
    cluster = slurm_cluster_3nodes
    env, spec, runs = _job(cluster, "hung", "hung_once", HUNG_ONCE)
    job = _submitted(_hpc(env, "submit", str(spec), "--nodes", "2", "--max-restarts", "1", "--spare-nodes", "1",
                          "--set", f"job.run_dir={runs}", "--set", "model.args.die_rank=1", "--set",
                          "model.args.die_step=8", "--set", "train.stall_warn_s=2", "--set", "train.stall_abort_s=5",
                          cwd=cluster.state))
    assert _wait_done(env, job) == {job: "COMPLETED"}
    [entry] = read_restarts(runs / "failing", job)
    assert (entry["error"], entry["rank"], entry["host"], entry["exclude"]) == (
        "CollectiveStalled", 0, cluster.nodes[1], [cluster.nodes[1]]), entry
    assert "not arrived: rank 1" in entry["cause"]

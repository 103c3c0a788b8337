"""A real Slurm on this machine (slurm/testbed/cluster.py): accounting, task ids, requeue and admission on
one node; node names and a Gloo all-reduce through ``hpc.init()`` across namespace nodes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from slurm.testbed import cluster

pytestmark = pytest.mark.slow


def _slurm(env: dict[str, str], *argv: str, timeout: float = 60) -> str:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}"
    return proc.stdout


def _wait_for(what: str, check: Callable[[], object], timeout_s: float = 30) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.2)
    return value


@pytest.mark.skipif(cluster.unavailable() is not None, reason=str(cluster.unavailable()))
def test_a_state_directory_the_daemon_users_cannot_reach_is_refused(tmp_path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(cluster.ClusterError, match=f"{private} is not searchable by other users"):
        cluster.start(private / "state")
    assert not (private / "state").exists()


def test_start_on_a_running_cluster_does_nothing(slurm_cluster) -> None:
    before = cluster.read_record(slurm_cluster.state)["daemons"]
    assert cluster.start(slurm_cluster.state) is False
    assert cluster.read_record(slurm_cluster.state)["daemons"] == before
    running, report = cluster.status(slurm_cluster.state)
    assert running and "idle" in report


def test_batch_job_reaches_completed_in_accounting(slurm_cluster) -> None:
    out = slurm_cluster.state / "hostname.out"
    job = _slurm(slurm_cluster.env, "sbatch", "--parsable", "-o", str(out), "--wrap", "hostname").strip()

    def state() -> str:
        return _slurm(slurm_cluster.env, "sacct", "-X", "-n", "-P", "-j", job, "-o", "State").strip()

    assert _wait_for(f"job {job} COMPLETED in sacct", lambda: state() == "COMPLETED")
    assert out.read_text().strip() == socket.gethostname()


def test_srun_tasks_see_their_rank_and_count(slurm_cluster) -> None:
    out = _slurm(slurm_cluster.env, "srun", "-n", "2", "sh", "-c", 'echo "$SLURM_PROCID $SLURM_NTASKS"')
    assert sorted(out.split("\n")[:-1]) == ["0 2", "1 2"]


def test_requeued_job_runs_again(slurm_cluster) -> None:
    starts = slurm_cluster.state / "requeue.starts"
    script = f'echo "${{SLURM_RESTART_COUNT:-0}}" >> {starts}; sleep 120'
    job = _slurm(slurm_cluster.env, "sbatch", "--parsable", "--requeue", "-o", "/dev/null", "--wrap", script).strip()
    try:
        _wait_for("the first start", lambda: starts.exists() and starts.read_text() == "0\n")
        _slurm(slurm_cluster.env, "scontrol", "requeue", job)
        _wait_for("the start after requeue", lambda: starts.read_text() == "0\n1\n", timeout_s=40)
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster.env)


def test_impossible_request_is_rejected_at_submission(slurm_cluster) -> None:
    argv = ["sbatch", "-n", "100", "--job-name", "impossible", "--wrap", "true"]
    proc = subprocess.run(argv, env=slurm_cluster.env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "More processors requested than permitted" in proc.stderr
    assert _slurm(slurm_cluster.env, "squeue", "-h", "-n", "impossible") == ""


def test_namespace_nodes_have_their_own_hostnames(slurm_cluster_3nodes) -> None:
    assert slurm_cluster_3nodes.nodes == ("hpcnode0", "hpcnode1", "hpcnode2")
    out = _slurm(slurm_cluster_3nodes.env, "srun", "-N", "3", "-n", "3", "hostname")
    assert sorted(out.split()) == list(slurm_cluster_3nodes.nodes)


# Runs on each task: joins through hpc.init() from the SLURM_* variables alone.
ALLREDUCE = """
import json, socket, torch, torch.distributed as dist, hpc
torch.set_num_threads(1)
world = hpc.init("gloo", init_timeout_s=60)
total = torch.tensor([float(world.rank + 1)])
dist.all_reduce(total)
info = world.info
print(json.dumps({"rank": world.rank, "size": world.size, "local_rank": info.local_rank, "node_rank": info.node_rank,
                  "hosts": info.hosts, "hostname": socket.gethostname(), "rendezvous": world.rendezvous.addr,
                  "sum": total.item()}), flush=True)
hpc.shutdown()
"""


def test_gloo_allreduce_across_two_nodes_through_hpc_init(slurm_cluster_3nodes) -> None:
    nodes = list(slurm_cluster_3nodes.nodes[:2])
    out = _slurm(slurm_cluster_3nodes.env, "srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "--kill-on-bad-exit=1",
                 sys.executable, "-c", ALLREDUCE, timeout=180)
    ranks = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["hostname"] for r in ranks] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        assert r["size"] == 4 and r["hosts"] == nodes and r["rendezvous"] == nodes[0]
        assert r["sum"] == 1 + 2 + 3 + 4

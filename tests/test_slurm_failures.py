"""A job whose rank 1 raises at step 5, on the local Slurm (2 and 4 ranks) and under ``hpc run`` (local ranks and
mpirun): ``hpc status``, ``hpc logs`` and ``hpc run`` name rank 1 and its error first, not the other ranks'
"Connection closed by peer" (issue 28). A job whose rank 2 of 4 dies without an exception (SIGKILL, as from the
out-of-memory killer, or ``os._exit(3)``) at step 2: the same commands name rank 2, its host and its signal or exit
code, as its launcher saw them (issue 39). The records behind them are tested fast in tests/test_failures.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launch import needs_mpi
from tests.test_submit import _hpc, _submitted, _wait_done

REPO = Path(__file__).resolve().parent.parent
CAUSE = "RuntimeError: deliberate failure on rank 1 at step 5"
# A user's model entry (imported from the job's working directory) whose forward raises on one rank at one step.
FAILING_MODEL = '''
import torch.distributed as dist

from jobs.models.mlp import mlp


def build(fail_rank=1, fail_step=5):
    model = mlp(hidden_sizes=[32])
    calls = []

    def fail_there(module, inputs):
        if module.training:
            calls.append(1)
            if dist.get_rank() == fail_rank and len(calls) == fail_step:
                raise RuntimeError(f"deliberate failure on rank {fail_rank} at step {fail_step}")

    model.register_forward_pre_hook(fail_there)
    return model
'''
SPEC = """
[job]
name = "failing"
seed = 1
[model]
entry = "failing_model:build"
[data]
batch_size = 64
[train]
steps = 20
lr = 0.05
log_every = 100
[slurm]
time = "10"
"""


# A user's model entry whose rank die_rank dies at step die_step without a Python exception.
DYING_MODEL = '''
import os

import torch.distributed as dist

from jobs.models.mlp import mlp


def build(die_rank=2, die_step=2, how="kill"):
    model = mlp(hidden_sizes=[32])
    calls = []

    def die_there(module, inputs):
        if module.training:
            calls.append(1)
            if dist.get_rank() == die_rank and len(calls) == die_step:
                if how == "kill":
                    os.kill(os.getpid(), 9)  # as the out-of-memory killer does
                os._exit(3)

    model.register_forward_pre_hook(die_there)
    return model
'''
DEATHS = {"kill": "was killed by SIGKILL (signal 9: often the out-of-memory killer)",
          "exit": "exited with code 3 without recording why"}


def _write_job(directory: Path) -> Path:
    (directory / "failing_model.py").write_text(FAILING_MODEL)
    spec = directory / "failing.toml"
    spec.write_text(SPEC)
    return spec


def _write_dying_job(directory: Path) -> Path:
    (directory / "dying_model.py").write_text(DYING_MODEL)
    spec = directory / "dying.toml"
    spec.write_text(SPEC.replace("failing_model:build", "dying_model:build").replace('"failing"', '"dying"'))
    return spec


def _records(run: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in map(json.loads, map(Path.read_text, (run / "failures").glob("rank-*.json")))}


@pytest.mark.slow
def test_status_and_logs_of_a_slurm_job_name_the_rank_that_raised(slurm_cluster) -> None:
    state, node = slurm_cluster.state, slurm_cluster.nodes[0]
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "HPC_HOME": str(state / "hpc-home-failures")}
    spec, runs = _write_job(state), state / "failure-runs"
    jobs = {ranks: _submitted(_hpc(env, "submit", str(spec), "--ntasks-per-node", str(ranks), "--set",
                                   f"job.run_dir={runs}", "--set", f"job.name=failing-{ranks}", cwd=state))
            for ranks in (2, 4)}
    for ranks, job in jobs.items():
        assert _wait_done(env, job) == {job: "FAILED"}
        lead = f"job {job}: rank 1 (host {node}, step 5) failed: {CAUSE} -- see: hpc logs {job} --rank 1"
        status = _hpc(env, "status", job)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0] == lead, status.stdout
        assert lines[2].split()[:3] == [job, f"failing-{ranks}", "FAILED"]
        logs = _hpc(env, "logs", job)
        assert logs.returncode == 0 and logs.stdout.splitlines()[0] == lead, logs.stdout
        assert "global_rank=0" in logs.stdout  # then rank 0's own log, as before
        assert CAUSE in _hpc(env, "logs", job, "--rank", "1").stdout
        records = _records(runs / f"failing-{ranks}")
        assert (records[1]["peer_lost"], records[1]["step"], records[1]["job_id"]) == (False, 5, job)
        assert all(r["peer_lost"] for rank, r in records.items() if rank != 1), records  # those that saw it at all
        assert CAUSE in Path(records[1]["traceback"]).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", pytest.param("mpirun", marks=needs_mpi)])
def test_hpc_run_names_the_rank_that_raised_and_its_traceback(tmp_path: Path, launcher: str) -> None:
    spec = _write_job(tmp_path)
    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", "run", "-n", "4", "--launcher", launcher, str(spec),
                           "--set", f"job.run_dir={tmp_path / 'runs'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    error = done.stderr.splitlines()[-1]
    traceback = tmp_path / "runs" / "failing" / "failures" / "rank-00001.traceback"
    assert re.fullmatch(rf"hpc: error: rank 1 \(host \S+, step 5\) failed: {CAUSE} \(traceback: {traceback}\); .*",
                        error), done.stderr


@pytest.mark.slow
def test_status_and_logs_of_a_slurm_job_name_the_rank_that_died_without_an_exception(slurm_cluster) -> None:
    state, node = slurm_cluster.state, slurm_cluster.nodes[0]
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "HPC_HOME": str(state / "hpc-home-deaths")}
    spec, runs = _write_dying_job(state), state / "death-runs"
    jobs = {how: _submitted(_hpc(env, "submit", str(spec), "--ntasks-per-node", "4", "--set", f"job.run_dir={runs}",
                                 "--set", f"job.name=dying-{how}", "--set", f"model.args.how={how}", cwd=state))
            for how in DEATHS}
    for how, job in jobs.items():
        assert _wait_done(env, job) == {job: "FAILED"}
        lead = f"job {job}: rank 2 (host {node}) {DEATHS[how]} -- see: hpc logs {job} --rank 2"
        status = _hpc(env, "status", job)
        assert status.returncode == 0, status.stderr
        assert status.stdout.splitlines()[0] == lead, status.stdout
        logs = _hpc(env, "logs", job)
        assert logs.returncode == 0 and logs.stdout.splitlines()[0] == lead, logs.stdout
        assert logs.stdout.splitlines()[-1] == lead, logs.stdout
        assert 2 not in _records(runs / f"dying-{how}")  # srun's account, read from its lines in rank 0's log


@pytest.mark.slow
@pytest.mark.parametrize("how", list(DEATHS))
@pytest.mark.parametrize("launcher", ["local", pytest.param("mpirun", marks=needs_mpi)])
def test_hpc_run_names_the_rank_that_died_without_an_exception(tmp_path: Path, launcher: str, how: str) -> None:
    spec = _write_dying_job(tmp_path)
    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", "run", "-n", "4", "--launcher", launcher, str(spec),
                           "--set", f"job.run_dir={tmp_path / 'runs'}", "--set", f"model.args.how={how}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == (137 if how == "kill" else 3), done.stderr
    stopped = "; stopped the other 3 ranks" if launcher == "local" else ""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    assert done.stderr.splitlines()[-1] == f"hpc: error: rank 2 (host {host}) {DEATHS[how]}{stopped}", done.stderr
    record = _records(tmp_path / "runs" / "dying")[2]  # the launcher's record, for hpc sweep status and later readers
    assert (record["exit"], record["launcher"], record["host"]) == ((-9 if how == "kill" else 3), launcher, host)

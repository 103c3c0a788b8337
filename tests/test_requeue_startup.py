"""A warning signal at any moment of a job's start-up on the real local Slurm: the job requeues
once and ends COMPLETED with the parameters of an uninterrupted run (issue 16).

Ten one-rank jobs each get SIGUSR1 a different delay (0 to 0.9 s) after their step appears,
while the rank is still importing, before Python could install a handler; the srun task starts
with the signal blocked (``env --block-signal``), so it waits and reaches the handler (or, in the
instant between slurmstepd starting the task and ``env`` blocking the signal, the rank dies of it and
the batch script requeues the job: srun exits 128 + 10; and the one signalled as its step appears may
find no task started yet, reach no process and run on, as docs/SLURM.md says). Even
delays use ``scancel --signal=USR1 --full`` (the batch shell and srun get it too and must
neither die nor requeue by themselves), odd ones ``scancel --signal=USR1``, the job's steps
only, which is what ``#SBATCH --signal=USR1@T`` sends. One more job is signalled with
``--full`` while its batch script runs a setup line, before srun: only the script can catch
that one, and it requeues. The last job is the uninterrupted reference. Every batch script
waits in a setup line until all are submitted and that one is signalled.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.test_submit import _hpc, _submitted, _wait_done

DELAYS = tuple(i / 10 for i in range(10))
SPEC = """
job = {name = "startup", seed = 3}
model = {hidden_sizes = [16]}
data = {batch_size = 32}
train = {steps = 20, lr = 0.05, momentum = 0.9, log_every = 100}
checkpoint = {every_steps = 10}
slurm = {ntasks_per_node = 1, time = "10"}
"""


def _scancel(env: dict[str, str], job: str, full: bool) -> None:
    subprocess.run(["scancel", "--signal=USR1", *(["--full"] if full else []), job], env=env, check=True)


def _signal_during_start_up(env: dict[str, str], early: str, delayed: dict[str, float], release: Path) -> None:
    """USR1 to ``early`` while its batch script waits for ``release`` (before srun), then to each delayed job
    ``delay`` s after its step appears; one squeue poll for all of them."""
    pending, senders = {early, *delayed}, []
    deadline = time.monotonic() + 150
    while pending:
        assert time.monotonic() < deadline, f"jobs {sorted(pending)} never reached their step"
        steps = set(subprocess.run(["squeue", "-h", "-s", "-o", "%i"], env=env, capture_output=True, text=True,
                                   check=True).stdout.split())
        if early in pending and f"{early}.batch" in steps:
            _scancel(env, early, full=True)
            release.touch()
            pending.discard(early)
        for job in [job for job in pending & set(delayed) if f"{job}.0" in steps]:
            full = DELAYS.index(delayed[job]) % 2 == 0
            senders.append(threading.Timer(delayed[job], _scancel, (env, job, full)))
            senders[-1].start()
            pending.discard(job)
        time.sleep(0.02)
    for sender in senders:
        sender.join()


@pytest.mark.slow
def test_a_warning_signal_at_any_moment_of_start_up_requeues_once_and_ends_equal(slurm_cluster) -> None:
    import torch

    from hpc.checkpoint import open_checkpoint, read_tensor

    state = slurm_cluster.state / "startup"
    state.mkdir()
    env = {**slurm_cluster.env, "HPC_HOME": str(state / "hpc-home")}
    spec = state / "job.toml"
    spec.write_text(SPEC)

    release = state / "release"
    gate = f"sh -c 'until [ -e {release} ]; do sleep 0.1; done'"

    def submit(name: str) -> str:
        return _submitted(_hpc(env, "submit", str(spec), "--set", f"job.run_dir={state}", "--set", f"job.name={name}",
                               "--setup", gate))

    early = submit("before-srun")
    delayed = {submit(f"after-{delay:.1f}s"): delay for delay in DELAYS}
    reference = submit("uninterrupted")
    _signal_during_start_up(env, early, delayed, release)
    names = {early: "before-srun", reference: "uninterrupted", **{j: f"after-{d:.1f}s" for j, d in delayed.items()}}
    for job in names:
        assert _wait_done(env, job) == {job: "COMPLETED"}, (names[job], _log(state, names[job], job))
    final = open_checkpoint(state / "uninterrupted" / "checkpoints" / "step-00000020")
    assert "optim/0.weight/momentum_buffer" in final.tensors
    for job, name in names.items():
        log = _log(state, name, job)
        preempted = [line for line in log.splitlines() if line.startswith("preempted: ")]
        if job == reference:
            assert not preempted, log
            continue
        if not preempted and names[job] == "after-0.0s":  # sent as the step appeared, before slurmstepd had
            assert log.count("Starting with JobEnvironment") == 1, log  # started the task: it reached no process
            continue  # (docs/SLURM.md: what no trap can catch); the job ran once, and is compared below
        # A delayed job's rank handles the signal; or, when the signal beat env --block-signal by an instant
        # (slurmstepd had started the task, env had not yet blocked it), the rank died and the script requeued.
        hows = (("SIGUSR1 before the ranks started;",) if job == early else
                ("SIGUSR1: checkpointed step ", "SIGUSR1 killed a rank before it could handle it;"))
        assert len(preempted) == 1 and preempted[0].startswith(tuple(f"preempted: {how}" for how in hows)), log
        assert preempted[0].endswith(f"; requeued job {job} (requeue 1 of at most 3)"), log
        steps = [json.loads(line)["step"] for line in (state / name / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 21)), (name, steps)  # resumed after the checkpoint, no step twice
    for name in names.values():
        ours = open_checkpoint(state / name / "checkpoints" / "step-00000020")
        assert set(ours.tensors) == set(final.tensors), name
        for tensor in final.tensors:
            assert torch.equal(read_tensor(ours, tensor), read_tensor(final, tensor)), (name, tensor)


def _log(state: Path, name: str, job: str) -> str:
    path = state / name / "slurm" / f"{job}_0_log.out"
    return path.read_text() if path.exists() else f"(no log {path})"

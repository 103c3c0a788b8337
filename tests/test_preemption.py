"""Preemption without a scheduler: the handlers only record, ranks agree on when to stop, the
checkpoint taken there resumes bit for bit, and the requeue decision. The real requeue under
Slurm is in tests/test_submit.py."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from hpc.config import spec_from_dict
from hpc.runtime.mesh import build_mesh, resolve_layout
from hpc.runtime.preemption import BLOCKED_AT_START, Preempted, Preemption, requeue_plan, watch
from tests.conftest import BOTH_BACKENDS
from tests.ranks import run_ranks

SRUN_TASK = {"SLURM_JOB_ID": "57", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n1"}


def _stop(signum: signal.Signals) -> Preempted:
    return Preempted(40, signum, checkpointed=True)


def test_a_warning_signal_requeues_the_job_by_its_own_id_within_the_bound() -> None:
    environ = {**SRUN_TASK, "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "7", "SLURM_RESTART_COUNT": "2"}
    command, message = requeue_plan(_stop(signal.SIGUSR1), environ, max_requeues=3)
    assert command == ["scontrol", "requeue", "57"]  # the array task alone, not array 50
    assert message == "requeued job 57 (requeue 3 of at most 3)"
    command, _ = requeue_plan(_stop(signal.SIGUSR2), SRUN_TASK, max_requeues=1)
    assert command == ["scontrol", "requeue", "57"]


@pytest.mark.parametrize(
    ("signum", "environ", "max_requeues", "reason"),
    [
        (signal.SIGUSR1, {**SRUN_TASK, "SLURM_RESTART_COUNT": "3"}, 3, "job 57 was requeued 3 times"),
        (signal.SIGUSR1, SRUN_TASK, 0, "job 57 was requeued 0 times (slurm.max_requeues = 0)"),
        (signal.SIGTERM, SRUN_TASK, 3, "Slurm requeues a preempted job itself"),
        (signal.SIGUSR1, {"RANK": "0", "WORLD_SIZE": "2"}, 3, "not a Slurm job"),
    ],
)
def test_no_requeue_past_the_bound_on_sigterm_or_outside_slurm(signum, environ, max_requeues, reason) -> None:
    command, message = requeue_plan(_stop(signum), environ, max_requeues)
    assert command is None
    assert message.startswith("not requeued: ") and reason in message


def test_handlers_only_in_srun_tasks() -> None:
    assert isinstance(watch(SRUN_TASK), Preemption)
    assert watch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) is None
    assert watch({}) is None
    # The batch script itself (SLURM_PROCID=0 but no step) is not a rank of the job.
    assert watch({"SLURM_JOB_ID": "57", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                  "SLURM_NODEID": "0"}) is None


def test_handler_records_the_signal_keeps_a_requeue_over_a_stop_and_is_removed_on_exit() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    with Preemption() as preemption:
        assert preemption.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.received is signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the handler only records
        assert preemption.received is signal.SIGUSR1
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_blocked_during_start_up_waits_for_the_handler_and_is_recorded() -> None:
    """hpc submit starts srun tasks with these signals blocked (env --block-signal): one sent before the
    handlers exist stays pending, reaches ours once installed, and is blocked again afterwards."""
    ours = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM}
    assert {signal.Signals[f"SIG{name}"] for name in BLOCKED_AT_START.split(",")} == ours
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ours)
    try:
        # To this thread: the mask is per thread, and a process-directed signal could reach another
        # thread of pytest's (none blocks it) and kill the whole run with the default action.
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        assert signal.SIGUSR1 in signal.sigpending()
        with Preemption() as preemption:
            assert preemption.received is signal.SIGUSR1 and not signal.sigpending()
            assert not ours & signal.pthread_sigmask(signal.SIG_BLOCK, [])
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)  # after the run: pending, not delivered
        assert signal.SIGUSR2 in signal.sigpending() and preemption.received is signal.SIGUSR1
        assert ours <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert signal.sigwait([signal.SIGUSR2]) == signal.SIGUSR2  # consume it before unblocking
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _signal_then_resume(world, base: dict, signals: dict[int, signal.Signals]) -> tuple:
    """Stop at the first step boundary after a signal on some ranks, resume to the end, then run uninterrupted."""
    from hpc.run_session import RunSession, spec_options
    from jobs.train.loop import train

    mesh = build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank)
    split = spec_from_dict({**base, "job": {**base["job"], "name": "split"}})
    with Preemption() as preemption:
        if world.rank in signals:
            os.kill(os.getpid(), signals[world.rank])
        try:
            run = RunSession(world, split.run_path, watcher=preemption, **spec_options(split))
            train(split, world, mesh, run=run)
        except Preempted as stop:
            stopped = (stop.step, stop.signum, stop.checkpointed)
            run.close()
        else:
            raise AssertionError("training ran to the end despite the signal")
    train(split, world, mesh)
    train(spec_from_dict({**base, "job": {**base["job"], "name": "whole"}}), world, mesh)
    return stopped, preemption.received


@pytest.mark.slow
@BOTH_BACKENDS
def test_ranks_agree_to_stop_after_one_step_and_the_checkpoint_resumes_bit_for_bit(tmp_path: Path, backend) -> None:
    import torch

    from hpc.checkpoint import open_checkpoint, read_tensor
    from hpc.checkpoint.discovery import list_checkpoints

    base = {"job": {"run_dir": str(tmp_path), "seed": 5}, "model": {"hidden_sizes": [16]},
            "data": {"batch_size": 32}, "train": {"steps": 12, "lr": 0.01, "optimizer": "adam", "log_every": 100},
            "checkpoint": {"every_steps": 5, "keep": 10}}
    # Rank 0 is told to stop, rank 1 to requeue: both stop after step 1, and a requeue wins.
    results = run_ranks(2, _signal_then_resume, base, {0: signal.SIGTERM, 1: signal.SIGUSR1}, timeout=180,
                        backend=backend)
    assert [stopped for stopped, _ in results] == [(1, signal.SIGUSR1, True)] * 2
    assert [received for _, received in results] == [signal.SIGTERM, signal.SIGUSR1]
    steps = [c.step for c in list_checkpoints(tmp_path / "split" / "checkpoints") if c.complete]
    assert steps == [1, 5, 10, 12]  # step 1 is off the every-5 schedule: saved because of the signal
    logged = [json.loads(line)["step"] for line in (tmp_path / "split" / "metrics.jsonl").open()]
    assert logged == list(range(1, 13)), "the second run did not resume after step 1"
    split = open_checkpoint(tmp_path / "split" / "checkpoints" / "step-00000012")
    whole = open_checkpoint(tmp_path / "whole" / "checkpoints" / "step-00000012")
    assert set(split.tensors) == set(whole.tensors) and "optim/0.weight/exp_avg" in split.tensors
    for name in whole.tensors:
        assert torch.equal(read_tensor(split, name), read_tensor(whole, name)), name

"""Restart inside the allocation: when a rank fails or hangs, the batch script runs the job step again in the
same allocation from the newest checkpoint, up to ``slurm.max_restarts`` times, instead of waiting in the queue
for a new one (NVIDIA's Resiliency Extension restarts in-job the same way; torchrun's ``--max-restarts`` does it
for one node).

The batch script defines a shell function named ``srun`` (:func:`step_loop`), so the line submitit writes last
(``srun ... python -m submitit.core._submit``) runs through it: it runs the real srun, and after a failure asks
``python -m slurm.restart`` (:func:`main`, no torch: a fraction of a second) whether to go again. The answer
comes from what the failed step left: the ranks' failure records (hpc/rundir.py) and srun's own lines
(``srun: error: node1: task 2: Killed``), read as ``hpc status`` reads them, and the restarts so far:

- a cause that is the user's is not retried: a configuration error, or an exception raised at the same step
  as the previous restart's (an exception once may be transient: a lost peer, a flaky filesystem);
- a rank that died without a record (a signal, the out-of-memory killer, a lost node), a hang the stall
  inspector aborted, or a failed start-up health check (``train.health_check``) is the node's: with
  ``slurm.spare_nodes`` left, its node is excluded from the next step (``srun --exclude``) and a spare takes
  its place;
- once the spares are taken, ``slurm.elastic`` runs the next step on the nodes that remain (fewer data-parallel
  ranks, the same global batch); without it the job ends, naming the node (a job without spares restarts on its
  own nodes: a killed process on a live node comes back);
- past ``slurm.max_restarts`` the job ends, naming the cause.

Each decision is a line of ``restarts.jsonl`` in the run directory (cause, node, excluded nodes, when); ``hpc
status`` joins it with metrics.jsonl for the steps lost and the time from the failure to the next step. Steps
run with ``HPC_RESTART_ATTEMPT`` (0 first) in their environment. Exit 75 (the ranks checkpointed and requeued
the job after a warning signal) and the signals the batch script's trap handles end the loop untouched.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc.config import SlurmConfig
from hpc.errors import NodeUnhealthy
from hpc.rundir import STALLED, summarize_failures
from hpc.runtime.preemption import PREEMPTED_EXIT
from slurm.job_registry import RESTARTS_FILE, describe_restart, read_restarts, step_failures

CONFIG_ERRORS = frozenset({"ConfigError", "SpecError"})


@dataclass(frozen=True)
class Failure:
    """What ended a step, as :func:`failure_of` reads it."""

    text: str  # one line: who failed and why (hpc status's words)
    rank: int | None
    host: str | None
    step: int | None
    kind: str  # "config", "exception", "node" (died without a record, or hung)
    error: str | None  # the exception's type, for an exception


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str
    exclude: tuple[str, ...]
    nodes: int  # the next step's


def decide(failure: Failure, previous: Sequence[dict], slurm: SlurmConfig) -> Decision:
    """Whether to run the step again after ``failure``, given the restarts recorded before (``previous``, each with
    the nodes it excluded), on how many nodes and without which (see the module)."""
    exclude = tuple(previous[-1]["exclude"]) if previous else ()
    spares, wanted = slurm.spare_nodes, slurm.nodes
    stop = lambda reason: Decision(False, reason, exclude, 0)  # noqa: E731
    if failure.kind == "config":
        return stop("a configuration error is not retried")
    last = previous[-1] if previous else None
    if (failure.kind == "exception" and last and last.get("error") == failure.error
            and last.get("step") == failure.step and failure.step is not None):
        return stop(f"the same {failure.error} at the same step as before: the user's, not retried")
    if len(previous) >= slurm.max_restarts:
        return stop(f"slurm.max_restarts = {slurm.max_restarts} reached")
    counted = f"restart {len(previous) + 1} of {slurm.max_restarts}"
    if failure.kind != "node" or not failure.host or failure.host in exclude:
        return Decision(True, counted, exclude, min(wanted, wanted + spares - len(exclude)))
    if len(exclude) < spares:
        return Decision(True, f"{counted}, without node {failure.host} (spare {len(exclude) + 1} of {spares} taken)",
                        (*exclude, failure.host), wanted)
    if not spares and not slurm.elastic:  # a job without spares restarts on its nodes: the node may be fine
        return Decision(True, counted, exclude, wanted)
    if not slurm.elastic:
        return stop(f"no spare node left to replace {failure.host} (slurm.spare_nodes = {spares} taken; "
                    "slurm.elastic is off)")
    nodes = wanted + spares - len(exclude) - 1
    if nodes < 1:
        return stop(f"no node left without {failure.host}")
    return Decision(True, f"{counted}, without node {failure.host}, on {nodes} node{'s' * (nodes > 1)} (elastic: "
                          "no spare left; the same global batch over fewer data-parallel ranks)",
                    (*exclude, failure.host), nodes)


def srun_options(nodes: int, tasks_per_node: int, exclude: Sequence[str]) -> str:
    """The job step's size and the nodes it must not use, as srun options."""
    return f"--nodes={nodes} --ntasks={nodes * tasks_per_node}" + (f" --exclude={','.join(exclude)}" if exclude else "")


def failure_of(run_path: Path, log_dir: Path, job_id: str, since: float) -> Failure:
    """The failure the step that started at ``since`` left: the first rank that failed for a reason of its own,
    else the task srun saw die without a record, else srun's exit alone."""
    records = step_failures(run_path, job_id, log_dir, since)
    own = [record for record in records if not record.get("peer_lost")]
    summary = summarize_failures(records)
    if not own or summary is None:
        return Failure(summary.text if summary else "the step failed and no rank said why", None, None, None, "node",
                       None)
    first = min(own, key=lambda r: (r.get("time", 0.0), r["rank"]))
    error = first.get("type")
    kind = ("node" if isinstance(first.get("exit"), int) or error in (STALLED, NodeUnhealthy.__name__)
            else "config" if error in CONFIG_ERRORS else "exception")
    host = (first.get("blamed_hosts") or [first.get("host")])[0]  # a stall: where the ranks it waited for were
    return Failure(summary.text, first["rank"], host, first.get("step"), kind, error)


def record(run_path: Path, entry: dict) -> None:
    with (run_path / RESTARTS_FILE).open("a") as handle:
        handle.write(json.dumps(entry) + "\n")


def step_loop(slurm: SlurmConfig, run_path: Path, log_dir: Path) -> list[str]:
    """The batch script's ``srun`` function (see the module) of a job (not an array: its tasks restart by requeue),
    none where ``slurm.max_restarts`` is 0; with spares, each step runs on ``slurm.nodes`` of the allocation's."""
    if not slurm.max_restarts:
        return []
    decide_argv = [sys.executable, "-m", "slurm.restart", "--run-dir", str(run_path), "--log-dir", str(log_dir),
                   *(f"--{name.replace('_', '-')}={getattr(slurm, name)}" for name in RESOURCES)]
    sized = srun_options(slurm.nodes, slurm.tasks_per_node, ()) if slurm.spare_nodes or slurm.elastic else ""
    handled = f"0|{PREEMPTED_EXIT}|$((128 + $(kill -l USR1)))|$((128 + $(kill -l USR2))))"
    return [
        f"srun() {{  # the job step, again in this allocation after a failure (slurm.max_restarts = "
        f"{slurm.max_restarts}; slurm/restart.py)",
        f'    local attempt=0 status options="{sized}" started',
        "    while :; do",
        "        started=$(date +%s.%N) status=0",
        '        HPC_RESTART_ATTEMPT=$attempt command srun $options "$@" || status=$?',
        f"        case $status in {handled} return $status ;; esac",
        f'        options=$({shlex.join(decide_argv)} --job-id "$SLURM_JOB_ID" --started "$started") || return $status',
        "        attempt=$((attempt + 1))",
        "    done",
        "}",
    ]


RESOURCES = ("nodes", "ntasks_per_node", "gpus_per_node", "max_restarts", "spare_nodes", "elastic")


def main(argv: Sequence[str] | None = None) -> int:
    """Decide after a failed step (called by :func:`step_loop`'s function): prints the next step's srun options and
    exits 0 to run it; exits 1 to stop. Its line goes to the batch log."""
    parser = argparse.ArgumentParser(prog="python -m slurm.restart")
    for option in ("--run-dir", "--log-dir", "--job-id"):
        parser.add_argument(option, required=True)
    parser.add_argument("--started", type=float, required=True, help="when the failed step started (Unix time)")
    for name in RESOURCES:
        parser.add_argument(f"--{name.replace('_', '-')}", required=True,
                            type=(lambda text: text == "True") if name == "elastic" else int)
    args = parser.parse_args(argv)
    slurm = SlurmConfig(**{name: getattr(args, name) for name in RESOURCES})
    run_path, failed_at = Path(args.run_dir), time.time()
    failure = failure_of(run_path, Path(args.log_dir), args.job_id, args.started)
    previous = [entry for entry in read_restarts(run_path, args.job_id) if entry["restart"]]
    decision = decide(failure, previous, slurm)
    entry = {"job_id": args.job_id, "failed_at": failed_at, "cause": failure.text, "rank": failure.rank,
             "host": failure.host, "step": failure.step, "error": failure.error, "restart": decision.restart,
             "reason": decision.reason, "exclude": list(decision.exclude), "nodes": decision.nodes}
    record(run_path, entry)
    print(f"hpc: {describe_restart(run_path, entry)}", file=sys.stderr, flush=True)
    print(srun_options(decision.nodes, slurm.tasks_per_node, decision.exclude))
    return 0 if decision.restart else 1


if __name__ == "__main__":
    sys.exit(main())

"""How fast a job trains again after one of its ranks is killed: restart inside the allocation against a Slurm
requeue of the same job, on the local cluster (``make slurm-up``; ``eval $(python -m slurm.testbed.cluster env)``).

``python -m slurm.testbed.recovery [--runs 3] [--ranks 2] [--nodes 1] [--spare-nodes 0] [--steps 40]
[--kill-step 20] [--every 5] [--local-every 0] [--dir DIR]``

Each run submits the same job twice (``--ranks`` a node); its last rank SIGKILLs itself at ``--kill-step`` of
its first attempt, writing the time first (on 2 nodes of one rank each: the whole of node 1). ``restart``:
``--max-restarts 1``, the batch script runs the step again in the allocation (slurm/restart.py; with
``--spare-nodes``, on a spare in place of the dead rank's node). ``requeue``: no restart; the moment sacct shows
the job FAILED this script runs ``scontrol requeue`` (what a user or a requeue-on-failure script does at best)
and Slurm starts it again. Both resume from the newest checkpoint (every ``--every`` steps). Printed: seconds
from the kill to the end of the first step after it (metrics.jsonl's ``time``) and the steps run twice; the
median and the spread of the runs. With ``--local-every K`` both also keep the node-local tier every K steps
(hpc/checkpoint/local.py), and each run adds the job never killed with and without it: its seconds per step
(first to last step), the local tier's overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc.text import format_table

MODEL = '''
import os
import time

import torch.distributed as dist

from jobs.models.mlp import mlp


def build(kill_step=20, stamp=""):
    model = mlp(hidden_sizes=[32])
    calls = []

    def kill_there(module, inputs):
        if module.training:
            calls.append(1)
            last = dist.get_rank() == dist.get_world_size() - 1
            if last and len(calls) == kill_step and not os.path.exists(stamp):
                with open(stamp, "w") as handle:
                    handle.write(str(time.time()))
                os.kill(os.getpid(), 9)

    model.register_forward_pre_hook(kill_there)
    return model
'''
SPEC = """
[job]
name = "recovery"
seed = 1
[model]
entry = "recovery_model:build"
[data]
batch_size = 64
[train]
steps = {steps}
lr = 0.05
log_every = 1000
[checkpoint]
every_steps = {every}
local_every_steps = {local}
[slurm]
time = "10"
"""


def _hpc(env: dict[str, str], *args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"hpc {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _state(env: dict[str, str], job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], env=env, capture_output=True,
                         text=True).stdout.split()
    return out[0] if out else ""


def _wait(env: dict[str, str], job: str, states: set[str], timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := _state(env, job)) not in states:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job} not {'/'.join(sorted(states))} within {timeout_s:g} s (last: {state})")
        time.sleep(0.1)
    return state


def _recovered(run: Path, killed_at: float, kill_step: int) -> tuple[float, int]:
    """(seconds from the kill to the end of the first step after it, steps run twice)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = next(line for line in lines if line["time"] > killed_at)
    return after["time"] - killed_at, kill_step - after["step"]


def _submit(work: Path, env: dict[str, str], name: str, args: argparse.Namespace, *options: str) -> str:
    sets = ["--set", f"job.run_dir={work / 'runs'}", "--set", f"job.name={name}", "--ntasks-per-node", str(args.ranks),
            "--nodes", str(args.nodes), *options]
    return _hpc(env, "submit", str(work / "job.toml"), *sets, cwd=work).split("job ", 1)[1].split(":")[0]


def measure(work: Path, env: dict[str, str], how: str, args: argparse.Namespace, index: int) -> tuple[float, int]:
    name, stamp = f"{how}-{index}", work / f"{how}-{index}.killed"
    options = ["--set", f"model.args.stamp={stamp}", "--set", f"model.args.kill_step={args.kill_step}"]
    if how == "restart":
        options += ["--max-restarts", "1", "--spare-nodes", str(args.spare_nodes)]
    job = _submit(work, env, name, args, *options)
    if how == "requeue":
        _wait(env, job, {"FAILED"})
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)
        _wait(env, job, {"PENDING", "RUNNING", "REQUEUED"}, timeout_s=30)
    if _wait(env, job, {"COMPLETED", "FAILED", "CANCELLED"}) != "COMPLETED":
        raise SystemExit(f"job {job} ({how}) did not complete: hpc status {job}")
    return _recovered(work / "runs" / name, float(stamp.read_text()), args.kill_step)


def seconds_per_step(work: Path, env: dict[str, str], local_every: int, args: argparse.Namespace, index: int) -> float:
    """A job never killed, with the local tier every ``local_every`` steps (0: off): its mean seconds per step."""
    name = f"steady-{local_every}-{index}"
    job = _submit(work, env, name, args, "--set", "model.args.kill_step=0", "--set",
                  f"checkpoint.local_every_steps={local_every}")
    if _wait(env, job, {"COMPLETED", "FAILED", "CANCELLED"}) != "COMPLETED":
        raise SystemExit(f"job {job} did not complete: hpc status {job}")
    times = [json.loads(line)["time"] for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return (times[-1] - times[0]) / (len(times) - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm.testbed.recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="ranks a node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--spare-nodes", type=int, default=0, help="restart: spares beside --nodes")
    parser.add_argument("--dir", help="a directory every node shares (default: a new one under /tmp)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    parser.add_argument("--local-every", type=int, default=0, help="checkpoint.local_every_steps (0: off)")
    args = parser.parse_args(argv)
    if "SLURM_CONF" not in os.environ:
        parser.error("no SLURM_CONF: start the local cluster (make slurm-up) and eval its env first")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    work = Path(tempfile.mkdtemp(prefix="hpc-recovery-", dir=args.dir or "/tmp"))
    (work / "recovery_model.py").write_text(MODEL)
    (work / "job.toml").write_text(SPEC.format(steps=args.steps, every=args.every, local=args.local_every))
    results: dict[str, list[tuple[float, int]]] = {"restart": [], "requeue": []}
    for index in range(args.runs):
        for how in results:  # interleaved, so a drift of the machine falls on both
            results[how].append(measure(work, env, how, args, index))
    rows = []
    for how, values in results.items():
        seconds = [s for s, _ in values]
        rows.append([how, f"{statistics.median(seconds):.1f}", f"{min(seconds):.1f}-{max(seconds):.1f}",
                     ", ".join(str(lost) for _, lost in values)])
    print(format_table(("recovery", "kill to next step (s, median)", "min-max", "steps run twice"), rows))
    if args.local_every:
        steady: dict[int, list[float]] = {0: [], args.local_every: []}
        for index in range(args.runs):  # interleaved
            for every, values in steady.items():
                values.append(seconds_per_step(work, env, every, args, index))
        print(format_table(("local tier", "s/step (median)", "min-max"), [
            [f"every {every}" if every else "off", f"{statistics.median(v):.4f}", f"{min(v):.4f}-{max(v):.4f}"]
            for every, v in steady.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

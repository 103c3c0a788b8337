"""``hpc submit``, ``status``, ``logs``, ``cancel`` and ``sweep`` against the real local Slurm
(slurm/testbed/cluster.py).

The one-node jobs are all submitted at once by a module fixture, so that the node runs them
side by side (each costs seconds of start-up, mostly importing torch); every test then waits
for its own. Script generation and quoting are also tested without a cluster.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from hpc.runtime.env import Launcher, detect_rank_info
from slurm.job_registry import DONE_STATES, sacct_states
from slurm.submit import executor_parameters, quote_setup, signal_trap, time_minutes

REPO = Path(__file__).resolve().parent.parent
# sbatch passes the environment on: one torch thread per rank, as the references below use.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
INJECTED_DIR = "runs $(touch pwned) `touch pwned`; touch pwned"
GOLDEN = Path(__file__).resolve().parent / "golden"
SPEC = """
[job]
name = "digits"
seed = 1
[model]
hidden_sizes = [32]
[data]
batch_size = 64
[train]
steps = 20
lr = 0.05
momentum = 0.9
log_every = 100
[slurm]
ntasks_per_node = 2
time = "10"
"""
# Each would create ./pwned if a shell ever interpreted it.
INJECTIONS = ('echo "$(touch pwned)" `touch pwned`; touch pwned | sh', "echo 'a \"$(touch pwned)\"' \\ && touch pwned")


def _hpc(env: dict[str, str] | None, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc.cli.main", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def _submitted(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("submitted "), done.stdout
    return first.split(" job array " if "job array" in first else "job ")[1].split(":")[0].split(" ")[0]


def _wait_for(what: str, check: Callable[[], object], timeout_s: float = 150) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.3)
    return value


def _states(env: dict[str, str], job: str) -> dict[str, str]:
    return {key: fields["State"] for key, fields in sacct_states([job], env).items()}


def _wait_done(env: dict[str, str], job: str, tasks: int = 0) -> dict[str, str]:
    """The final state of a job (tasks == 0) or of every task of an array."""
    keys = [f"{job}_{i}" for i in range(tasks)] if tasks else [job]

    def done() -> dict[str, str] | None:
        states = _states(env, job)
        return states if all(states.get(k) in DONE_STATES for k in keys) else None

    return {key: state for key, state in _wait_for(f"job {job} to end", done).items() if key in keys}


# --- without a cluster -------------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "minutes"), [("30", 30), ("30:01", 31), ("02:00:00", 120), ("1-00:00:00", 1440),
                                                ("2-3", 3060), ("1-00:30", 1470), ("0", 0)])
def test_slurm_time_limits_in_minutes(limit: str, minutes: int) -> None:
    assert time_minutes(limit) == minutes


@pytest.mark.parametrize("line", INJECTIONS)
def test_a_quoted_setup_line_runs_as_literal_words(tmp_path: Path, line: str) -> None:
    (quoted,) = quote_setup([line])
    done = subprocess.run(["bash", "-c", quoted], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout == " ".join(shlex.split(line)[1:]) + "\n"  # echo printed its words, nothing ran
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    ("ranks", "restarts", "status", "said"),
    [
        ("kill -USR1 $$", 0, 75, "preempted: SIGUSR1 killed a rank before it could handle it; requeued job 7 "
                                 "(requeue 1 of at most 3)\nscontrol requeue 7"),
        ("kill -USR2 $$", 3, 75, "preempted: SIGUSR2 killed a rank before it could handle it; not requeued: job 7 "
                                 "was requeued 3 times (slurm.max_requeues = 3)"),
        ("exit 75", 0, 75, ""),  # the ranks handled the signal and requeued: nothing more
        ("exit 0", 0, 0, ""),
        ("exit 1", 0, 1, ""),  # a failure stays one
    ],
)
def test_the_batch_script_requeues_when_a_warning_signal_killed_a_rank(tmp_path, ranks, restarts, status,
                                                                        said) -> None:
    """What srun's exit status says after the ranks ran (srun exits 128 + n when signal n killed a task:
    a warning signal that beat ``env --block-signal``), through the script's own trap lines."""
    script = tmp_path / "batch.sh"
    script.write_text("\n".join([
        f"SLURM_JOB_ID=7 SLURM_RESTART_COUNT={restarts}",
        'scontrol() { echo "scontrol $*"; }',  # what the script would ask of Slurm
        *signal_trap(3), "set -e", "export SUBMITIT_EXECUTOR=slurm", f"bash -c {shlex.quote(ranks)}", ""]))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (status, said), done.stderr


@pytest.mark.parametrize(("slurm", "tasks"), [({}, 1), ({"gpus_per_node": 8}, 8),
                                              ({"gpus_per_node": 8, "ntasks_per_node": 2}, 2)])
def test_a_node_runs_a_rank_per_gpu_asked_for_unless_told_otherwise(slurm, tasks) -> None:
    """``hpc submit --nodes 4 --gpus-per-node 8`` is 32 ranks, one per GPU, as torchrun's --nproc-per-node=gpu
    (it was 4 ranks, each on one of its node's 8 GPUs); ``ntasks_per_node`` still says otherwise."""
    from hpc.config import spec_from_dict

    config = spec_from_dict({"slurm": slurm}).slurm
    assert config.tasks_per_node == tasks
    assert executor_parameters(config, "job")["ntasks_per_node"] == tasks


def test_gpus_per_task_is_asked_for_only_when_set() -> None:
    """``hpc submit --gpus-per-task 1``: sbatch's ``--gpus-per-task``, which srun's tasks inherit as their binding
    (each task sees only its own GPU: tests/test_gpu_binding.py)."""
    from hpc.config import spec_from_dict

    bound = spec_from_dict({"slurm": {"gpus_per_task": 1, "ntasks_per_node": 4}}).slurm
    assert executor_parameters(bound, "job")["gpus_per_task"] == 1 and bound.tasks_per_node == 4
    assert "gpus_per_task" not in executor_parameters(spec_from_dict({}).slurm, "job")


def test_a_batch_script_is_one_process_not_rank_0_of_the_allocation() -> None:
    # What sbatch --ntasks=2 gives the script itself (captured from the local cluster): no step id.
    batch = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "2"}
    info = detect_rank_info(batch)
    assert (info.launcher, info.rank, info.world_size, info.job_id) == (Launcher.SINGLE, 0, 1, "1")
    step = {**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "vm"}
    assert (detect_rank_info(step).launcher, detect_rank_info(step).world_size) == (Launcher.SLURM, 2)


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit needs srun on PATH, even for a dry run")
def test_dry_run_prints_the_golden_script_and_submits_nothing(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HPC_HOME": str(tmp_path)}  # no SLURM_CONF: sbatch could not submit anyway
    done = _hpc(env, "submit", str(GOLDEN / "submit_job.toml"), "--dry-run", "--nodes", "2", "--time", "1-00:00:00")
    assert done.returncode == 0, done.stderr
    assert done.stdout.replace(shlex.quote(sys.executable), "PYTHON") == (GOLDEN / "submit_dry_run.sbatch").read_text()
    assert not Path("/scratch/runs/golden").exists() and not (tmp_path / "jobs").exists()
    replaced = _hpc(env, "submit", str(GOLDEN / "submit_job.toml"), "--dry-run", "--setup", "module load gcc")
    setup = ["# setup", *signal_trap(3), "set -e  # a failed setup line ends the job", "module load gcc", "",
             "# command"]
    assert "\n" + "\n".join(setup) + "\n" in replaced.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--mem", "lots"), "hpc submit options: slurm.mem must be empty or a Slurm memory size"),
        (("--set", "job.name=x $(touch /tmp/hpc-pwned)"), "job.name must be letters, digits"),
        (("--nodes", "2", "--set", "parallel.dp=3"), "dp*tp*pp = 3*1*1 = 3 does not match the world size 4"),
        (("--setup", "echo 'unclosed"),
         "hpc submit options: slurm.setup[0] must split into shell words (No closing quotation), "
         "got \"echo 'unclosed\""),
        (("--set", "slurm.setup=[\"echo 'unclosed\"]"), "slurm.setup[0] must split into shell words"),
        (("--time", "0"), "hpc submit options: slurm.time must be a Slurm time limit above zero"),
        (("--set", "job.name=" + "a" * 300), "job.name must be at most 128 characters, got 300"),
        (("--set", "job.run_dir=runs\nx"), "job.run_dir must not contain control characters"),
        (("--set", "train={lr=1}"), "train is a section: --set replaces one value, not a whole section"),
        (("--set", "train.health_cluster=nope"), "train.health_cluster: no such cluster file: nope (built-in: "),
        (("--max-restarts", "-1"), "hpc submit options: slurm.max_restarts must be >= 0, got -1"),
    ],
)
def test_bad_submissions_are_one_line_before_anything_is_submitted(tmp_path: Path, args, message) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC)
    done = _hpc({"PATH": "/usr/bin:/bin", "HPC_HOME": str(tmp_path)}, "submit", str(spec), *args)
    assert done.returncode == 2
    assert done.stderr.startswith("hpc: error: ") and message in done.stderr and done.stderr.count("\n") == 1
    assert not Path("/tmp/hpc-pwned").exists()


# --- on the one-node cluster ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--partition", "nosuch"), "--partition=nosuch: invalid partition specified: nosuch"),
        (("--nodes", "3"), "Slurm cannot run --nodes=3 --ntasks-per-node=2"),  # not: the batch 64 over 6 ranks
        (("--mem", "999T"), "--mem=999T: allocation failure: Requested node configuration is not available"),
    ],
)
def test_what_the_cluster_cannot_give_is_one_line_and_leaves_no_job(slurm_cluster, args, message) -> None:
    state = slurm_cluster.state
    spec = state / "refused.toml"
    spec.write_text(SPEC)
    env = {**slurm_cluster.env, "HPC_HOME": str(state / "hpc-home-refused")}
    done = _hpc(env, "submit", str(spec), "--set", "job.name=refused", "--set", f"job.run_dir={state / 'runs'}", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("hpc: error: Slurm cannot run ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # sbatch's own lines are not printed before ours
    listed = subprocess.run(["sacct", "-X", "-n", "--name=refused", "-o", "JobID,State"], env=env, capture_output=True,
                            text=True, check=True)
    assert listed.stdout.strip() == ""  # --test-only: no FAILED job in sacct


@dataclass(frozen=True)
class Submitted:
    env: dict[str, str]
    state: Path
    node: str
    spec: Path
    runs: Path
    trained: str  # 2 ranks, 400 steps, checkpoints every 100, setup lines that try to inject commands
    requeued: str  # the same without setup, signalled with USR1 once it is running
    follow: subprocess.Popen  # hpc logs --follow of the requeued job, started before it ran
    sweep: Path
    sweep_job: str
    failing: Path
    failing_job: str


@pytest.fixture(scope="module")
def submitted(slurm_cluster) -> Submitted:
    state = slurm_cluster.state
    env = {**slurm_cluster.env, **ONE_THREAD, "HPC_HOME": str(state / "hpc-home")}
    spec, runs = state / "job.toml", state / "runs"
    spec.write_text(SPEC)
    sets = ("--set", f"job.run_dir={runs}")
    long_run = ("--set", "train.steps=400", "--set", "checkpoint.every_steps=100")
    # Jobs run in the directory they were submitted from: ./pwned would appear in the state directory.
    setups = [arg for line in INJECTIONS for arg in ("--setup", line)]
    trained = _submitted(_hpc(env, "submit", str(spec), *sets, *long_run, "--set", "job.name=trained", *setups,
                              cwd=state))
    requeued = _submitted(_hpc(env, "submit", str(spec), *sets, *long_run, "--set", "job.name=requeued", cwd=state))
    follow = subprocess.Popen([sys.executable, "-m", "hpc.cli.main", "logs", requeued, "--follow"], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sweep = state / "grid.toml"
    sweep.write_text('[sweep]\nbase = "job.toml"\nname = "grid"\nmax_concurrent = 2\n[params]\n'
                     '"train.lr" = [0.1, 0.02]\n"model.hidden_sizes" = [[32], [64, 32], [16]]\n')
    one_rank = ("--set", "slurm.ntasks_per_node=1")
    sweep_job = _submitted(_hpc(env, "sweep", str(sweep), *sets, *one_rank, cwd=state))
    failing = state / "failing.toml"
    failing.write_text('[sweep]\nbase = "job.toml"\nname = "failing"\nmethod = "zip"\n[params]\n'
                       '"train.lr" = [0.1, 0.1]\n"checkpoint.resume" = ["auto", "/no/such/checkpoint"]\n')
    # Its directory is an injection attempt too: it reaches #SBATCH --output and srun's arguments.
    failing_job = _submitted(_hpc(env, "sweep", str(failing), "--set", f"job.run_dir={state / INJECTED_DIR}",
                                  *one_rank, cwd=state))
    yield Submitted(env, state, slurm_cluster.nodes[0], spec, runs, trained, requeued, follow,
                    runs / "grid", sweep_job, state / INJECTED_DIR / "failing", failing_job)
    follow.kill()


def _logs(directory: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(directory.glob("*_log.out"))}


@pytest.mark.slow
def test_cancel_ends_the_job(submitted: Submitted) -> None:
    """First of the cluster tests, so that the job has no time to start and use a CPU."""
    env = submitted.env
    job = _submitted(_hpc(env, "submit", str(submitted.spec), "--set", f"job.run_dir={submitted.runs}",
                          "--set", "job.name=cancelled", "--set", "train.steps=1000000"))
    done = _hpc(env, "cancel", job)
    assert done.returncode == 0 and done.stdout == f"cancelled job {job}\n", done.stderr
    assert _wait_done(env, job) == {job: "CANCELLED"}
    assert _hpc(env, "cancel", "12; rm -rf /").stderr == "hpc: error: '12; rm -rf /' is not a job id " \
                                                          "(digits, or A_T for an array task)\n"


@pytest.mark.slow
def test_a_job_requeued_mid_run_resumes_and_ends_equal_to_the_uninterrupted_run(submitted: Submitted) -> None:
    """Among the first cluster tests: the signal must reach the job while it trains."""
    import torch

    from hpc.checkpoint import open_checkpoint, read_tensor

    env, job = submitted.env, submitted.requeued
    metrics = submitted.runs / "requeued" / "metrics.jsonl"
    _wait_for("10 steps of the job", lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 10)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True)  # what --signal=USR1@T sends
    assert _wait_done(env, job) == {job: "COMPLETED"}
    log = (submitted.runs / "requeued" / "slurm" / f"{job}_0_log.out").read_text()
    preempted = [line for line in log.splitlines() if line.startswith("preempted: ")]
    assert len(preempted) == 1, log
    step = int(preempted[0].split("checkpointed step ")[1].split(";")[0])
    assert 10 <= step < 400, "the signal arrived after training ended"
    assert preempted[0] == f"preempted: SIGUSR1: checkpointed step {step}; requeued job {job} (requeue 1 of at most 3)"
    assert f"checkpoints/step-{step:08d} at step {step}" in log  # "resumed from ... at step N"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, step + 1)) + list(range(step + 1, 401))
    assert _wait_done(env, submitted.trained) == {submitted.trained: "COMPLETED"}
    ours = open_checkpoint(submitted.runs / "requeued" / "checkpoints" / "step-00000400")
    uninterrupted = open_checkpoint(submitted.runs / "trained" / "checkpoints" / "step-00000400")
    assert set(ours.tensors) == set(uninterrupted.tensors) and "optim/0.weight/momentum_buffer" in ours.tensors
    for name in ours.tensors:
        assert torch.equal(read_tensor(ours, name), read_tensor(uninterrupted, name)), name
    followed, _ = submitted.follow.communicate(timeout=30)  # --follow ended by itself, after the requeue
    assert submitted.follow.returncode == 0
    assert preempted[0] in followed and f"summary: steps {step + 1}-400 (resumed)" in followed


@pytest.mark.slow
def test_a_two_rank_job_trains_checkpoints_and_completes_with_a_log_per_rank(submitted: Submitted) -> None:
    env, job = submitted.env, submitted.trained
    assert _wait_done(env, job) == {job: "COMPLETED"}
    run = submitted.runs / "trained"
    logs = _logs(run / "slurm")
    assert list(logs) == [f"{job}_0_log.out", f"{job}_1_log.out"]
    for rank, text in enumerate(logs.values()):
        assert f"global_rank={rank}(2)" in text  # submitit's line: each file is one srun task
    assert "summary: 400 steps" in logs[f"{job}_0_log.out"] and "gloo via slurm" in logs[f"{job}_0_log.out"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{s:08d}" for s in (200, 300, 400)]
    result = json.loads((run / "result.json").read_text())
    assert (result["steps"], result["world_size"], result["job_id"]) == (400, 2, job)
    status = _hpc(env, "status", job)
    assert status.returncode == 0, status.stderr
    row = status.stdout.splitlines()[1].split()  # JOB NAME STATE ELAPSED NODES STEP LOSS
    assert row[:3] + row[4:] == [job, "trained", "COMPLETED", submitted.node, "400", f"{result['final_loss']:.4f}"]
    assert _hpc(env, "logs", job, "--rank", "1").stdout == logs[f"{job}_1_log.out"]
    wrong = _hpc(env, "logs", job, "--rank", "2")
    assert wrong.returncode == 2 and f"--rank 2: job {job} has ranks 0 to 1" in wrong.stderr
    listed = _hpc(env, "status").stdout.splitlines()
    assert {line.split()[0] for line in listed[1:]} >= {submitted.trained, submitted.requeued}


@pytest.mark.slow
def test_injection_through_setup_lines_and_paths_is_quoted_never_run(submitted: Submitted) -> None:
    env, job = submitted.env, submitted.trained
    assert _wait_done(env, job) == {job: "COMPLETED"}
    log = (submitted.runs / "trained" / "slurm" / f"{job}_0_log.out").read_text()
    for line in INJECTIONS:
        assert " ".join(shlex.split(line)[1:]) + "\n" in log  # echoed as words by the setup line
    assert _wait_done(env, submitted.failing_job, tasks=2)[f"{submitted.failing_job}_0"] == "COMPLETED"
    assert (submitted.failing / "task-000" / "result.json").exists()  # under the path the attempt spelt
    assert not (submitted.state / "pwned").exists()


def _reference_losses(world, spec: str, configs: list[list[str]]) -> list[float]:
    """Each config trained by one process calling the training loop directly."""
    from hpc.config import load_spec
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    mesh = build_mesh(resolve_layout("auto", 1, 1, 1), 0)
    return [train(load_spec(spec, overrides), world, mesh)[0].final_loss for overrides in configs]


def _max_concurrent(env: dict[str, str], job: str) -> int:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "Start,End"], env=env, capture_output=True,
                         text=True, check=True).stdout
    spans = [tuple(datetime.fromisoformat(t) for t in line.split("|")) for line in out.split()]
    return max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)


@pytest.mark.slow
def test_a_six_config_sweep_runs_as_one_array_two_at_a_time_and_collects_every_result(submitted: Submitted,
                                                                                       tmp_path: Path) -> None:
    from slurm.sweep import as_overrides, read_manifest
    from tests.ranks import run_ranks

    env, job, directory = submitted.env, submitted.sweep_job, submitted.sweep
    assert _wait_done(env, job, tasks=6) == {f"{job}_{i}": "COMPLETED" for i in range(6)}
    assert "#SBATCH --array=0-5%2\n" in (directory / "slurm" / f"{job}_submission.sh").read_text()
    assert _max_concurrent(env, job) <= 2
    manifest = read_manifest(directory)
    results = [json.loads((Path(t["run_path"]) / "result.json").read_text()) for t in manifest["tasks"]]
    assert [r["job_id"] for r in results] == [f"{job}_{i}" for i in range(6)]
    configs = [[f"job.run_dir={tmp_path}", *as_overrides(t["params"])] for t in manifest["tasks"]]
    assert [r["final_loss"] for r in results] == run_ranks(1, _reference_losses, str(submitted.spec), configs)[0]
    shown = _hpc(env, "sweep", "results", str(directory))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"sweep grid (job array {job}): 6 completed"
    ranked = sorted(range(6), key=lambda i: results[i]["final_loss"])
    assert [int(line.split()[0]) for line in lines[2:]] == ranked
    assert [line.split()[-1] for line in lines[2:]] == [f"{results[i]['final_loss']:.6g}" for i in ranked]
    tasks = _hpc(env, "status", job).stdout.splitlines()[1:]
    assert [row.split()[:3] for row in tasks] == [[f"{job}_{i}", "grid", "COMPLETED"] for i in range(6)]


@pytest.mark.slow
def test_a_failing_array_task_is_reported_failed_while_the_others_complete(submitted: Submitted) -> None:
    env, job, directory = submitted.env, submitted.failing_job, submitted.failing
    assert _wait_done(env, job, tasks=2) == {f"{job}_0": "COMPLETED", f"{job}_1": "FAILED"}
    shown = _hpc(env, "sweep", "status", str(directory))
    assert shown.returncode == 1  # scripts notice
    lines = shown.stdout.splitlines()
    assert lines[0] == f"sweep failing (job array {job}): 1 completed, 1 failed"
    assert [line.split()[:3] for line in lines[2:4]] == [["0", "COMPLETED", "0.1"], ["1", "FAILED", "!"]]
    assert lines[4:] == [f"task 1 (job {job}_1): rank 0 (host {submitted.node}) failed: CheckpointError: "
                         "checkpoint.resume=/no/such/checkpoint: no complete checkpoint there -- see: "
                         f"hpc logs {job}_1 --rank 0"]  # which rank of the task failed, and why
    log = (directory / "slurm" / f"{job}_1_0_log.out").read_text()
    assert "hpc-rank: rank 0: error: " in log and "/no/such/checkpoint" in log
    assert (directory / "task-000" / "result.json").exists() and not (directory / "task-001" / "result.json").exists()


# --- on the two-node cluster ---------------------------------------------------------------------------


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_locally(world, spec: str, overrides: list[str]) -> None:
    from hpc.config import load_spec
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    train(load_spec(spec, overrides), world, build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank))


@pytest.mark.slow
def test_two_node_jobs_train_across_the_nodes_with_the_loss_of_local_ranks(slurm_cluster_3nodes) -> None:
    """Also: threads come from --cpus-per-task, not the node's CPU count, so without OMP_NUM_THREADS the
    one-rank-per-node job loses bit for bit what hpc run -n 2 and mpirun lose (issue 16); a run directory
    under a node's private /tmp fails the job at once, and hpc logs says why."""
    from tests.ranks import run_ranks

    cluster = slurm_cluster_3nodes
    state = cluster.state  # each node has its own /tmp: everything the jobs write lives under the state directory
    env = {**{k: v for k, v in cluster.env.items() if k != "OMP_NUM_THREADS"}, "HPC_HOME": str(state / "hpc-home")}
    spec, runs = state / "job.toml", state / "runs"
    spec.write_text(SPEC)
    jobs = {}
    for per_node in (1, 2):
        sets = ("--set", f"job.run_dir={runs}", "--set", f"job.name=slurm-{per_node}")
        jobs[per_node] = _submitted(_hpc(env, "submit", str(spec), "--nodes", "2", "--ntasks-per-node",
                                         str(per_node), "--cpus-per-task", "1", *sets))
    private = Path(tempfile.mkdtemp(prefix="hpc-private-"))  # this host's /tmp: no node sees it
    lost = _submitted(_hpc(env, "submit", str(spec), "--nodes", "2", "--set", f"job.run_dir={private}"))
    for per_node in (1, 2):  # meanwhile, the same spec on as many local ranks
        run_ranks(2 * per_node, _train_locally, str(spec), [f"job.run_dir={runs}", f"job.name=local-{per_node}"])
    for launcher in ("local", "mpirun"):
        done = _hpc(env, "run", "-n", "2", "--launcher", launcher, str(spec), "--set", f"job.run_dir={runs}",
                    "--set", f"job.name=run-{launcher}")
        assert done.returncode == 0, done.stderr
    for per_node in (1, 2):
        assert _wait_done(env, jobs[per_node]) == {jobs[per_node]: "COMPLETED"}
        logs = _logs(runs / f"slurm-{per_node}" / "slurm")
        hosts = [text.split("hostname=")[1].split(",")[0] for text in logs.values()]
        assert hosts == [node for node in cluster.nodes[:2] for _ in range(per_node)]
        slurm_losses = _losses(runs / f"slurm-{per_node}")
        assert len(slurm_losses) == 20 and slurm_losses == _losses(runs / f"local-{per_node}")
    assert _losses(runs / "slurm-1") == _losses(runs / "run-local") == _losses(runs / "run-mpirun")
    assert _wait_done(env, lost) == {lost: "FAILED"}
    shown = _hpc(env, "logs", lost)
    assert shown.returncode != 0 and shown.stderr.count("\n") == 1, shown.stderr
    assert f"job {lost} ended FAILED" in shown.stderr and f"without writing {private}/digits/slurm/{lost}_0_log.out: " \
        "Slurm could not create it on the node" in shown.stderr and "(/tmp is private to each node)" in shown.stderr
    shutil.rmtree(private)

"""Your own training script (hpc/script.py) through every launcher: ``hpc run`` on local ranks and under
mpirun, ``hpc submit`` and ``hpc sweep`` on the real local Slurm, a warning signal mid-run with exact resume,
and one error line for every malformed script argument (issue 15, point 4).

The script is ``jobs/examples/ddp_script.py`` copied out of the repository: a plain DDP-tutorial script that
imports nothing of ours but ``hpc``. The Slurm jobs are submitted at once by a module fixture; the job that
is signalled and requeued must end with the parameters of the uninterrupted ``hpc run -n 2``, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import BOTH_BACKENDS
from tests.test_submit import _hpc, _logs, _submitted, _wait_done, _wait_for

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "jobs" / "examples" / "ddp_script.py"
EPOCHS = ("--epochs", "10")  # 64 steps an epoch on 2 ranks: long enough for a signal to land mid-run
STEPS = 640
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _final_tensors(run: Path) -> dict:
    """Every tensor of the newest checkpoint of a run, by name."""
    from hpc.checkpoint import find_latest, open_checkpoint, read_tensor

    index = open_checkpoint(find_latest(run / "checkpoints"))
    return {name: read_tensor(index, name) for name in index.tensors}


def _assert_equal_tensors(ours: dict, theirs: dict) -> None:
    import torch

    assert set(ours) == set(theirs) and "optim/net1.weight/momentum_buffer" in ours, sorted(ours)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# --- in one process per rank: the Session itself -----------------------------------------------------------


def _train_a_little(world, run_path: str, steps: int, signal_on: int | None) -> tuple:
    """DDP steps through a Session up to ``steps``; ``signal_on``: the rank that gets SIGUSR1 before step 3.
    Returns (the step it stopped at, the exit status, the parameters then)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from hpc.run_session import RunSession
    from hpc.runtime.preemption import Preemption
    from hpc.script import Session

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    watcher = Preemption().__enter__()  # as hpc.session() does in an srun task
    run = Session(RunSession(world, Path(run_path), watcher=watcher, environ={}, max_requeues=3, owns_world=True))
    step, code = run.resume(model, optimizer), 0
    try:
        with run:
            while step < steps:
                if step == 2 and world.rank == signal_on:
                    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
                optimizer.zero_grad()
                model(torch.full((2, 4), float(step + world.rank))).square().mean().backward()
                optimizer.step()
                step += 1
                run.log(step, loss=float(step))
                if run.preempted(step):
                    break
    except SystemExit as exc:
        code = exc.code
    return step, code, {name: tensor.tolist() for name, tensor in model.module.state_dict().items()}  # exact floats


def _script_rng_after_resume(world, run_path: str, save: bool) -> tuple:
    """A script's session saving asynchronously at step 1 after seeding each rank apart, or resuming that save;
    returns (the step resumed, the next draws of this rank's generator, the checkpoint's layout)."""
    import torch

    from hpc.checkpoint import find_latest, open_checkpoint
    from hpc.run_session import RunSession
    from hpc.script import Session

    model = torch.nn.Linear(4, 3)
    run = Session(RunSession(world, Path(run_path), environ={}, async_save=True))
    step = run.resume(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if save:
        torch.manual_seed(100 + world.rank)
        run.save(1)
    draws = torch.rand(3).tolist()
    run.close()
    torch.distributed.barrier()  # rank 0 commits the save
    index = open_checkpoint(find_latest(Path(run_path) / "checkpoints"))
    return step, draws, {key: int(value) for key, value in index.attrs.items() if key.startswith("layout_")}


def test_a_script_saves_asynchronously_and_gets_its_generators_back_under_the_same_layout_as_a_spec_job(
        tmp_path: Path) -> None:
    """The run session's one rule for both launch paths: a rank's RNG comes back when the checkpoint's layout is
    this run's (a script's: its world size), not otherwise; async saves commit for scripts too."""
    from tests.ranks import run_ranks

    saved = run_ranks(2, _script_rng_after_resume, str(tmp_path), True)
    layout = {"layout_dp": 2, "layout_tp": 1, "layout_pp": 1, "layout_ep": 1, "layout_nodes": 1}
    assert [(step, attrs) for step, _, attrs in saved] == [(0, layout)] * 2
    assert saved[0][1] != saved[1][1]  # each rank its own generator
    resumed = run_ranks(2, _script_rng_after_resume, str(tmp_path), False)
    assert resumed == [(1, draws, layout) for _, draws, _ in saved]
    ((step, draws, _),) = run_ranks(1, _script_rng_after_resume, str(tmp_path), False)
    assert step == 1 and draws not in [saved[0][1], saved[1][1]]  # another layout: a fresh generator


@pytest.mark.slow
@BOTH_BACKENDS
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step_and_the_run_resumes_exactly_in_any_world(
        tmp_path: Path, backend: str) -> None:
    """Under NCCL's rules too: the ranks' agreement to stop, DDP's reductions and the save keep one order."""
    from tests.ranks import run_ranks

    split, whole = tmp_path / "split", tmp_path / "whole"
    stopped = run_ranks(2, _train_a_little, str(split), 6, 1, backend=backend)
    assert [(step, code) for step, code, _ in stopped] == [(3, 75), (3, 75)]  # rank 0 stops too, after step 3
    assert _steps(split) == [1, 2, 3]  # rank 0 alone writes metrics.jsonl
    assert not (split / "result.json").exists()  # a preempted run has no result yet
    assert run_ranks(1, _train_a_little, str(split), 3, None) == [(3, 0, stopped[0][2])]  # 2 ranks saved, 1 loads
    result = json.loads((split / "result.json").read_text())
    assert (result["steps"], result["final_loss"], result["world_size"]) == (3, 3.0, 1)
    resumed = run_ranks(2, _train_a_little, str(split), 6, None)
    assert resumed == run_ranks(2, _train_a_little, str(whole), 6, None)  # Adam's state came back too
    assert _steps(split) == list(range(1, 7)) and [code for _, code, _ in resumed] == [0, 0]


def _dropout_on_the_gpu(world, run_path: str, steps: int, save_at: int | None) -> dict:
    """A script's steps on the GPU with dropout there (the GPU's generator), resuming what the run saved;
    checkpoints at ``save_at``. Returns the parameters (exact floats)."""
    import torch

    from hpc.run_session import RunSession
    from hpc.script import Session

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 1)).to(world.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    Path(run_path).mkdir(parents=True, exist_ok=True)  # as the launcher makes it
    run = Session(RunSession(world, Path(run_path), environ={}, max_requeues=0, owns_world=True))
    step = run.resume(model, optimizer)
    with run:
        while step < steps:
            optimizer.zero_grad()
            model(torch.ones(8, 64, device=world.device)).square().mean().backward()
            optimizer.step()
            step += 1
            if step == save_at:
                run.save(step)
    return {name: tensor.tolist() for name, tensor in model.state_dict().items()}


@pytest.mark.cuda
def test_a_script_on_the_gpu_resumes_with_its_gpus_generator(tmp_path: Path) -> None:
    """The session checkpoints the GPU's RNG with the CPU's: dropout masks after the resume are the ones an
    uninterrupted run draws (a fresh process would start the GPU's generator from the seed again)."""
    from tests.ranks import run_ranks

    split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
    run_ranks(1, _dropout_on_the_gpu, split, 3, 3, device="cuda")
    resumed = run_ranks(1, _dropout_on_the_gpu, split, 6, None, device="cuda")
    assert resumed == run_ranks(1, _dropout_on_the_gpu, whole, 6, None, device="cuda")


def test_each_srun_task_execs_the_script_with_its_run_path_and_the_warning_signals_still_blocked(
        tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os, signal, sys\n"
                     "blocked = sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
                     "print(os.environ['HPC_RUN_PATH'], os.environ['HPC_MAX_REQUEUES'], sys.argv[1:], blocked)\n")
    argv = ["/runs/x", "2", str(probe), "--lr", "1"]
    call = f"from hpc.cli.script import run_script_in_slurm_task as task; task({argv!r})"
    done = subprocess.run(["env", "--block-signal=USR1,USR2,TERM", sys.executable, "-c", call], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "/runs/x 2 ['--lr', '1'] ['SIGTERM', 'SIGUSR1', 'SIGUSR2']\n"


# --- malformed script arguments: one line, exit 2, nothing submitted --------------------------------------

SWEEP = '[sweep]\nbase = "refused.py"\nname = "refused"\n'


@pytest.mark.parametrize(
    ("argv", "files", "message"),
    [
        (("submit", "nothere.py"), {}, "script nothere.py: no such file"),
        (("submit", "dir.py"), {"dir.py/x": ""}, "script dir.py: not a regular file"),
        (("submit", "notes.txt", "--", "--epochs", "1"), {"notes.txt": ""}, "notes.txt: not a Python script (.py)"),
        (("submit", "refused.py", "--epochs", "1"), {}, "unrecognized arguments: --epochs 1 (a script's own options "
                                                        "go after --)"),
        (("submit", "refused.py", "--set", "train.lr=1"), {},
         "--set train.lr=1: a script takes only job.name, job.run_dir and slurm.* settings"),
        (("submit", "refused.py", "--resources", "res.toml"), {"res.toml": "[slurm]\nnodes = 1\n[train]\nlr = 1\n"},
         "res.toml: a script's resources file holds only [slurm] and [job], not [train]"),
        (("submit", "refused.py", "--resources", "res.toml"), {"res.toml": "[job]\nseed = 3\n"},
         "res.toml: job.seed: a script's [job] holds only name, run_dir"),
        (("submit", "refused.py", "--resources", "res.toml"), {"res.toml": '[slurm]\nmem = "lots"\n'},
         "res.toml: slurm.mem must be empty or a Slurm memory size"),
        (("submit", "refused.py", "--resources", "res.toml"), {"res.toml": "[slurm]\nnodez = 2\n"},
         "res.toml: unknown key slurm.nodez (did you mean slurm.nodes?"),
        (("submit", "refused.py", "--resources", "res.toml"), {"res.toml": "slurm = 3\n"},
         "res.toml: slurm must be a table, got 3"),
        (("submit", "refused.py", "--time", "0"), {}, "hpc submit options: slurm.time must be a Slurm time limit"),
        (("submit", "refused.py", "--partition", "nosuch"), {}, "--partition=nosuch: invalid partition specified"),
        (("submit", "job.toml", "--resources", "res.toml"), {"job.toml": "", "res.toml": ""},
         "--resources gives a script's resources; a job spec has its own [slurm] section"),
        (("run", "-n", "2", "nothere.py"), {}, "script nothere.py: no such file"),
        (("run", "-n", "1", "job.toml", "--", "--epochs", "1"), {"job.toml": ""}, "job.toml: not a Python script"),
        (("sweep", "s.toml"), {"s.toml": SWEEP + "[params]\nlrr = [0.1]\n"},
         "s.toml: params.lrr: --lrr is not an option of "),
        (("sweep", "s.toml"), {"s.toml": SWEEP + "[params]\nlr = [0.1]\n[train]\nsteps = 1\n"},
         "s.toml: unknown table train (valid: sweep, params, slurm, job)"),
        (("sweep", "s.toml"), {"s.toml": SWEEP + "[params]\nlr = [0.1]\n[job]\nname = \"x\"\n"},
         "s.toml: job.name: a script's [job] holds only run_dir"),
        (("sweep", "s.toml"), {"s.toml": SWEEP + "[params]\nlr = [0.1]\n[slurm]\ntime = \"0\"\n"},
         "s.toml: slurm.time must be a Slurm time limit above zero"),
        (("sweep", "s.toml", "--set", "job.name=x"), {"s.toml": SWEEP + "[params]\nlr = [0.1]\n"},
         "--set job.name=x: a script takes only job.run_dir and slurm.* settings"),
        (("sweep", "s.toml"), {"s.toml": SWEEP + "[params]\nlr = [{a = 1}]\n"},
         "s.toml: params.lr: a script option takes numbers, strings, booleans or a list of them, got {'a': 1}"),
        (("sweep", "s.toml"), {"s.toml": SWEEP.replace("refused.py", "gone.py") + "[params]\nlr = [0.1]\n"},
         "s.toml: sweep.base: script "),
        (("sweep", "s.toml"), {"s.toml": SWEEP.replace("refused.py", "plain.py") + "[params]\nlr = [0.1]\n",
                               "plain.py": "print('no options')\n"}, "(its options: none: it declares no argparse"),
        (("sweep", "s.toml"), {"s.toml": SWEEP.replace("refused.py", "broken.py") + "[params]\nlr = [0.1]\n",
                               "broken.py": "import argparse\ndef (:\n"}, "broken.py: not valid Python at line 2"),
        (("sweep", "s.toml", "--", "--epochs", "1"), {"s.toml": SWEEP.replace("refused.py", "job.toml") +
                                                      "[params]\n\"train.lr\" = [0.1]\n", "job.toml": ""},
         "s.toml: options after -- go to a script, and sweep.base job.toml is a job spec"),
    ],
)
def test_a_malformed_script_argument_is_one_line_and_nothing_is_submitted(
        slurm_cluster, tmp_path: Path, monkeypatch, capsys, argv, files, message) -> None:
    from hpc.cli.main import main

    shutil.copy(EXAMPLE, tmp_path / "refused.py")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])  # sbatch would submit: we must not get there
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "home"))
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("hpc: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "home").exists() and not (tmp_path / "runs").exists()
    listed = subprocess.run(["sacct", "-X", "-n", "-o", "JobID", "--name=refused"], env=slurm_cluster.env,
                            capture_output=True, text=True, check=True)
    assert listed.stdout.strip() == ""


def test_dry_runs_show_each_task_with_signals_blocked_and_its_run_path(tmp_path: Path, monkeypatch, capsys) -> None:
    from hpc.cli.main import main

    if shutil.which("srun") is None:
        pytest.skip("submitit needs srun on PATH, even for a dry run")
    shutil.copy(EXAMPLE, tmp_path / "train.py")
    (tmp_path / "s.toml").write_text('[sweep]\nbase = "train.py"\nmethod = "zip"\n[params]\nlr = [0.1, 0.2]\n'
                                     'hidden = [16, 8]\n[job]\nrun_dir = "out"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "home"))
    assert main(["submit", "train.py", "--dry-run", "--ntasks-per-node", "2", "--", "--epochs", "1"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --job-name=train\n" in script and "#SBATCH --ntasks-per-node=2\n" in script
    assert f"--output {tmp_path}/runs/train/slurm/%j_%t_log.out" in script
    assert "env --block-signal=USR1,USR2,TERM " in script and "#SBATCH --signal=USR1@120\n" in script
    assert main(["sweep", "s.toml", "--executor", "local", "--dry-run", "--", "--epochs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1::2] == [f"env HPC_RUN_PATH={tmp_path}/out/s/task-{i:03d} {sys.executable} -u {tmp_path}/train.py "
                           f"--epochs 1 --lr {lr} --hidden {hidden}" for i, (lr, hidden) in enumerate([(0.1, 16),
                                                                                                       (0.2, 8)])]
    assert not (tmp_path / "home").exists() and not (tmp_path / "out").exists()


# --- hpc run: local ranks and mpirun --------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory) -> dict[str, Path]:
    """The script trained on 2 ranks by each launcher: by default into runs/<script> of the working directory,
    or where HPC_RUN_PATH says (mpirun passes it on)."""
    import os

    work = tmp_path_factory.mktemp("script-local")
    shutil.copy(EXAMPLE, work / "ddp_script.py")
    env = {**os.environ, **ONE_THREAD, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.pop("HPC_RUN_PATH", None)
    runs = {"local": work / "runs" / "ddp_script", "mpirun": work / "elsewhere"}
    for launcher, run in runs.items():
        extra = {"HPC_RUN_PATH": str(run)} if launcher == "mpirun" else {}
        done = _hpc({**env, **extra}, "run", "-n", "2", "--launcher", launcher, str(work / "ddp_script.py"), *EPOCHS,
                    cwd=work)
        assert done.returncode == 0, done.stderr
        assert f"summary: {STEPS} steps" in done.stdout, done.stdout
    return runs


@pytest.mark.slow
def test_the_script_trains_alike_on_local_ranks_and_under_mpirun(local_runs: dict[str, Path]) -> None:
    from hpc.observe.report import write_report

    for run in local_runs.values():
        assert _steps(run) == list(range(1, STEPS + 1))
        result = json.loads((run / "result.json").read_text())
        assert (result["steps"], result["world_size"]) == (STEPS, 2) and 0.8 < result["test_accuracy"] <= 1
        assert result["final_loss"] == json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    _assert_equal_tensors(_final_tensors(local_runs["local"]), _final_tensors(local_runs["mpirun"]))
    written = write_report(local_runs["local"])  # hpc report reads a script's run as a spec's
    assert {path.name for path in written} >= {"report.html", "loss.png"}


# --- hpc submit and hpc sweep on the one-node cluster ------------------------------------------------------


@dataclass(frozen=True)
class Submitted:
    env: dict[str, str]
    runs: Path
    requeued: str  # 2 ranks, resources from a --resources file; signalled with USR1 once it trains
    sweep: Path
    sweep_job: str


@pytest.fixture(scope="module")
def submitted(slurm_cluster) -> Submitted:
    state = slurm_cluster.state / "script"
    state.mkdir()
    env = {**slurm_cluster.env, **ONE_THREAD, "HPC_HOME": str(state / "hpc-home")}
    shutil.copy(EXAMPLE, state / "ddp_script.py")
    runs = state / "runs"
    (state / "resources.toml").write_text(f'[slurm]\nntasks_per_node = 2\n[job]\nname = "requeued"\n'
                                          f'run_dir = "{runs}"\n')
    requeued = _submitted(_hpc(env, "submit", "ddp_script.py", "--resources", "resources.toml", "--time", "10",
                               "--", *EPOCHS, cwd=state))
    (state / "sweep.toml").write_text(f'[sweep]\nbase = "ddp_script.py"\nname = "widths"\nmethod = "zip"\n'
                                      f'metric = "test_accuracy"\ngoal = "max"\n[params]\nlr = [0.1, 0.05]\n'
                                      f'hidden = [16, 8]\n[slurm]\ntime = "10"\n[job]\nrun_dir = "{runs}"\n')
    sweep_job = _submitted(_hpc(env, "sweep", "sweep.toml", "--", "--epochs", "1", cwd=state))
    return Submitted(env, runs, requeued, runs / "widths", sweep_job)


@pytest.mark.slow
def test_a_script_signalled_mid_run_checkpoints_requeues_and_resumes_from_there(submitted: Submitted) -> None:
    """First of the cluster tests: the signal must reach the job while it trains. The next test compares
    its parameters with the uninterrupted run of hpc run."""
    env, job, run = submitted.env, submitted.requeued, submitted.runs / "requeued"
    _wait_for("10 steps of the job", lambda: (run / "metrics.jsonl").exists() and len(_steps(run)) >= 10)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True)  # what --signal=USR1@T sends
    assert _wait_done(env, job) == {job: "COMPLETED"}
    log = (run / "slurm" / f"{job}_0_log.out").read_text()
    preempted = [line for line in log.splitlines() if line.startswith("preempted: ")]
    assert len(preempted) == 1, log
    step = int(preempted[0].split("checkpointed step ")[1].split(";")[0])
    assert 10 <= step < STEPS, "the signal arrived after training ended"
    assert preempted[0] == f"preempted: SIGUSR1: checkpointed step {step}; requeued job {job} (requeue 1 of at most 3)"
    assert "Exited with exit code 75" in log, log  # stopped by itself, not killed by the requeue
    assert f"resumed from {run}/checkpoints/step-{step:08d} at step {step}" in log
    assert _steps(run) == list(range(1, STEPS + 1))  # resumed after the checkpoint: no step twice, none lost


@pytest.mark.slow
def test_the_requeued_script_ends_equal_to_hpc_run_and_shows_in_status_and_logs(
        submitted: Submitted, local_runs: dict[str, Path]) -> None:
    env, job, run = submitted.env, submitted.requeued, submitted.runs / "requeued"
    assert _wait_done(env, job) == {job: "COMPLETED"}
    _assert_equal_tensors(_final_tensors(run), _final_tensors(local_runs["local"]))  # bit for bit, uninterrupted
    logs = _logs(run / "slurm")
    assert list(logs) == [f"{job}_0_log.out", f"{job}_1_log.out"]
    assert f"summary: {STEPS} steps" in logs[f"{job}_0_log.out"] and "2 ranks via slurm" in logs[f"{job}_0_log.out"]
    result = json.loads((run / "result.json").read_text())
    assert (result["steps"], result["world_size"], result["job_id"]) == (STEPS, 2, job)
    assert result["final_loss"] == json.loads((local_runs["local"] / "result.json").read_text())["final_loss"]
    row = _hpc(env, "status", job).stdout.splitlines()[1].split()  # JOB NAME STATE ELAPSED NODES STEP LOSS
    assert row[:3] + row[5:] == [job, "requeued", "COMPLETED", str(STEPS), f"{result['final_loss']:.4f}"]
    assert _hpc(env, "logs", job, "--rank", "1").stdout == logs[f"{job}_1_log.out"]


@pytest.mark.slow
def test_a_sweep_over_a_scripts_options_runs_as_one_array_and_ranks_the_results(submitted: Submitted) -> None:
    env, job, directory = submitted.env, submitted.sweep_job, submitted.sweep
    assert _wait_done(env, job, tasks=2) == {f"{job}_0": "COMPLETED", f"{job}_1": "COMPLETED"}
    tasks = [directory / "task-000", directory / "task-001"]
    widths = [_final_tensors(task)["model/net1.weight"].shape for task in tasks]
    assert widths == [(16, 32), (8, 32)]  # each task got its own --hidden
    results = [json.loads((task / "result.json").read_text()) for task in tasks]
    assert [(r["steps"], r["world_size"], r["job_id"]) for r in results] == [(128, 1, f"{job}_{i}") for i in (0, 1)]
    shown = _hpc(env, "sweep", "results", str(directory))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"sweep widths (job array {job}): 2 completed"
    best = sorted((0, 1), key=lambda i: -results[i]["test_accuracy"])
    assert [int(line.split()[0]) for line in lines[2:]] == best
    assert [line.split()[-1] for line in lines[2:]] == [f"{results[i]['test_accuracy']:.6g}" for i in best]


ENDS_ON_RANK_1 = """
import sys
import torch
import torch.distributed as dist
import hpc

with hpc.session() as session:
    if session.rank == 1:
        {end}
    dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize(("end", "code", "line"), [
    ("sys.exit(3)", 3, "[1] hpc-rank: rank 1: exited with code 3 (sys.exit): stopping the job"),
    ("raise RuntimeError('boom on rank 1')", 1, "[1] hpc-rank: rank 1: error: boom on rank 1"),
])
def test_a_script_ending_on_one_rank_ends_the_job_with_its_code_and_its_record(tmp_path: Path, end: str, code: int,
                                                                                line: str) -> None:
    """sys.exit(3) inside a session came out as exit 1 and an 'error: 3' with SystemExit's traceback; neither end
    was recorded in the run directory, where hpc-rank's failures are."""
    script = tmp_path / "ends.py"
    script.write_text(ENDS_ON_RANK_1.format(end=end))
    env = {**os.environ, "HPC_RUN_PATH": str(tmp_path / "runs" / "ends"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", "run", "-n", "2", "--launcher", "local", str(script)],
                          capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert done.returncode == code, done.stderr
    assert line in done.stderr.splitlines() and "rank 1 (host " in done.stderr
    record = json.loads((tmp_path / "runs" / "ends" / "failures" / "rank-00001.json").read_text())
    assert record["type"] == ("SystemExit" if code == 3 else "RuntimeError")


def test_a_launch_problem_in_hpc_session_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """session() raised before the with block, so the user saw 23 lines of traceback for one bad variable."""
    script = tmp_path / "r.py"
    script.write_text("import hpc\nwith hpc.session() as session:\n    print('joined')\n")
    env = {**os.environ, "RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
           "HPC_RUN_PATH": str(tmp_path / "run")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "hpc-rank: rank 2: error: RANK=2 is not below WORLD_SIZE=2 (launcher=torchrun)\n"

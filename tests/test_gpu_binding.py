"""One rank per GPU however Slurm binds them (issue 39): each node's ranks tell each other, through the
rendezvous store, which GPUs they see, and take one each (hpc/runtime/bootstrap.py: ``gpu_index``).

The environments below are what srun gave each task on the local cluster with stand-in GPUs
(slurm/testbed/cluster.py), Slurm 22.05; the last tests run srun and ``hpc submit`` there."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from hpc.errors import LaunchEnvError
from hpc.runtime import bootstrap
from hpc.runtime.env import Launcher, RankInfo

NCCL = "cpu:gloo,cuda:nccl"
REPO = Path(__file__).resolve().parent.parent


def _info(local_rank: int, local_size: int, node_rank: int = 0, nodes: int = 1) -> RankInfo:
    rank = node_rank * local_size + local_rank
    return RankInfo(rank, local_size * nodes, local_rank, local_size, node_rank, nodes, (), Launcher.SLURM, "7")


def _node(envs: Sequence[Mapping[str, str]], counts: Sequence[int], backend: str = NCCL) -> list[tuple[int, str]]:
    """Each local rank's (CUDA ordinal, GPU as the node names it), given each task's environment and the
    device count CUDA would report in it."""
    views = [bootstrap.visible_gpus(env, count) for env, count in zip(envs, counts, strict=True)]
    chosen = [bootstrap.gpu_index(_info(r, len(envs)), views, backend, env) for r, env in enumerate(envs)]
    return [(index, views[r][index]) for r, index in enumerate(chosen)]


def _bound(gpus: Sequence[str], bind: str) -> list[dict[str, str]]:
    """srun's per-task variables: CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS are the task's own GPUs."""
    return [{"CUDA_VISIBLE_DEVICES": g, "SLURM_STEP_GPUS": g, "SLURMD_TRES_BIND": bind, "SLURM_GPUS_ON_NODE": "4"}
            for g in gpus]


def test_visible_gpus_are_cuda_visible_devices_in_order_else_the_nodes() -> None:
    assert bootstrap.visible_gpus({}, 4) == ("0", "1", "2", "3")
    assert bootstrap.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 1"}, 2) == ("3", "1")
    assert bootstrap.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, 2) == ("GPU-a1", "GPU-b2")
    assert bootstrap.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,nosuch,2"}, 2) == ("0", "1")  # CUDA stops there
    assert bootstrap.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 0) == ()


def test_gpus_per_task_1_each_task_sees_its_own_gpu_and_computes_on_cuda_0() -> None:
    """``srun -n 4 --gpus-per-task=1``: each task sees one GPU; hpc refused this ("NCCL needs a GPU per rank")."""
    assert _node(_bound("0123", "gpu:per_task:1"), [1] * 4) == [(0, "0"), (0, "1"), (0, "2"), (0, "3")]


def test_gpus_per_task_2_each_rank_takes_the_first_of_its_own() -> None:
    assert _node(_bound(["0,1", "2,3"], "gpu:per_task:2"), [2, 2]) == [(0, "0"), (0, "2")]


def test_gpu_bind_map_gpu_each_task_on_the_gpu_the_map_gives_it() -> None:
    assert _node(_bound("1032", "gpu:map_gpu:1,0,3,2"), [1] * 4) == [(0, "1"), (0, "0"), (0, "3"), (0, "2")]


def test_gpu_bind_mask_gpu_and_closest_with_tasks_sharing_a_socket() -> None:
    assert _node(_bound(["0,1", "2,3"], "gpu:mask_gpu:0x3,0xc"), [2, 2]) == [(0, "0"), (0, "2")]
    # closest, tasks spread cyclically over two sockets of 2 GPUs: tasks 0 and 2 share GPUs 0 and 1
    closest = _node(_bound(["0,1", "2,3", "0,1", "2,3"], "gpu:closest"), [2] * 4)
    assert closest == [(0, "0"), (0, "2"), (1, "1"), (1, "3")]


def test_cuda_visible_devices_set_per_task_by_a_wrapper_without_slurm() -> None:
    assert _node([{"CUDA_VISIBLE_DEVICES": str(r)} for r in range(2)], [1, 1]) == [(0, "0"), (0, "1")]


ALL_8 = "0,1,2,3,4,5,6,7"


@pytest.mark.parametrize("visible", [{}, {"CUDA_VISIBLE_DEVICES": ALL_8, "SLURM_STEP_GPUS": ALL_8}])
def test_gpus_per_node_8_with_8_tasks_per_node_seeing_all_8(visible) -> None:
    """``--gpus-per-node=8 --ntasks-per-node=8`` (or the local launcher on an 8-GPU machine): rank r on cuda:r."""
    assert _node([visible] * 8, [8] * 8) == [(r, str(r)) for r in range(8)]


def test_a_rank_takes_a_gpu_over_only_when_another_can_move() -> None:
    assert bootstrap.assign_gpus([("0", "1"), ("0",)]) == [1, 0]
    assert bootstrap.assign_gpus([("0", "1"), ("0", "1"), ("0",)]) == [0, 1, None]
    assert bootstrap.assign_gpus([("0",), ("1",), ("0", "1", "2")]) == [0, 0, 2]


def test_two_tasks_bound_to_the_same_gpu_are_refused_in_one_line_naming_the_variables() -> None:
    """``srun -n 2 --gpus=2 --gpu-bind=map_gpu:0,0``: both tasks see GPU 0 alone (what NCCL would find as
    "Duplicate GPU detected" inside the first collective)."""
    envs = _bound("00", "gpu:map_gpu:0,0")
    views = [bootstrap.visible_gpus(env, 1) for env in envs]
    for local_rank, env in enumerate(envs):
        with pytest.raises(LaunchEnvError) as caught:
            bootstrap.gpu_index(_info(local_rank, 2), views, NCCL, env)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("parallel.backend='nccl' puts 2 ranks (local ranks 0, 1) on the 1 GPU(s) 0 ")
        for named in ("CUDA_VISIBLE_DEVICES=0", "SLURM_STEP_GPUS=0", "SLURMD_TRES_BIND=gpu:map_gpu:0,0",
                      "NCCL needs a GPU per rank", "srun --gpus-per-task=1", "parallel.backend='gloo'"):
            assert named in message


def test_more_ranks_than_the_nodes_gpus_are_refused_only_those_that_compete() -> None:
    with pytest.raises(LaunchEnvError, match=r"puts 3 ranks \(local ranks 0, 1, 2\) on the 2 GPU\(s\) 0, 1 .*"
                                             "CUDA_VISIBLE_DEVICES unset: all 2 GPU"):
        _node([{}] * 3, [2] * 3)
    # gpu-bind=single:2 on 3 GPUs: tasks 0 and 1 share GPU 0; tasks 2 and 3 have one each (only 0 is named)
    with pytest.raises(LaunchEnvError, match=r"puts 2 ranks \(local ranks 0, 1\) on the 1 GPU\(s\) 0 "):
        _node(_bound("0012", "gpu:single:2"), [1] * 4)


def test_gloo_shares_gpus_between_ranks_that_see_the_same() -> None:
    assert [index for index, _ in _node([{}] * 3, [2] * 3, backend="gloo")] == [0, 1, 0]
    assert _node(_bound("0011", "gpu:single:2"), [1] * 4, backend="gloo") == [(0, "0"), (0, "0"), (0, "1"), (0, "1")]


def test_no_gpu_visible_is_one_line() -> None:
    with pytest.raises(LaunchEnvError, match=r"no GPU is visible to this rank \(CUDA_VISIBLE_DEVICES="):
        bootstrap.gpu_index(_info(0, 1), [()], NCCL, {"CUDA_VISIBLE_DEVICES": ""})


def test_ranks_exchange_what_they_see_through_the_store_node_by_node() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    seen = {(0, 1): ("1",), (1, 0): ("0", "1"), (1, 1): ("0", "1")}
    for (node, local), view in seen.items():  # the other ranks, already there
        store.set(bootstrap.GPU_VIEW_KEY.format(node=node, local=local), json.dumps(list(view)))
    info = dataclasses.replace(_info(0, 2), node_rank=0)
    assert bootstrap.exchange_gpu_views(store, info, ("0",)) == [("0",), ("1",)]


def test_rank_device_without_peers_assumes_the_node_binds_nothing(monkeypatch) -> None:
    """What hpc.init did before: 2 ranks on a 1-GPU machine that binds nothing is still refused under NCCL."""
    import torch

    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1])
    with pytest.raises(LaunchEnvError, match="NCCL needs a GPU per rank"):
        bootstrap.rank_device(_info(1, 2), NCCL, "cuda", environ={})
    assert bootstrap.rank_device(_info(1, 2), NCCL, "cuda", {}, views=[("0",), ("1",)]) == torch.device("cuda", 0)
    assert bootstrap.rank_device(_info(1, 2), "gloo", "cuda", environ={}) == torch.device("cuda", 0)


# --- on the local Slurm, with stand-in GPUs ----------------------------------------------------------------

# Each task joins through hpc.init() on "GPUs" it cannot use: CUDA reports as many devices as srun made
# visible, and in place of NCCL's process group the ranks only meet in the store (rank 0 serves it, so it
# leaves last); what is printed is the device each rank chose, as NCCL would have been given it.
TASK = """
import json, os, time, torch, torch.distributed as dist
from hpc.errors import LaunchEnvError
from hpc.runtime import bootstrap
visible = [e for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e]
current = []
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: len(visible)
torch.cuda.set_device = current.append
torch.cuda.current_device = lambda: current[-1]
said = {"rank": int(os.environ["SLURM_PROCID"]), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "step_gpus": os.environ.get("SLURM_STEP_GPUS")}

def meet(backend, *, store, rank, world_size, device_id, **kwargs):
    said["device"] = str(device_id)
    store.add("left", 1)
    while rank == 0 and store.add("left", 0) < world_size:
        time.sleep(0.05)

dist.init_process_group = meet
try:
    bootstrap.init("nccl", init_timeout_s=60, device="cuda")
except LaunchEnvError as exc:
    said["error"] = str(exc)
    time.sleep(2)  # every rank refuses; the others may still read their node's views from rank 0's store
print(json.dumps(said), flush=True)
"""


def _ranks(out: str) -> list[dict]:
    return sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def _srun(cluster, *args: str) -> list[dict]:
    argv = ["srun", *args, "--kill-on-bad-exit=1", sys.executable, "-c", TASK]
    proc = subprocess.run(argv, env={**cluster.env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return _ranks(proc.stdout)


@pytest.mark.slow
def test_srun_gpus_per_task_1_gives_each_rank_its_own_gpu(slurm_cluster) -> None:
    ranks = _srun(slurm_cluster, "-n", "2", "--gpus-per-task=1")
    assert [(r["visible"], r["step_gpus"], r["device"]) for r in ranks] == [("0", "0", "cuda:0"), ("1", "1", "cuda:0")]


@pytest.mark.slow
def test_srun_gpus_per_node_and_map_gpu_give_each_rank_its_own_gpu(slurm_cluster) -> None:
    ranks = _srun(slurm_cluster, "-n", "4", "--ntasks-per-node=4", "--gpus-per-node=4")
    assert [(r["visible"], r["device"]) for r in ranks] == [("0,1,2,3", f"cuda:{r}") for r in range(4)]
    ranks = _srun(slurm_cluster, "-n", "2", "--gpus=2", "--gpu-bind=map_gpu:1,0")
    assert [(r["visible"], r["device"]) for r in ranks] == [("1", "cuda:0"), ("0", "cuda:0")]


@pytest.mark.slow
def test_srun_binding_two_tasks_to_one_gpu_is_refused_by_each(slurm_cluster) -> None:
    ranks = _srun(slurm_cluster, "-n", "2", "--gpus=2", "--gpu-bind=map_gpu:0,0")
    assert [r["visible"] for r in ranks] == ["0", "0"]
    for r in ranks:
        assert r["error"].startswith("parallel.backend='nccl' puts 2 ranks (local ranks 0, 1) on the 1 GPU(s) 0 ")
        assert "SLURMD_TRES_BIND=gpu:map_gpu:0,0" in r["error"]


@pytest.mark.slow
def test_hpc_submit_gpus_per_task_binds_each_rank_to_its_own_gpu(slurm_cluster, tmp_path) -> None:
    state = slurm_cluster.state / "gpu-binding"
    state.mkdir()
    (state / "probe.py").write_text(TASK)
    env = {**slurm_cluster.env, "HPC_HOME": str(state / "hpc-home"), "OMP_NUM_THREADS": "1"}
    (state / "resources.toml").write_text(f'[job]\nname = "probe"\nrun_dir = "{state / "runs"}"\n')
    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", "submit", "probe.py", "--resources", "resources.toml",
                           "--ntasks-per-node", "2", "--gpus-per-task", "1", "--time", "5"],
                          env=env, cwd=state, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("submitted "), done.stderr
    job = done.stdout.split("job ")[1].split(":")[0].split(" ")[0]
    logs = [state / "runs" / "probe" / "slurm" / f"{job}_{rank}_log.out" for rank in range(2)]
    deadline = time.monotonic() + 150
    while not all(log.exists() and '"rank"' in log.read_text() for log in logs):
        assert time.monotonic() < deadline, f"job {job} printed no device within 150 s"
        time.sleep(0.5)
    ranks = _ranks("\n".join(log.read_text() for log in logs))
    assert [(r["visible"], r["device"]) for r in ranks] == [("0", "cuda:0"), ("1", "cuda:0")]

"""Checkpoints in the real training loop: exact resume, and a rank killed in the middle of a save."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpc.checkpoint.discovery import find_latest, list_checkpoints
from hpc.config import spec_from_dict
from hpc.runtime.mesh import build_mesh, resolve_layout
from tests.ranks import run_ranks


def _base(tmp_path: Path, parallel: dict, async_save: bool, train: dict | None = None, every_steps: int = 10) -> dict:
    return {
        "job": {"run_dir": str(tmp_path), "seed": 3},
        "model": {"hidden_sizes": [32, 16], "dropout": 0.2},
        "data": {"batch_size": 32},
        "train": {"lr": 0.01, "optimizer": "adam", "log_every": 100, **(train or {})},
        "parallel": parallel,
        "checkpoint": {"every_steps": every_steps, "keep": 5, "async_save": async_save},
    }


def _split_and_whole(world, base, save_at: int, total: int):
    """``save_at`` steps then the rest resumed from that checkpoint, and ``total`` uninterrupted steps."""
    from jobs.train.loop import train

    mesh = build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank)
    for name, steps, resume in (("split", save_at, "auto"), ("split", total, "auto"), ("whole", total, "never")):
        spec = spec_from_dict({**base, "job": {**base["job"], "name": name},
                               "train": {**base["train"], "steps": steps},
                               "checkpoint": {**base["checkpoint"], "resume": resume}})
        train(spec, world, mesh)


def _assert_resumed_equals_uninterrupted(tmp_path: Path, total: int) -> dict[str, dict[int, dict]]:
    """Every tensor and every rank's private state of the last checkpoints equal, bitwise; returns the latter."""
    import torch

    from hpc.checkpoint import load_rank_state, open_checkpoint, read_tensor

    steps_logged = [json.loads(line)["step"] for line in (tmp_path / "split" / "metrics.jsonl").open()]
    assert steps_logged == list(range(1, total + 1)), "the second run did not resume where the first stopped"
    split = open_checkpoint(tmp_path / "split" / "checkpoints" / f"step-{total:08d}")
    whole = open_checkpoint(tmp_path / "whole" / "checkpoints" / f"step-{total:08d}")
    assert set(split.tensors) == set(whole.tensors)
    for name in whole.tensors:
        assert torch.equal(read_tensor(split, name), read_tensor(whole, name)), name
    private = {"split": {}, "whole": {}}
    for rank in (0, 1):
        private["split"][rank], private["whole"][rank] = load_rank_state(split, rank), load_rank_state(whole, rank)
        ours, reference = private["split"][rank], private["whole"][rank]
        assert ours.keys() == reference.keys()
        for key in reference:
            assert torch.equal(ours[key], reference[key]), f"rank {rank}: {key}"
    assert (whole.attrs["layout_dp"], whole.attrs["layout_tp"], whole.attrs["layout_pp"]) == (2, 1, 1)
    return private


@pytest.mark.slow
@pytest.mark.parametrize(("compression", "async_save"), [("none", False), ("int8", True)])
def test_ten_steps_save_ten_more_equals_twenty_uninterrupted(tmp_path, compression, async_save) -> None:
    from hpc.checkpoint import open_checkpoint

    run_ranks(2, _split_and_whole, _base(tmp_path, {"compression": compression}, async_save), 10, 20, timeout=180)
    private = _assert_resumed_equals_uninterrupted(tmp_path, 20)
    whole = open_checkpoint(tmp_path / "whole" / "checkpoints" / "step-00000020")
    assert {"optim/0.weight/exp_avg_sq", "optim/0.weight/step", "model/0.weight"} <= set(whole.tensors)
    assert any(k.startswith("comm/residual/") for k in private["whole"][0]) == (compression == "int8")
    assert int(private["whole"][0]["comm/steps_synchronized"]) == 20
    assert json.loads(whole.attrs["job_spec"])["parallel"]["compression"] == compression


@pytest.mark.slow
def test_top_k_with_momentum_resumes_exactly(tmp_path) -> None:
    """Deep Gradient Compression keeps SGD's momentum as a per-rank velocity in front of the reduction."""
    base = _base(tmp_path, {"compression": "topk", "topk_fraction": 0.05}, async_save=False,
                 train={"optimizer": "sgd", "momentum": 0.9}, every_steps=5)
    run_ranks(2, _split_and_whole, base, 5, 12, timeout=180)
    private = _assert_resumed_equals_uninterrupted(tmp_path, 12)
    assert any(k.startswith("comm/velocity/") for k in private["whole"][1])
    assert any(k.startswith("comm/residual/") for k in private["whole"][1])


@pytest.mark.slow
def test_a_compression_warm_up_spanning_the_save_resumes_exactly(tmp_path) -> None:
    """Exact reduction for 8 steps, then PowerSGD: the resumed run must switch at step 8, not 5 + 8."""
    base = _base(tmp_path, {"compression": "powersgd", "powersgd_rank": 2, "compression_warmup_steps": 8},
                 async_save=True, every_steps=5)
    run_ranks(2, _split_and_whole, base, 5, 12, timeout=180)
    private = _assert_resumed_equals_uninterrupted(tmp_path, 12)
    assert int(private["whole"][0]["comm/steps_synchronized"]) == 12
    assert any(k.startswith("comm/q/") for k in private["whole"][0])


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]


def _rank_of(pid: int) -> int | None:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        variables = dict(item.partition(b"=")[::2] for item in handle.read().split(b"\0") if item)
    return int(variables[b"RANK"]) if b"RANK" in variables else None


def _wait_for(condition, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        time.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_rank_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    """Large enough that a save takes a while; rank 1 is killed as soon as a new save starts."""
    root = tmp_path / "ckpt"
    spec = tmp_path / "job.toml"
    spec.write_text(
        f'[job]\nrun_dir = "{tmp_path}"\n[model]\nhidden_sizes = [4096, 2048]\n[data]\nbatch_size = 32\n'
        f'[train]\nsteps = 1000\noptimizer = "adam"\nlr = 0.001\n[checkpoint]\ndir = "{root}"\nevery_steps = 2\n'
    )
    proc = subprocess.Popen([sys.executable, "-m", "hpc.cli.main", "run", "-n", "2", "--launcher", "local", str(spec)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = _wait_for(lambda: find_latest(root), 120, "the first checkpoint", proc)
        unfinished = _wait_for(
            lambda: [e.path for e in list_checkpoints(root) if not e.complete and e.step > 2], 60, "a second save", proc
        )[0]
        victim = next(pid for pid in _children(proc.pid) if _rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert re.search(r"rank 1 \(host \S+\) was killed by SIGKILL", proc.stderr.read())
    assert first.name == "step-00000002"
    assert not (unfinished / "rank-00001.done").exists(), "the kill came after rank 1 had finished its shard"
    assert find_latest(root) == first, [e for e in list_checkpoints(root)]
    _check_it_loads(first, spec)


def _check_it_loads(step_dir: Path, spec_path: Path) -> None:
    import torch

    from hpc.checkpoint import open_checkpoint, read_tensor, verify_checkpoint
    from hpc.config import load_spec
    from jobs.models.protocol import build_model
    from jobs.train.checkpointing import restore
    from jobs.train.optim import build_optimizer

    assert verify_checkpoint(step_dir).ok
    spec = load_spec(spec_path)
    model = build_model(spec)
    initial = model.state_dict()["0.weight"].clone()
    optimizer = build_optimizer(spec.train, model.parameters())
    assert restore(step_dir, 0, model, optimizer) == 2
    index = open_checkpoint(step_dir)
    assert torch.equal(model.state_dict()["0.weight"], read_tensor(index, "model/0.weight"))
    assert not torch.equal(model.state_dict()["0.weight"], initial)
    assert int(optimizer.state_dict()["state"][0]["step"]) == 2
    assert np.isfinite(read_tensor(index, "optim/0.weight/exp_avg_sq").numpy()).all()

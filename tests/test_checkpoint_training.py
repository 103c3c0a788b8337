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


def _train_named(world, base, name: str, seed: int, steps: int, resume: str, init_from: str = "") -> None:
    from jobs.train.loop import train

    spec = spec_from_dict({**base, "job": {**base["job"], "name": name, "seed": seed},
                           "train": {**base["train"], "steps": steps},
                           "checkpoint": {**base["checkpoint"], "resume": resume, "init_from": init_from}})
    train(spec, world, build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank))


def _file_bytes(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_resume_never_starts_over_and_sets_the_earlier_checkpoints_aside_whole(tmp_path) -> None:
    """A run of 4 steps saves steps 2 and 4; the same job again with resume = "never" (another seed) must neither
    overwrite them nor mix with them: they move, byte for byte, into earlier-<time>/, and the newest checkpoint is
    the new run's step 2, not the earlier run's step 4."""
    import torch

    from hpc.checkpoint import open_checkpoint, read_tensor

    base = _base(tmp_path, {}, async_save=False, every_steps=2)
    root = tmp_path / "again" / "checkpoints"
    run_ranks(1, _train_named, base, "again", 3, 4, "auto", timeout=180)
    earlier = _file_bytes(root)
    first_step_2 = open_checkpoint(root / "step-00000002")
    first_weights = {name: read_tensor(first_step_2, name) for name in first_step_2.tensors}
    run_ranks(1, _train_named, base, "again", 4, 2, "never", timeout=180)
    (aside,) = [path for path in root.iterdir() if path.name.startswith("earlier-")]
    assert _file_bytes(aside) == earlier
    assert find_latest(root) == root / "step-00000002"
    second = open_checkpoint(root / "step-00000002")
    assert any(not torch.equal(read_tensor(second, name), weights) for name, weights in first_weights.items())
    assert [entry.step for entry in list_checkpoints(root)] == [2]
    # starting over from this run's own step 2 (init_from): its weights are read before it is set aside, where
    # reading them after failed ("no complete checkpoint there")
    second_files = {name: data for name, data in _file_bytes(root).items() if not name.startswith("earlier-")}
    run_ranks(1, _train_named, base, "again", 5, 2, "never", str(root / "step-00000002"), timeout=180)
    asides = sorted(path for path in root.iterdir() if path.name.startswith("earlier-"))
    assert len(asides) == 2 and second_files in [_file_bytes(path) for path in asides]


def test_resuming_with_another_optimizer_is_one_line_naming_train_optimizer(tmp_path) -> None:
    """SGD's state loaded into Adam failed deep in torch (KeyError: 'step'); Adam's into SGD was silently dropped."""
    from tests.ranks import RankError

    for saved, resumed in (("sgd", "adam"), ("adam", "sgd")):
        base = _base(tmp_path / saved, {}, async_save=False, train={"optimizer": saved}, every_steps=2)
        run_ranks(1, _train_named, base, "run", 3, 2, "auto", timeout=180)
        step = tmp_path / saved / "run" / "checkpoints" / "step-00000002"
        with pytest.raises(RankError) as failed:
            run_ranks(1, _train_named, {**base, "train": {**base["train"], "optimizer": resumed}}, "run", 3, 4, "auto",
                      timeout=180)
        assert (f"CheckpointError: {step} was saved with train.optimizer = {saved!r} and this run has {resumed!r}: "
                f"the optimizer's state does not carry over; resume with {saved!r}, or start from its weights alone "
                f"with checkpoint.init_from = {step}\n") in str(failed.value)


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

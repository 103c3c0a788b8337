"""Checkpoints of the GPT in the real training loop under TP, PP and 3D layouts.

- 10 steps, save, 10 more equals 20 uninterrupted steps bit for bit (parameters, Adam
  state, every rank's RNG and compression residuals), under each layout;
- a checkpoint saved under (dp, tp, pp) = (2, 2, 1) loads under (4, 1, 1), (1, 2, 2) and
  (1, 1, 1) with every parameter and optimizer tensor equal to the saved one, and
  training resumed under another layout continues the original run's losses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks

TINY_GPT = {"kind": "gpt", "n_layers": 2, "n_heads": 2, "d_model": 32, "seq_len": 16}


def _spec(run_dir: str, name: str, layout, steps: int, resume: str, every_steps: int = 10, dropout: float = 0.0,
          **parallel):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 11},
        "model": {**TINY_GPT, "dropout": dropout},
        "data": {"name": "licenses", "batch_size": 8},
        # a constant schedule after warm-up: a run of 10 steps must be the first half of one of 20
        "train": {"steps": steps, "lr": 3e-3, "optimizer": "adam", "grad_clip": 0.5, "warmup_steps": 3,
                  "log_every": 100},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "microbatches": 2 if pp > 1 else 1, **parallel},
        "checkpoint": {"every_steps": every_steps, "keep": 5, "resume": resume, "async_save": True},
    })


def _split_and_whole(world, run_dir: str, cases):
    """Per layout: 10 steps, then 10 more resumed from the step-10 checkpoint; and 20 uninterrupted steps."""
    from jobs.train.loop import train

    for label, layout, parallel in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank)
        for name, steps, resume in ((f"{label}-split", 10, "auto"), (f"{label}-split", 20, "auto"),
                                    (f"{label}-whole", 20, "never")):
            # dropout draws from each rank's RNG, which must resume too
            train(_spec(run_dir, name, layout, steps, resume, dropout=0.1, **parallel), world, mesh)


def _assert_same_checkpoint(run_dir: Path, label: str, world_size: int) -> None:
    import torch

    from hpc.checkpoint import load_rank_state, open_checkpoint, read_tensor

    steps_logged = [json.loads(line)["step"] for line in (run_dir / f"{label}-split" / "metrics.jsonl").open()]
    assert steps_logged == list(range(1, 21)), f"{label}: the second run did not resume at step 10"
    split = open_checkpoint(run_dir / f"{label}-split" / "checkpoints" / "step-00000020")
    whole = open_checkpoint(run_dir / f"{label}-whole" / "checkpoints" / "step-00000020")
    assert set(split.tensors) == set(whole.tensors)
    assert {"model/blocks.1.mlp.fc.weight", "optim/head.linear.weight/exp_avg_sq"} <= set(whole.tensors)
    for name in whole.tensors:
        assert torch.equal(read_tensor(split, name), read_tensor(whole, name)), f"{label}: {name}"
    for rank in range(world_size):
        ours, reference = load_rank_state(split, rank), load_rank_state(whole, rank)
        assert ours.keys() == reference.keys() and ours, f"{label}: rank {rank}"
        for key in reference:
            assert torch.equal(ours[key], reference[key]), f"{label}: rank {rank}: {key}"


@pytest.mark.parametrize(
    "cases",
    [
        [("tp2", (1, 2, 1), {}), ("pp2", (1, 1, 2), {"schedule": "gpipe"})],
        [("dp2-tp2", (2, 2, 1), {}), ("dp2-pp2-int8", (2, 1, 2), {"compression": "int8"}), ("tp2-pp2", (1, 2, 2), {})],
    ],
    ids=["2-ranks", "4-ranks"],
)
def test_ten_steps_save_ten_more_equals_twenty_uninterrupted(tmp_path, cases) -> None:
    world_size = math.prod(cases[0][1])
    run_ranks(world_size, _split_and_whole, str(tmp_path), cases, timeout=300)
    for label, _, parallel in cases:
        _assert_same_checkpoint(tmp_path, label, world_size)
        if parallel.get("compression") == "int8":
            from hpc.checkpoint import load_rank_state, open_checkpoint

            index = open_checkpoint(tmp_path / f"{label}-whole" / "checkpoints" / "step-00000020")
            assert any(key.startswith("comm/residual/") for key in load_rank_state(index, 0))


def _restored_state(world, step_dir: str, layout):
    """Everything a rank holds after restoring ``step_dir`` under ``layout``, as pieces of the global tensors."""
    from jobs.train.checkpointing import restore, state_pieces
    from jobs.train.optim import build_optimizer
    from jobs.train.workloads import Workload
    from parallel.optimizer import distributed_optimizer
    from parallel.transport import make_transport

    spec = _spec("unused", "restored", layout, 20, step_dir)
    mesh = build_mesh(MeshShape(*layout), world.rank)
    workload = Workload(spec, mesh)
    optimizer = distributed_optimizer(build_optimizer(spec.train, workload.model.parameters()),
                                      make_transport(spec.parallel.transport, mesh.group("dp")))
    assert restore(step_dir, world.rank, workload.model, optimizer, mesh) == 10
    optimizer.close()
    assert optimizer.steps_synchronized == 10  # every rank's count, so it survives a change of layout
    return [(p.name, p.global_shape, p.offsets, p.tensor.numpy().copy())
            for p in state_pieces(workload.model, optimizer, mesh.index("tp"), mesh.size("tp"))]


def _resume_under(world, run_dir: str, layouts):
    """The original run's step-10 checkpoint under each layout: restored (to compare with what was
    saved) and trained to step 20 (to continue the original's losses)."""
    from jobs.train.loop import train

    step_dir = f"{run_dir}/original/checkpoints/step-00000010"
    restored = {}
    for layout in layouts:
        restored[layout] = _restored_state(world, step_dir, layout)
        mesh = build_mesh(MeshShape(*layout), world.rank)
        train(_spec(run_dir, f"resumed-{'-'.join(map(str, layout))}", layout, 20, step_dir, every_steps=0),
              world, mesh)
    return restored


def _save_under_2_2_1_then_resume(world, run_dir: str, layouts):
    """The original run: 20 steps under (2, 2, 1), saving at 10 and 20."""
    from jobs.train.loop import train

    train(_spec(run_dir, "original", (2, 2, 1), 20, "never"), world, build_mesh(MeshShape(2, 2, 1), world.rank))
    return _resume_under(world, run_dir, layouts)


def _losses(run_dir: Path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / name / "metrics.jsonl").open())}


def test_a_checkpoint_saved_under_2_2_1_resumes_under_other_layouts(tmp_path) -> None:
    from hpc.checkpoint import open_checkpoint, read_tensor
    from tests.test_3d import assemble

    per_rank = run_ranks(4, _save_under_2_2_1_then_resume, str(tmp_path), [(4, 1, 1), (1, 2, 2)], timeout=300)
    per_rank[0] |= run_ranks(1, _resume_under, str(tmp_path), [(1, 1, 1)])[0]
    restored = {layout: [ranks[layout] for ranks in per_rank if layout in ranks] for layout in per_rank[0]}
    index = open_checkpoint(tmp_path / "original" / "checkpoints" / "step-00000010")
    saved = {name: read_tensor(index, name).numpy() for name in index.tensors}
    assert any(name.endswith("/exp_avg_sq") for name in saved) and any(name.endswith("/step") for name in saved)
    original = _losses(tmp_path, "original")
    for layout, pieces in restored.items():
        state = assemble(pieces)
        assert state.keys() == saved.keys(), layout
        for name, value in saved.items():
            assert np.array_equal(state[name], value), f"{layout}: {name}"
        resumed = _losses(tmp_path, f"resumed-{'-'.join(map(str, layout))}")
        assert list(resumed) == list(range(11, 21)), layout
        assert [resumed[step] for step in resumed] == pytest.approx([original[step] for step in resumed], rel=1e-5)

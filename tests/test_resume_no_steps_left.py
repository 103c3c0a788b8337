"""Issue 28: a resumed run with no steps left reports its checkpoint's last loss, never nan (summary, result.json)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh, resolve_layout
from tests.ranks import run_ranks


def _spec(tmp_path: Path) -> dict:
    return {
        "job": {"run_dir": str(tmp_path), "seed": 3, "name": "done"},
        "model": {"hidden_sizes": [16]},
        "data": {"batch_size": 16},
        "train": {"lr": 0.01, "optimizer": "adam", "log_every": 100, "steps": 4},
        "checkpoint": {"every_steps": 2, "resume": "auto"},
    }


def _train_twice(world, base: dict) -> list[tuple[int, float | None]]:
    """Four steps, then the same spec again: resumed at step 4 with none left; then without the checkpoint's loss;
    then with train.steps lowered to 2."""
    from jobs.train.loop import train

    mesh = build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank)
    spec = spec_from_dict(base)
    runs = [train(spec, world, mesh)[0], train(spec, world, mesh)[0]]
    with h5py.File(spec.checkpoint_path / "step-00000004" / "index.h5", "r+") as index:
        del index.attrs["loss"]  # as a checkpoint written before the loss was recorded
    runs.append(train(spec, world, mesh)[0])
    runs.append(train(spec_from_dict({**base, "train": {**base["train"], "steps": 2}}), world, mesh)[0])
    return runs


def test_a_resume_with_no_steps_left_reports_the_checkpoints_loss(tmp_path) -> None:
    from hpc.cli.rank import summary_line
    from hpc.run_session import write_result

    first, resumed, old, lowered = run_ranks(1, _train_twice, _spec(tmp_path), timeout=120)[0]
    assert (first.start_step, resumed.start_step, old.start_step) == (0, 4, 4)
    last_logged = [json.loads(line) for line in (tmp_path / "done" / "metrics.jsonl").open()][-1]
    assert first.final_loss == resumed.final_loss == last_logged["loss"] and last_logged["step"] == 4
    assert old.final_loss is None

    world = SimpleNamespace(size=1, backend="gloo", info=SimpleNamespace(launcher=SimpleNamespace(value="local"),
                                                                          job_id=None))
    lines = [summary_line(r, world, MeshShape(1, 1, 1), "m.jsonl") for r in (resumed, old)]
    assert lines[0].startswith(f"summary: no steps left (resumed at step 4 of 4) in {resumed.wall_s:.1f} s | "
                               f"final loss {first.final_loss:.4f} (the checkpoint's) | ")
    assert " | final loss unknown (the checkpoint predates recording it) | " in lines[1]
    assert "nan" not in " ".join(lines)
    # train.steps lowered below the checkpoint: nothing ran, and no negative throughput
    assert (lowered.start_step, lowered.throughput) == (4, 0.0)
    assert summary_line(lowered, world, MeshShape(1, 1, 1), "m.jsonl").startswith(
        "summary: no steps left (resumed at step 4, past train.steps = 2) in ")
    write_result(tmp_path / "result.json", old.as_record(), world)
    text = (tmp_path / "result.json").read_text()
    assert "NaN" not in text and json.loads(text)["final_loss"] is None

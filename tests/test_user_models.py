"""A model and a data set the package has never seen, written in the test's own directory,
train through ``model.entry`` / ``data.entry`` under DP, TP and PP exactly like one process;
every malformed entry or plan is one error line naming the key, before any rank starts."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks
from tests.test_3d import LR, STEPS, _metrics, assemble, pieces_as_numpy

USER_MODULE = '''
"""A residual MLP classifier and a synthetic data set, as a user would write them."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from jobs.data.datasets import DataSplits


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self, features, width, depth, classes):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_parts(self):
        return self.embed, self.blocks, self.head

    def loss(self, output, targets):
        return F.cross_entropy(output, targets)

    def metrics(self, output, targets):
        return {"accuracy": (output.argmax(1) == targets).float().mean().item()}


def build(features=12, width=16, depth=4, classes=3):
    return Net(features, width, depth, classes)


def blobs(samples=512, features=12, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (samples,), generator=g)
    points = centres[labels] + torch.randn(samples, features, generator=g)
    cut = samples * 3 // 4
    return DataSplits(TensorDataset(points[:cut], labels[:cut]), TensorDataset(points[cut:], labels[cut:]))
'''


def user_spec(run_dir: str, name: str, layout, microbatches: int = 1, **model) -> dict:
    dp, tp, pp = layout
    return {
        "job": {"run_dir": run_dir, "name": name, "seed": 3},
        "model": {"entry": "usernet:build", "args": {"depth": 4}, **model},
        "data": {"entry": "usernet:blobs", "args": {"samples": 512}, "batch_size": 16},
        "train": {"steps": STEPS, "lr": LR, "optimizer": "adam", "log_every": 100},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "microbatches": microbatches},
    }


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch) -> Path:
    """A working directory holding the user's module, as ``hpc run`` would be started from."""
    (tmp_path / "usernet.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _train_user_cases(world, user_dir: str, cases):
    from jobs.train.loop import train

    os.chdir(user_dir)  # entries import from the job's working directory
    results = []
    for name, layout, microbatches in cases:
        spec = spec_from_dict(user_spec(user_dir, name, layout, microbatches))
        mesh = build_mesh(MeshShape(*layout), world.rank)
        result, model = train(spec, world, mesh)
        results.append((result.evaluation, pieces_as_numpy(model, mesh)))
    return results


@pytest.mark.slow
def test_a_user_model_and_data_set_train_under_dp_tp_and_pp_like_one_process(user_dir: Path) -> None:
    (single,) = run_ranks(1, _train_user_cases, str(user_dir), [("single", (1, 1, 1), 1)])[0]
    cases = [("dp2", (2, 1, 1), 1), ("tp2", (1, 2, 1), 1), ("pp2", (1, 1, 2), 4)]
    per_rank = run_ranks(2, _train_user_cases, str(user_dir), cases, timeout=240)
    ref_losses, _ = _metrics(user_dir, "single")
    assert ref_losses[-1] < ref_losses[0]  # it learns
    reference = assemble([single[1]])
    for number, (name, *_) in enumerate(cases):
        losses, _ = _metrics(user_dir, name)
        assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), name
        params = assemble([results[number][1] for results in per_rank])
        assert_trained_close(params, reference, optimizer="adam", lr=LR, steps=STEPS, name=name)
        evaluation = per_rank[0][number][0]
        assert evaluation.keys() == {"held_out_loss", "held_out_accuracy"}, name
        assert evaluation["held_out_loss"] == pytest.approx(single[0]["held_out_loss"], rel=1e-4), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": {"entry": "nosuchmodule:build"}}, "model.entry='nosuchmodule:build': cannot import 'nosuchmodule'"),
        ({"model": {"entry": "usernet:nosuch"}}, "model.entry='usernet:nosuch': 'usernet' has no function 'nosuch'"),
        ({"model": {"entry": "usernet"}}, "model.entry must be empty or 'package.module:function', got 'usernet'"),
        ({"model": {"args": {"wdth": 8}}}, "model.args do not fit usernet:build: got an unexpected keyword argument"),
        ({"data": {"entry": "usernet:missing"}}, "data.entry='usernet:missing': 'usernet' has no function 'missing'"),
        ({"parallel": {"tp": 2}, "model": {"tp_plan": {"blocks.*.fc9": "colwise"}}},
         "model.tp_plan.'blocks.*.fc9' matches no module of the model"),
        ({"parallel": {"tp": 2}, "model": {"tp_plan": {"blocks.*.fc1": "diagonal"}}},
         "model.tp_plan.'blocks.*.fc1' = 'diagonal' is not a style we apply"),
        ({"parallel": {"tp": 2}, "model": {"tp_plan": {"blocks.*.norm": "colwise"}}},
         "model.tp_plan.'blocks.*.norm' = 'colwise' applies to an nn.Linear, but blocks.0.norm is a LayerNorm"),
        ({"parallel": {"tp": 3}}, "model.tp_plan.'blocks.*.fc1' (colwise): blocks.0.fc1 has 32 output features, "
                                  "not divisible by parallel.tp=3"),
        ({"parallel": {"pp": 3}}, "the model's 4 blocks cannot be cut into parallel.pp * virtual_stages = 3*1 = 3"),
        ({"parallel": {"pp": 8}}, "the model's 4 blocks cannot be cut into parallel.pp * virtual_stages = 8*1 = 8"),
    ],
)
def test_a_malformed_entry_or_plan_is_one_line_naming_the_key_and_nothing_starts(
        user_dir: Path, capsys, overrides, message) -> None:
    from hpc.cli.main import main
    from slurm.sweep import toml_value

    spec = user_spec(str(user_dir), "bad", (1, 1, 1))
    for section, values in overrides.items():
        spec[section] = {**spec[section], **values}
    ranks = spec["parallel"].get("tp", 1) * spec["parallel"].get("pp", 1)
    spec["parallel"]["dp"] = "auto"
    path = user_dir / "bad.toml"
    path.write_text("".join(f"[{section}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in table.items())
                            for section, table in spec.items()))
    code = main(["run", "--launcher", "local", "-n", str(ranks), str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.match("hpc: error: ", err) and message in err, err
    assert not (user_dir / "bad").exists()  # no rank started: none made the run directory


def triples():
    """A data entry whose samples are not (inputs, targets) pairs."""
    import torch

    return [(torch.zeros(2), torch.zeros(2), torch.zeros(2))] * 4


@pytest.mark.parametrize(("entry", "got"), [("os:getcwd", "str from str"),
                                            ("tests.test_user_models:triples", "tuple from list")])
def test_a_data_entry_whose_samples_are_not_pairs_is_one_line_naming_it(entry: str, got: str) -> None:
    """A string (os.getcwd) passed as a data set and failed every rank in the loop's unpacking."""
    from hpc.config import spec_from_dict
    from hpc.errors import ConfigError
    from jobs.data.protocol import build_data

    with pytest.raises(ConfigError) as refused:
        build_data(spec_from_dict({"data": {"entry": entry}}))
    assert str(refused.value) == (f"data.entry={entry!r}: a sample of its train set must be an (inputs, targets) "
                                  f"pair, got {got}")

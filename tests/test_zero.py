"""ZeRO stage 1: sharded optimizer state trains like one process, and its checkpoints cross dp and stage.

The reference is tests/test_3d.py's single-process run (10 steps of Adam, clipping active);
each sharded run must match its losses and parameters as every unsharded layout does there.
Each rank must also really hold only its share of Adam's state. A checkpoint saved by
(dp=2, zero=1) loads under (dp=1, zero=0) with every state tensor exactly as saved, and
the other way round each rank takes exactly its own parameters' state; runs resumed
either way end where the uninterrupted run ends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpc.config import spec_from_dict, spec_to_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks
from tests.test_3d import _check_matches, assemble, gpt_spec, pieces_as_numpy
from tests.test_3d import single_process as single_process  # the fixture


def _spec(run_dir: str, name: str, layout, microbatches: int, zero: int, every: int = 0, resume: str = "never"):
    raw = spec_to_dict(gpt_spec(run_dir, name, layout, microbatches=microbatches))
    raw["parallel"]["zero"] = zero
    raw["checkpoint"] = {"every_steps": every, "resume": resume}
    return spec_from_dict(raw)


def _train(world, run_dir: str, cases):
    """Each case through the real trainer; returns per case this rank's pieces and its optimizer state's size."""
    import jobs.train

    built = []
    build = jobs.train.build_data_parallel_optimizer
    jobs.train.build_data_parallel_optimizer = lambda *args, **kw: built.append(build(*args, **kw)) or built[-1]
    results = []
    for name, layout, microbatches, zero, every, resume in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank)
        _, model = jobs.train.train(_spec(run_dir, name, layout, microbatches, zero, every, resume), world, mesh)
        state = sum(v.numel() for s in built[-1].state.values() for v in s.values() if v.dim() > 0)
        coordinate = (mesh.index("tp"), mesh.index("pp"))
        results.append((pieces_as_numpy(model, mesh), state, sum(p.numel() for p in model.parameters()), coordinate))
    return results


def _check_sharded(single_process, run_dir: Path, cases, results) -> None:
    _check_matches(single_process, run_dir, [c[:1] for c in cases], [[c[0] for c in r] for r in results])
    for number, (name, *_) in enumerate(cases):
        groups: dict[tuple[int, int], list] = {}  # the DP group of each (tp, pp) coordinate
        for per_rank in results:
            groups.setdefault(per_rank[number][3], []).append(per_rank[number])
        for group in groups.values():
            assert len(group) == 2 and group[0][2] == group[1][2], name
            params = group[0][2]
            shares = [case[1] for case in group]
            assert sum(shares) == 2 * params, (name, shares, params)  # Adam's two moments, each held once
            assert max(shares) <= 0.6 * 2 * params, (name, shares)  # and about half on each replica


def test_zero1_alone_and_with_tp_and_pp_trains_like_one_process(single_process, tmp_path) -> None:
    two = [("zero1-dp2", (2, 1, 1), 1, 1, 0, "never")]
    _check_sharded(single_process, tmp_path, two, run_ranks(2, _train, str(tmp_path), two, timeout=240))
    four = [("zero1-dp2-tp2", (2, 2, 1), 1, 1, 0, "never"), ("zero1-dp2-pp2", (2, 1, 2), 2, 1, 0, "never")]
    _check_sharded(single_process, tmp_path, four, run_ranks(4, _train, str(tmp_path), four, timeout=240))


def _restored_state(world, step_dir: str, dp: int, zero: int):
    """A fresh (dp, zero) optimizer restored from ``step_dir``: {name/key: values} of the state this rank holds."""
    from jobs.checkpointing import restore
    from jobs.optim import build_optimizer
    from jobs.protocol import build_model
    from parallel.optimizer import distributed_optimizer
    from parallel.ring import make_transport

    spec = _spec("unused", "restore", (dp, 1, 1), 1, zero)
    mesh = build_mesh(MeshShape(dp, 1, 1), world.rank)
    model = build_model(spec)
    optimizer = distributed_optimizer(build_optimizer(spec.train, model.parameters()),
                                      make_transport("torch", mesh.group("dp")), zero=zero)
    assert restore(step_dir, world.rank, model, optimizer, mesh) == 5
    names = {id(p): name for name, p in model.named_parameters()}
    held = {f"{names[id(p)]}/{key}": value.numpy().copy()
            for p, s in optimizer.state.items() for key, value in s.items()}
    optimizer.close()
    return held


def _saved_state(step_dir: Path) -> dict[str, np.ndarray]:
    from hpc.checkpoint import open_checkpoint, read_tensor

    index = open_checkpoint(step_dir)
    optim = {name.removeprefix("optim/"): name for name in index.tensors if name.startswith("optim/")}
    for key, name in optim.items():  # each state tensor whole in the index, shaped like its parameter or a scalar
        shape = tuple(index.tensors[name].shape)
        assert shape in ((), tuple(index.tensors[f"model/{key.rsplit('/', 1)[0]}"].shape)), (name, shape)
    return {key: read_tensor(index, name).numpy() for key, name in optim.items()}


def test_a_zero1_checkpoint_resumes_without_zero_and_back(tmp_path) -> None:
    sharded = [("sharded", (2, 1, 1), 1, 1, 5, "never")]
    run_ranks(2, _train, str(tmp_path), sharded, timeout=240)
    plain = [("plain", (1, 1, 1), 1, 0, 5, "never")]
    run_ranks(1, _train, str(tmp_path), plain, timeout=240)
    for source, dp, zero in (("sharded", 1, 0), ("plain", 2, 1)):
        step5 = tmp_path / source / "checkpoints" / "step-00000005"
        saved, held = _saved_state(step5), run_ranks(dp, _restored_state, str(step5), dp, zero, timeout=120)
        assert sorted(k for h in held for k in h) == sorted(saved), source  # every tensor, held exactly once
        for key, value in ((k, v) for h in held for k, v in h.items()):
            np.testing.assert_array_equal(value, saved[key], err_msg=f"{source}: {key}")
    resumed = [("resumed-plain", (1, 1, 1), 1, 0, 0, str(tmp_path / "sharded" / "checkpoints" / "step-00000005"))]
    (one,) = run_ranks(1, _train, str(tmp_path), resumed, timeout=240)[0]
    resumed2 = [("resumed-sharded", (2, 1, 1), 1, 1, 0, str(tmp_path / "plain" / "checkpoints" / "step-00000005"))]
    two = run_ranks(2, _train, str(tmp_path), resumed2, timeout=240)
    for got, source in ((assemble([one[0]]), "sharded"), (assemble([r[0][0] for r in two]), "plain")):
        expected = _final_params(tmp_path / source / "checkpoints" / "step-00000010")
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=f"from {source}: {key}")


def _final_params(step_dir: Path) -> dict[str, np.ndarray]:
    from hpc.checkpoint import open_checkpoint, read_tensor

    index = open_checkpoint(step_dir)
    return {name: read_tensor(index, name).numpy() for name in index.tensors if name.startswith("model/")}


@pytest.mark.parametrize(("sizes", "ranks", "owners"), [
    ([10, 1, 7, 3, 3], 2, [0, 1, 1, 1, 0]),  # 10 | 7, 3 to the lighter, then a tie: the lower rank
    ([4, 4, 4, 4], 4, [0, 1, 2, 3]),
    ([5, 5], 3, [0, 1]),
])
def test_owners_are_assigned_largest_first_to_the_least_loaded(sizes, ranks, owners) -> None:
    from parallel.zero import assign_owners

    assert assign_owners(sizes, ranks) == owners


def _gather(world):
    import torch
    import torch.distributed as dist

    from parallel.zero import ZeroShards

    shapes = [((3,), torch.float32), ((5,), torch.float64), ((2, 2), torch.float32), ((4,), torch.float32)]
    params = [torch.full(shape, float(10 * world.rank + i), dtype=dtype) for i, (shape, dtype) in enumerate(shapes)]
    shards = ZeroShards(params, dist.group.WORLD)
    received = shards.gather_parameters()
    owners = [next(r for r, owned in enumerate(shards.by_owner) if any(p is q for q in owned)) for p in params]
    return [p.tolist() for p in params], owners, received


def test_each_owner_broadcasts_its_parameters_whatever_their_dtypes() -> None:
    results = run_ranks(2, _gather, timeout=60)
    owners = results[0][1]
    assert owners == [0, 0, 1, 1] and results[1][1] == owners  # 5 -> 0, 4 -> 1, 4 -> 1 (4 < 5), 3 -> 0 (5 < 8)
    expected = [np.full(shape, 10 * owner + i).tolist()
                for i, (shape, owner) in enumerate(zip([(3,), (5,), (2, 2), (4,)], owners, strict=True))]
    for rank, (values, _, received) in enumerate(results):
        assert values == expected, rank
        assert received == sum(4 * n if i != 1 else 8 * n for i, n in enumerate([3, 5, 4, 4]) if owners[i] != rank)

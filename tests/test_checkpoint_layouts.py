"""Exact continuation under DP, TP, PP and 3D layouts, and resharding: the checkpoint layer alone.

tests/test_checkpoint_3d.py does the same through the GPT's training loop; this file
keeps the checkpoint package honest without a model, on a 3D layout of 8 ranks and with
an asynchronous save still writing while the next steps update the state. A layout only
changes which blocks of each global tensor a rank holds, so a synthetic sharding stands
in for TP and PP: tensors are split along dim 0
over TP (norms stay whole), dealt to pipeline stages by position, and replicated over
DP. Each rank trains its blocks with a real Adam on gradients that depend on the step,
the block, and noise from the rank's own RNG averaged over its DP group, so replicas
stay identical and every piece of state (parameters, moments, step counts, RNG) matters.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from tests.ranks import run_ranks

SHAPES = {"blocks.0.b": (12,), "blocks.0.w": (12, 8), "blocks.1.norm": (8,), "blocks.1.w": (8, 12), "embed": (16, 6),
          "head": (4, 8)}


def blocks(layout: tuple[int, int, int], rank: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """name -> (offsets, shape) of the block this rank holds under (dp, tp, pp)."""
    from hpc.runtime.mesh import MeshShape

    coords = MeshShape(*layout).coords(rank)
    tp, pp = layout[1], layout[2]
    held = {}
    for position, name in enumerate(sorted(SHAPES)):
        if position % pp != coords["pp"]:
            continue
        shape = SHAPES[name]
        if name.endswith("norm"):
            held[name] = ((0,) * len(shape), shape)
        else:
            rows = shape[0] // tp
            held[name] = ((coords["tp"] * rows,) + (0,) * (len(shape) - 1), (rows, *shape[1:]))
    return held


def _region(offsets, shape):
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


class Shard:
    """One rank's part of the synthetic model and its optimizer, under one layout."""

    def __init__(self, layout, rank: int, seed: int) -> None:
        import torch

        self.layout, self.rank = layout, rank
        self.blocks = blocks(layout, rank)
        self.params = {}
        for name, (offsets, shape) in self.blocks.items():
            full = torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            self.params[name] = torch.nn.Parameter(full[_region(offsets, shape)].clone())
        self.optimizer = torch.optim.Adam(list(self.params.values()), lr=0.01)
        torch.manual_seed(seed)

    def train(self, steps: int, first: int, dp_group, dp_size: int) -> None:
        import torch
        import torch.distributed as dist

        for step in range(first, first + steps):
            for name, param in self.params.items():
                param.grad = torch.sin(param.detach() * (step + 1))
                if not name.endswith("norm"):  # whole on every TP rank: its gradient must be too
                    noise = torch.randn(param.shape)
                    dist.all_reduce(noise, group=dp_group)
                    param.grad += noise / dp_size
            self.optimizer.step()

    def pieces(self):
        from hpc.checkpoint import Piece

        pieces = []
        for name, param in self.params.items():
            offsets = self.blocks[name][0]
            pieces.append(Piece(f"model/{name}", param.detach(), SHAPES[name], offsets))
            for key, value in self.optimizer.state[param].items():
                if value.dim():
                    pieces.append(Piece(f"optim/{name}/{key}", value, SHAPES[name], offsets))
                else:
                    pieces.append(Piece.whole(f"optim/{name}/{key}", value))
        return pieces

    def restore(self, step_dir: str) -> int:
        import torch

        from hpc.checkpoint import load_into, load_rank_state, open_checkpoint

        index = open_checkpoint(step_dir)
        targets = target_pieces(self.layout, self.rank)
        load_into(index, targets)
        by_name = {piece.name: piece.tensor for piece in targets}
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(by_name[f"model/{name}"])
        state = {
            position: {key: by_name[f"optim/{name}/{key}"] for key in ("step", "exp_avg", "exp_avg_sq")}
            for position, name in enumerate(self.params)
        }
        self.optimizer.load_state_dict({"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]})
        torch.set_rng_state(load_rank_state(index, self.rank)["rng"])
        return index.step

    def snapshot(self) -> dict:
        """Everything a continuation depends on, as numpy (torch tensors cannot outlive a rank's process)."""
        import torch

        return {"rng": torch.get_rng_state().numpy(), **{p.name: p.tensor.numpy().copy() for p in self.pieces()}}


def target_pieces(layout, rank: int):
    """Empty tensors for every block (parameters and Adam state) a rank holds under ``layout``."""
    import torch

    from hpc.checkpoint import Piece

    pieces = []
    for name, (offsets, shape) in blocks(layout, rank).items():
        for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
            prefix, _, key = kind.partition("/")
            full_name = f"{prefix}/{name}/{key}" if key else f"{prefix}/{name}"
            pieces.append(Piece(full_name, torch.empty(shape), SHAPES[name], offsets))
        pieces.append(Piece.whole(f"optim/{name}/step", torch.empty(())))
    return pieces


def _mesh(world, layout):
    from hpc.runtime.mesh import MeshShape, build_mesh

    mesh = build_mesh(MeshShape(*layout), world.rank)
    return mesh.group("dp"), mesh.size("dp")


def _continue_exactly(world, layouts, root):
    """For each (layout, async): 10 steps, save, 10 more; against a fresh run resumed from the save."""
    import torch
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer

    outcomes = []
    for number, (layout, async_save) in enumerate(layouts):
        dp_group, dp_size = _mesh(world, layout)
        directory = f"{root}/{number}"
        uninterrupted = Shard(layout, world.rank, seed=1000 + world.rank)
        uninterrupted.train(10, 0, dp_group, dp_size)
        saver = Checkpointer(directory, dist.group.WORLD, async_save=async_save)
        saver.save(10, uninterrupted.pieces(), {"rng": torch.get_rng_state()})
        uninterrupted.train(10, 10, dp_group, dp_size)  # while an asynchronous save may still be writing
        saver.finalize()
        dist.barrier()  # rank 0 has published the step
        resumed = Shard(layout, world.rank, seed=7)
        step = resumed.restore(f"{directory}/step-00000010")
        resumed.train(10, step, dp_group, dp_size)
        outcomes.append((uninterrupted.snapshot(), resumed.snapshot()))
    return outcomes


def _assert_bitwise_equal(outcomes_per_rank) -> None:
    for rank, outcomes in enumerate(outcomes_per_rank):
        for layout_number, (expected, got) in enumerate(outcomes):
            assert expected.keys() == got.keys()
            assert any(k.startswith("optim/") for k in expected) and "rng" in expected
            for name, array in expected.items():
                same = got[name].dtype == array.dtype and np.array_equal(got[name], array)
                assert same, f"layout #{layout_number}, rank {rank}: {name} differs"


@pytest.mark.slow
def test_dp_tp_and_pp_runs_continue_exactly_after_a_resume(tmp_path) -> None:
    layouts = [((4, 1, 1), False), ((1, 4, 1), True), ((1, 1, 4), False), ((2, 2, 1), True)]
    _assert_bitwise_equal(run_ranks(4, _continue_exactly, layouts, str(tmp_path), timeout=180))


@pytest.mark.slow
def test_a_3d_run_continues_exactly_after_a_resume(tmp_path) -> None:
    _assert_bitwise_equal(run_ranks(8, _continue_exactly, [((2, 2, 2), True)], str(tmp_path), timeout=240))


def _reshard(world, root, targets):
    """Train and save under (2, 2, 1); load every block of other layouts and compare with the whole tensors."""
    import torch
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, load_into, load_rank_state, open_checkpoint

    layout = (2, 2, 1)
    dp_group, dp_size = _mesh(world, layout)
    shard = Shard(layout, world.rank, seed=1000 + world.rank)
    shard.train(5, 0, dp_group, dp_size)
    rng = torch.get_rng_state()
    Checkpointer(root, dist.group.WORLD).save(5, shard.pieces(), {"rng": rng}, {"layout_dp": 2, "layout_tp": 2})
    held: list = [None] * world.size
    dist.all_gather_object(held, [(p.name, p.offsets, p.tensor.clone()) for p in shard.pieces()])
    whole = {}
    for name, offsets, tensor in (item for pieces in held for item in pieces):
        base = name.split("/")[1]
        target = whole.setdefault(name, torch.full(SHAPES[base] if tensor.dim() else (), float("nan")))
        target[_region(offsets, tensor.shape)] = tensor
    assert not any(t.isnan().any() for t in whole.values())
    index = open_checkpoint(f"{root}/step-00000005")
    checked = {}
    for target in targets:
        if world.rank >= math.prod(target):
            continue
        pieces = target_pieces(target, world.rank)
        load_into(index, pieces)
        for piece in pieces:
            expected = whole[piece.name][_region(piece.offsets, piece.tensor.shape)]
            assert torch.equal(piece.tensor, expected), f"{target}: {piece.name} at {piece.offsets}"
        checked[target] = len(pieces)
    assert torch.equal(load_rank_state(index, world.rank)["rng"], rng)  # same world size: each rank its own
    return checked


@pytest.mark.slow
def test_a_checkpoint_saved_under_2_2_1_loads_under_other_layouts(tmp_path) -> None:
    targets = [(4, 1, 1), (1, 2, 2), (1, 1, 1)]
    checked = run_ranks(4, _reshard, str(tmp_path), targets, timeout=180)
    blocks_per_tensor = 4  # the parameter, two moments and the step count
    assert checked[0] == {t: blocks_per_tensor * len(blocks(t, 0)) for t in targets}
    assert checked[0][(1, 1, 1)] == blocks_per_tensor * len(SHAPES)
    assert all(set(c) == {(4, 1, 1), (1, 2, 2)} for c in checked[1:])

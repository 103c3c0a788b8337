"""The node-local checkpoint tier (hpc/checkpoint/local.py, issue 42): 4 ranks as 2 nodes of 2, each node its own
directory; a node whose directory is gone (replaced by a spare) gets its ranks' files back from the peer copies
and every rank loads exactly what it saved; with both copies of a shard gone the tier says there is none; under
NCCL's rules the same saves and restore neither deadlock nor reorder a group's collectives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc.checkpoint.pieces import Piece
from tests.ranks import run_ranks


def _pieces(rank: int, step: int) -> list[Piece]:
    """A replicated tensor (one rank writes it) and one of this rank's own, with the step's values."""
    shared = torch.arange(12, dtype=torch.float32).reshape(3, 4) * step
    own = torch.full((5,), float(100 * rank + step))
    return [Piece.whole("shared", shared), Piece("own", own, (4 * 5,), (rank * 5,))]


def _save_lose_restore(world, root: str, lost_nodes: list[int]) -> tuple:
    from hpc.checkpoint.load import load_into, load_rank_state
    from hpc.checkpoint.local import LocalTier, needed_files

    node = world.rank // 2
    directory = Path(root) / f"node{node}"
    tier = LocalTier(directory, node, keep=2)
    for step in (2, 4, 6):
        tier.save(step, _pieces(world.rank, step), {"rng": torch.tensor([world.rank * 1000 + step])},
                  {"layout_dp": 4})
    dist.barrier()
    if node in lost_nodes and world.rank % 2 == 0:
        shutil.rmtree(directory)
    dist.barrier()
    targets = _pieces(world.rank, 0)
    for piece in targets:
        piece.tensor.zero_()
    index = tier.restore(None, lambda index: needed_files(index, targets, world.rank))
    if index is None:
        return None, sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    path = index.path
    load_into(index, targets)
    private = load_rank_state(index, world.rank)["rng"]
    expected = _pieces(world.rank, index.step)
    same = all(torch.equal(a.tensor, b.tensor) for a, b in zip(targets, expected, strict=True))
    return index.step, same, int(private.item()), sorted(p.name for p in path.iterdir())


def test_a_lost_node_gets_its_shards_back_from_the_peer_copies(tmp_path) -> None:
    results = run_ranks(4, _save_lose_restore, str(tmp_path), [1], timeout=120)
    for rank, (step, same, private, _) in enumerate(results):
        assert (step, same, private) == (6, True, rank * 1000 + 6), results
    # node 1 (a spare now) holds what its ranks read: the shards of ranks 2 and 3, and rank 0's (the shared tensor)
    assert results[2][3] == ["index.h5", "rank-00000.h5", "rank-00002.h5", "rank-00003.h5"]
    kept = sorted(p.name for p in (tmp_path / "node0").iterdir())
    assert kept == ["step-00000004", "step-00000006"]  # local_keep = 2
    assert sorted(p.name for p in (tmp_path / "node0" / "step-00000006").iterdir()) == [
        "COMPLETE", "index.h5", "rank-00000.h5", "rank-00001.h5", "rank-00002.h5", "rank-00003.h5"]


def test_with_both_copies_of_a_shard_gone_there_is_no_local_step(tmp_path) -> None:
    results = run_ranks(4, _save_lose_restore, str(tmp_path), [0, 1], timeout=120)
    assert all(step is None for step, _ in results), results


@pytest.mark.parametrize("lost", [[1]])
def test_the_local_tier_keeps_nccl_rules(tmp_path, lost) -> None:
    from tests.nccl_rules import BACKEND

    results = run_ranks(4, _save_lose_restore, str(tmp_path), lost, timeout=120, backend=BACKEND)
    assert [r[:3] for r in results] == [(6, True, rank * 1000 + 6) for rank in range(4)]


def test_hpc_ckpt_ls_of_a_run_lists_both_tiers(tmp_path, monkeypatch, capsys) -> None:
    from hpc.checkpoint.discovery import local_root
    from hpc.cli.main import main

    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "scratch"))
    run = tmp_path / "run"
    for directory, step in ((run / "checkpoints", 10), (local_root(run), 12)):
        (directory / f"step-{step:08d}").mkdir(parents=True)
        (directory / f"step-{step:08d}" / "COMPLETE").write_text("{}")
    assert main(["ckpt", "ls", str(run)]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["10", "shared", "complete"], ["12", "local", "complete"]]
    assert str(local_root(run)).startswith(str(tmp_path / "scratch" / "hpc-local" / "run-"))
    assert local_root(run, "/nvme").parent == Path("/nvme/hpc-local")  # checkpoint.local_dir

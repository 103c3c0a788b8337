"""tests/ranks.py itself: what a rank returns reaches the test even when the rank has exited first."""

from __future__ import annotations

import pickle

import torch

from hpc.runtime.bootstrap import free_port
from tests import ranks


def _a_tensor(world) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32) + world.rank


def test_a_ranks_result_outlives_the_rank() -> None:
    """A queue would send the tensor's storage as a file descriptor that the rank serves until it exits; a rank
    that exits before the test reads its result left a FileNotFoundError instead (CI at stop 59)."""
    ctx = ranks._context()
    results = ctx.Queue()
    rank = ctx.Process(target=ranks._rank_main, args=(_a_tensor, 0, 1, free_port(), (), results))
    rank.start()
    rank.join(timeout=60)
    assert rank.exitcode == 0
    index, ok, value = results.get(timeout=10)
    assert (index, ok) == (0, True)
    assert torch.equal(pickle.loads(value), torch.arange(4096, dtype=torch.float32))

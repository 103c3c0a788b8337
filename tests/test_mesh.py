import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from hpc.errors import LayoutError
from hpc.runtime.mesh import MeshShape, build_mesh, resolve_layout
from tests.ranks import run_ranks

shapes = st.builds(MeshShape, st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))


@given(shapes)
def test_every_axis_partitions_the_world(shape: MeshShape) -> None:
    for axis in ("dp", "tp", "pp"):
        groups = shape.group_ranks(axis)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(shape.size))
        assert all(len(g) == getattr(shape, axis) for g in groups)


@given(shapes)
def test_coords_and_rank_of_are_inverse(shape: MeshShape) -> None:
    for rank in range(shape.size):
        assert shape.rank_of(**shape.coords(rank)) == rank


@given(shapes)
def test_group_members_differ_only_along_their_axis(shape: MeshShape) -> None:
    for axis in ("dp", "tp", "pp"):
        for group in shape.group_ranks(axis):
            coords = [shape.coords(r) for r in group]
            assert [c[axis] for c in coords] == list(range(len(group)))
            for other in {"dp", "tp", "pp"} - {axis}:
                assert len({c[other] for c in coords}) == 1


def test_layout_order_is_tp_then_dp_then_pp() -> None:
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert shape.group_ranks("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shape.group_ranks("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert shape.group_ranks("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_auto_dp_fills_the_world() -> None:
    assert resolve_layout("auto", 2, 1, 8) == MeshShape(4, 2, 1)


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "world", "message"),
    [
        (2, 2, 2, 4, "dp\\*tp\\*pp = 2\\*2\\*2 = 8 does not match the world size 4"),
        ("auto", 3, 1, 4, "tp \\* parallel.pp = 3\\*1 = 3 does not divide the world size 4"),
    ],
)
def test_bad_layouts_are_one_line_errors(dp, tp, pp, world, message) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        resolve_layout(dp, tp, pp, world)
    assert "\n" not in str(info.value)


def _sum_rank_ids_per_axis(world):
    mesh = build_mesh(MeshShape(dp=2, tp=2, pp=1), world.rank)
    sums = {}
    for axis in ("dp", "tp", "pp"):
        value = torch.tensor([float(world.rank)])
        dist.all_reduce(value, group=mesh.group(axis))
        sums[axis] = (value.item(), mesh.members[axis], mesh.index(axis))
    return sums


def test_groups_reduce_over_exactly_their_members() -> None:
    results = run_ranks(4, _sum_rank_ids_per_axis)
    shape = MeshShape(dp=2, tp=2, pp=1)
    for rank, sums in enumerate(results):
        for axis, (total, members, index) in sums.items():
            expected = next(g for g in shape.group_ranks(axis) if rank in g)
            assert members == expected
            assert total == sum(expected)
            assert index == shape.coords(rank)[axis]


def _skip_one_tp_all_reduce(world, timeout_s: float, rank0_done: Path):
    """Rank 1 skips a TP all-reduce that rank 0 enters; how long rank 0 waits, and what it raised."""
    import time

    mesh = build_mesh(MeshShape(dp=1, tp=2, pp=1), world.rank, timeout_s=timeout_s)
    dist.all_reduce(torch.ones(1), group=mesh.group("tp"))  # the group works
    if world.rank == 1:  # never enters; stays alive until rank 0 is done (so it sees a wait, not a vanished peer)
        deadline = time.monotonic() + timeout_s + 15
        while not rank0_done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.group("tp"))
    except RuntimeError as exc:
        return time.monotonic() - start, str(exc).splitlines()[0]
    finally:
        rank0_done.touch()
    return time.monotonic() - start, "returned"


def test_every_mesh_group_times_out_after_parallel_timeout_s_not_torchs_thirty_minutes(tmp_path) -> None:
    """torch gives dist.new_group the backend's 30 minutes; a TP all-reduce that one rank never enters must fail
    after the mesh's timeout. Gloo's timeout is what is tested (tests/nccl_rules.py names the missing rank as a
    deadlock first), so the sweep under NCCL's rules keeps Gloo here."""
    waited, why = run_ranks(2, _skip_one_tp_all_reduce, 3.0, tmp_path / "rank0-done", timeout=60, backend="gloo")[0]
    assert why != "returned" and 2.5 < waited < 13, (waited, why)

"""Pipeline schedules are pure data: their properties are checked here without a single process."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc.errors import ConfigError, LayoutError
from parallel.schedule import (
    Action,
    DeadlockError,
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    stage_bounds,
    theoretical_bubble,
    validate,
)


@st.composite
def layouts(draw) -> tuple[str, int, int, int]:
    """(schedule, p, m, v) over p in 1..6, m in 1..12, v in 1..3; interleaved takes m % p == 0."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    p = draw(st.integers(1, 6))
    if name != "interleaved":
        return name, p, draw(st.integers(1, 12)), 1
    return name, p, p * draw(st.integers(1, 12 // p)), draw(st.integers(1, 3))


def _compute_positions(schedule) -> dict[tuple[str, int, int], tuple[int, int]]:
    return {(a.kind, a.microbatch, a.stage): (rank, i)
            for rank, actions in enumerate(schedule) for i, a in enumerate(actions) if a.is_compute}


@given(layouts())
def test_every_stage_runs_forward_then_backward_once_per_microbatch_on_its_rank(layout) -> None:
    name, p, m, v = layout
    schedule = build_schedule(name, p, m, v)
    positions = _compute_positions(schedule)
    assert len(positions) == sum(a.is_compute for actions in schedule for a in actions) == 2 * m * p * v
    for mb in range(m):
        for stage in range(p * v):
            (f_rank, f_index), (b_rank, b_index) = positions["F", mb, stage], positions["B", mb, stage]
            assert f_rank == b_rank == stage % p
            assert f_index < b_index


@given(layouts())
def test_sends_and_receives_pair_up_in_the_same_order_on_each_channel(layout) -> None:
    name, p, m, v = layout
    schedule = build_schedule(name, p, m, v)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind == "SEND_F":
                sent[rank, a.peer, "F"].append((a.microbatch, a.stage + 1))
            elif a.kind == "SEND_B":
                sent[rank, a.peer, "B"].append((a.microbatch, a.stage - 1))
            elif a.kind in ("RECV_F", "RECV_B"):
                received[a.peer, rank, a.kind[-1]].append((a.microbatch, a.stage))
    assert sent == received
    boundaries = (p * v - 1) * m if p > 1 else 0  # one activation and one gradient cross each
    assert sum(len(messages) for messages in sent.values()) == 2 * boundaries
    validate(schedule)


@given(layouts(), st.sampled_from([0.0, 0.5]))
def test_simulation_finishes_and_respects_every_dependency(layout, comm_time) -> None:
    name, p, m, v = layout
    schedule = build_schedule(name, p, m, v)
    result = simulate(schedule, forward_time=1.0, backward_time=2.0, comm_time=comm_time)
    assert [len(t) for t in result.timelines] == [len(a) for a in schedule]
    ends = {}
    for timeline in result.timelines:
        computes = [i for i in timeline if i.action.is_compute]
        assert all(a.end <= b.start for a, b in itertools.pairwise(computes))
        ends.update({(i.action.kind, i.action.microbatch, i.action.stage): i for i in computes})
    for (kind, mb, stage), interval in ends.items():
        upstream = ("F", mb, stage - 1) if kind == "F" else ("B", mb, stage + 1)
        if upstream in ends:
            delay = comm_time if p > 1 else 0.0
            assert interval.start >= ends[upstream].end + delay - 1e-9
    assert result.makespan == pytest.approx(max(i.end for t in result.timelines for i in t))


@given(layouts(), st.sampled_from([1.0, 2.0]))
def test_simulated_bubble_is_the_theory(layout, backward_time) -> None:
    """Exact for F = B as the theory states; it also holds for B = 2F, as both schedules keep the
    critical path at (p-1) chunk-steps of fill and of drain whatever the F:B ratio."""
    name, p, m, v = layout
    result = simulate(build_schedule(name, p, m, v), forward_time=1.0, backward_time=backward_time)
    assert result.bubble == pytest.approx(theoretical_bubble(name, p, m, v), abs=1e-12)
    assert result.busy == [m * v * (1.0 + backward_time)] * p


@given(st.integers(1, 6), st.integers(1, 12))
def test_1f1b_keeps_at_most_p_microbatches_in_flight_and_gpipe_all_m(p, m) -> None:
    assert simulate(one_f_one_b(p, m)).peak_in_flight == [min(m, p - r) for r in range(p)]
    assert simulate(gpipe(p, m)).peak_in_flight == [m] * p


@given(st.integers(1, 6), st.integers(1, 2), st.integers(1, 3))
def test_interleaved_keeps_its_warm_up_and_one_more_chunk_in_flight(p, groups, v) -> None:
    """A chunk holds 1/v of a stage's activations: rank r holds Megatron's warm-up of 2 (p-r-1) + (v-1) p
    chunks and one more, at most p*v + p - 1 (p + 1 - 1/v stages' worth), the price of its NCCL-safe batches."""
    peaks = simulate(interleaved_1f1b(p, p * groups, v)).peak_in_flight
    assert peaks == [min(2 * (p - r - 1) + (v - 1) * p + 1, p * groups * v) for r in range(p)]
    assert max(peaks) <= p * v + p - 1


def test_1f1b_order_is_warm_up_then_alternate() -> None:
    computes = [[f"{a.kind}{a.microbatch}" for a in actions if a.is_compute] for actions in one_f_one_b(2, 3)]
    assert computes == [["F0", "F1", "B0", "F2", "B1", "B2"], ["F0", "B0", "F1", "B1", "F2", "B2"]]
    assert [str(a) for a in one_f_one_b(2, 3)[0][:3]] == ["F(mb0,s0)", "SEND_F(mb0,s0)->r1", "F(mb1,s0)"]


def test_a_receive_before_its_send_can_happen_is_a_named_deadlock() -> None:
    schedule = one_f_one_b(2, 1)
    receive = next(a for a in schedule[0] if a.kind == "RECV_B")
    schedule[0] = [receive] + [a for a in schedule[0] if a != receive]
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    assert info.value.context["stuck_ranks"] == [0, 1]
    assert "rank 0 at RECV_B(mb0,s0)<-r1 waits for" in str(info.value)
    assert "rank 1 at RECV_F(mb0,s1)<-r0" in str(info.value)


def test_validate_names_what_is_wrong() -> None:
    schedule = gpipe(2, 2)
    receives = [i for i, a in enumerate(schedule[1]) if a.kind == "RECV_F"]
    swapped = list(schedule[1])
    swapped[receives[0]], swapped[receives[1]] = swapped[receives[1]], swapped[receives[0]]
    with pytest.raises(ScheduleError, match="F messages from rank 0 to rank 1 are sent as"):
        validate([schedule[0], swapped])
    with pytest.raises(ScheduleError, match="backward before its forward"):
        validate([[Action("B", 0, 0), Action("F", 0, 0)]])
    with pytest.raises(ScheduleError, match="1 computations are missing, first B of microbatch 0 on stage 0"):
        validate([[Action("F", 0, 0)]])
    with pytest.raises(ScheduleError, match="2 computations are missing, first B of microbatch 0 on stage 0"):
        validate([[], [Action("F", 0, 1), Action("B", 0, 1)]])
    with pytest.raises(ScheduleError, match="stage 1 belongs to rank 1"):
        validate([[Action("F", 0, 1)], []])
    with pytest.raises(ScheduleError, match="sent before it was computed"):
        validate([[Action("SEND_F", 0, 0, 1), Action("F", 0, 0)], []])


def test_bad_sizes_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="multiple of the pipeline stages: 6 % 4 = 2"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ConfigError, match="virtual_stages=2 needs schedule='interleaved'"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ConfigError, match="microbatches=0"):
        gpipe(2, 0)
    with pytest.raises(LayoutError, match=r"12 layers cannot be cut into pp\*virtual_stages = 4\*2 = 8"):
        stage_bounds(12, 4, 2)
    assert stage_bounds(12, 2, 3) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]

"""The pipeline executor must train exactly like one process running the whole model on the whole batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from hpc.errors import LayoutError
from hpc.runtime import launch
from hpc.runtime.mesh import MeshShape, build_mesh
from parallel.pipeline import _forward_keeping, split_into_stages
from parallel.schedule import build_schedule, theoretical_bubble
from tests.ranks import run_ranks, run_under_mpirun

WIDTH, LAYERS, BATCH, STEPS, LR = 8, 8, 24, 10, 0.2


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
            for _ in range(STEPS)]


def _single_process() -> tuple[list[float], list[list[torch.Tensor]]]:
    blocks = _blocks()
    model = nn.Sequential(*blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [[t.detach().clone() for t in block.parameters()] for block in blocks]


def _train(world, shape: MeshShape, cases: list[tuple[str, int, int]], transport: str = "torch"):
    """Each (schedule, m, v) in turn from the same initial model, one pipeline per data-parallel
    replica, each replica taking its share of every batch; one launch for all cases keeps it fast."""
    mesh = build_mesh(shape, world.rank)
    return [_train_case(mesh, *case, transport=transport) for case in cases]


def _train_case(mesh, schedule: str, m: int, v: int, transport: str = "torch"):
    import torch.distributed as dist

    from parallel.pipeline import run_pipeline_step
    from parallel.transport import make_transport

    shape = mesh.shape
    p, stage_rank, replica = shape.pp, mesh.index("pp"), mesh.index("dp")
    chunks = split_into_stages(_blocks(), p, v)[stage_rank]
    parameters = [t for chunk in chunks for t in chunk.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=LR)
    actions = build_schedule(schedule, p, m, v)[stage_rank]
    rows = BATCH // shape.dp
    losses = []
    for x, y in _batches():
        x, y = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
        optimizer.zero_grad()
        stats = run_pipeline_step(
            actions, chunks, mesh.group("pp"), activation_shape=(rows // m, WIDTH), loss_fn=nn.functional.mse_loss,
            inputs=x.chunk(m), targets=y.chunk(m),
            transport=make_transport(transport, mesh.group("pp")),
        )
        loss = stats.loss
        if shape.dp > 1:
            for param in parameters:
                dist.all_reduce(param.grad, group=mesh.group("dp"))
                param.grad /= shape.dp
            if loss is not None:  # then the whole dp group has one: its ranks share a pipeline position
                total = torch.tensor([loss], dtype=torch.float64)
                dist.all_reduce(total, group=mesh.group("dp"))
                loss = total.item() / shape.dp
        optimizer.step()
        losses.append(loss)
    # numpy, not tensors: a tensor crosses the result queue as shared memory owned by this exiting process
    stages = {k * p + stage_rank: [[t.detach().numpy() for t in block.parameters()] for block in chunk]
              for k, chunk in enumerate(chunks)}
    return losses, stages


def _check_matches_single_process(results, shape: MeshShape, v: int) -> None:
    reference_losses, reference_params = _single_process()
    per_stage = LAYERS // (shape.pp * v)
    last_rank = shape.rank_of(dp=0, tp=0, pp=shape.pp - 1)
    assert results[last_rank][0] == pytest.approx(reference_losses, rel=1e-5)
    assert reference_losses[-1] < reference_losses[0]
    for rank, (losses, stages) in enumerate(results):
        if shape.coords(rank)["pp"] < shape.pp - 1:
            assert losses == [None] * STEPS
        for stage, blocks in stages.items():
            for offset, params in enumerate(blocks):
                for got, want in zip(params, reference_params[stage * per_stage + offset], strict=True):
                    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-6)
    assert sorted(s for _, stages in results for s in stages) == sorted(
        s for s in range(shape.pp * v) for _ in range(shape.dp))


LAYOUTS = {  # (dp, pp): the (schedule, microbatches, virtual stages) run on it
    (1, 2): [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)],
    (1, 4): [("interleaved", 4, 2), ("1f1b", 2, 1), ("gpipe", 3, 1)],  # and fewer microbatches than stages
    (2, 2): [("1f1b", 2, 1), ("interleaved", 2, 2)],  # two pipelines: peers are ranks of the pp group
    (1, 1): [("interleaved", 3, 2)],  # one rank: its chunks hand over locally
}


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "pp"), list(LAYOUTS))
def test_pipeline_matches_single_process(dp, pp) -> None:
    shape = MeshShape(dp=dp, tp=1, pp=pp)
    results = run_ranks(shape.size, _train, shape, LAYOUTS[dp, pp], timeout=120)
    for index, (schedule, m, v) in enumerate(LAYOUTS[dp, pp]):
        print(f"checking {schedule} m={m} v={v}")
        _check_matches_single_process([per_rank[index] for per_rank in results], shape, v)


@pytest.mark.slow
@pytest.mark.skipif(not launch.has_open_mpi(), reason="Open MPI is not installed")
def test_pipeline_over_the_mpi_transport_matches_single_process() -> None:
    results = run_under_mpirun(2, _train, MeshShape(dp=1, tp=1, pp=2), LAYOUTS[1, 2], "mpi")
    for index, (schedule, m, v) in enumerate(LAYOUTS[1, 2]):
        print(f"checking {schedule} m={m} v={v} over mpi")
        _check_matches_single_process([per_rank[index] for per_rank in results], MeshShape(dp=1, tp=1, pp=2), v)


def test_every_schedule_built_moves_under_nccls_rules_and_a_reordered_one_does_not() -> None:
    """NCCL matches messages in order and runs each rank's batches one after another: every schedule built
    here passes ``lockstep_deadlock`` (tests/test_lockstep.py runs them); one whose last rank receives two
    forward messages swapped is named."""
    from parallel.schedule import Action, build_schedule, lockstep_deadlock

    assert not any(lockstep_deadlock(build_schedule(name, p, 8, v))
                   for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)) for p in (2, 4))
    schedule = build_schedule("gpipe", 2, 2)
    receives = [index for index, action in enumerate(schedule[1]) if action.kind == "RECV_F"]
    first, second = (schedule[1][index] for index in receives)
    schedule[1][receives[0]], schedule[1][receives[1]] = (Action("RECV_F", second.microbatch, 1, 0),
                                                          Action("RECV_F", first.microbatch, 1, 0))
    assert "NCCL matches messages in order" in lockstep_deadlock(schedule)


def test_a_model_that_does_not_divide_into_stages_is_a_layout_error() -> None:
    with pytest.raises(LayoutError, match=r"6 layers cannot be cut into pp\*virtual_stages = 2\*2 = 4"):
        split_into_stages([nn.Identity() for _ in range(6)], 2, 2)
    stages = split_into_stages([nn.Linear(1, 1) for _ in range(8)], 2, 2)
    assert [[len(chunk) for chunk in chunks] for chunks in stages] == [[2, 2], [2, 2]]


def test_activation_bytes_count_what_backward_keeps_but_not_parameters_or_the_callers_data() -> None:
    chunk = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    x = torch.randn(5, WIDTH)
    one = x.nbytes
    # linear saves its input, tanh its output: x, tanh1 (input of linear2), tanh2 (the output)
    assert _forward_keeping(chunk, x.requires_grad_(), [*chunk.parameters()])[1] == 3 * one
    assert _forward_keeping(chunk, x, [*chunk.parameters(), x])[1] == 2 * one


@pytest.mark.slow
def test_bench_pipeline_json_rows() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "pipeline", "--stages", "2", "--microbatches", "4",
         "--layers", "4", "--width", "32", "--rows", "4", "--steps", "1", "--launcher", "local", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["schedule"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert list(rows) == ["gpipe", "1f1b", "interleaved"]
    for name, r in rows.items():
        assert (r["transport"], r["stages"], r["microbatches"]) == ("torch", 2, 4)
        assert r["virtual"] == (2 if name == "interleaved" else 1)
        assert r["bubble_theory"] == theoretical_bubble(name, 2, 4, r["virtual"])
        assert 0 <= r["bubble_measured"] < 1 and r["step_s"] > 0
        assert r["message_s"] > 0 and r["chunk_compute_s"] > 0  # what one message costs, against one compute
        assert r["bubble_theory"] - 1e-9 <= r["bubble_simulated"] < 1  # messages only ever add to the bubble
    # GPipe keeps all 4 microbatches for backward, 1F1B at most p = 2
    assert rows["gpipe"]["peak_activation_bytes"] > rows["1f1b"]["peak_activation_bytes"] > 0


def test_bench_pipeline_rejects_a_model_that_does_not_divide(capsys) -> None:
    from hpc.cli.main import main

    assert main(["bench", "pipeline", "--stages", "4", "--layers", "12", "--virtual", "2"]) == 2
    assert "12 layers cannot be cut into pp*virtual_stages = 4*2 = 8 equal stages" in capsys.readouterr().err

"""``parallel.horovod`` against Horovod's documented semantics, and a Horovod script under both launchers.

The API's tests run twice: over Gloo, and under NCCL's rules (tests/nccl_rules.py), where a GPU job's
collectives go: named operations issued in another order on each rank, a rank that joins early and a
mismatch must all keep every rank's collectives in one order there, or a cluster would hang."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc.runtime import launch
from tests.conftest import BOTH_BACKENDS
from tests.ranks import run_ranks

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "jobs" / "examples" / "horovod_digits.py"


def _collectives(world):
    from parallel import horovod as hvd

    hvd.init()  # already joined by the test helper: must be harmless
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "size": n, "local": (hvd.local_rank(), hvd.local_size())}
    out["cross"] = (hvd.cross_rank(), hvd.cross_size())
    x = torch.full((3,), float(r + 1))
    avg = hvd.allreduce(x)
    out["average_is_new_tensor"] = avg is not x and torch.equal(x, torch.full((3,), float(r + 1)))
    out["average"] = avg.tolist()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    out["min_max_prod"] = [hvd.allreduce(x, op=op)[0].item() for op in (hvd.Min, hvd.Max, hvd.Product)]
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
    out["legacy_average_false"] = hvd.allreduce(x, average=False).tolist()
    y = x.clone()
    returned = hvd.allreduce_(y, op=hvd.Sum)
    out["in_place"] = returned is y and y.tolist() == out["sum"]
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    out["async"] = hvd.synchronize(handle).tolist()
    out["polled"] = hvd.poll(handle)
    out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)]
    out["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16).dtype == torch.float32
    # allreduce is differentiable: d(sum of average)/dx = 1 on every rank (average of ones)
    leaf = x.clone().requires_grad_()
    hvd.allreduce(leaf).sum().backward()
    out["allreduce_grad"] = leaf.grad.tolist()
    # allgather: first dimensions differ between ranks
    rows = torch.full((r + 1, 2), float(r), requires_grad=True)
    gathered = hvd.allgather(rows)
    out["allgather"] = gathered[:, 0].tolist()
    (gathered * (torch.arange(gathered.shape[0]).float()[:, None] + 1)).sum().backward()
    out["allgather_grad"] = rows.grad[:, 0].tolist()
    out["broadcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=1).tolist()
    b = torch.tensor([float(r)])
    hvd.broadcast_(b, root_rank=n - 1)
    out["broadcast_"] = b.tolist()
    # alltoall with splits: rank r sends i+1 rows holding r to rank i
    send = torch.cat([torch.full((i + 1,), float(r)) for i in range(n)])
    received, splits = hvd.alltoall(send, splits=torch.tensor([i + 1 for i in range(n)]))
    out["alltoall"] = (received.tolist(), splits.tolist())
    out["reducescatter"] = hvd.reducescatter(torch.arange(2 * n + 1, dtype=torch.float32), op=hvd.Sum).tolist()
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=0)
    out["objects"] = hvd.allgather_object(r * 10)
    out["join"] = hvd.join()
    hvd.barrier()
    out["built"] = (hvd.gloo_built(), hvd.mpi_built(), isinstance(hvd.nccl_built(), int))
    return out


@pytest.mark.parametrize(("version", "code"), [((2, 28, 9), 22809), ((2, 7, 8), 2708), (None, 0)])
def test_nccl_built_is_horovods_version_code(monkeypatch, version, code) -> None:
    """Horovod's tests skip alltoall where ``nccl_built()`` is below 2700: the version, not a bool (True is 1)."""
    import torch.distributed as dist

    import parallel.horovod as hvd

    monkeypatch.setattr(dist, "is_nccl_available", lambda: version is not None)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    assert hvd.nccl_built() == code


@BOTH_BACKENDS
def test_collectives_follow_horovod_semantics(backend) -> None:
    n = 3
    results = run_ranks(n, _collectives, backend=backend)
    total = sum(range(1, n + 1))
    for r, out in enumerate(results):
        assert out["rank"] == r and out["size"] == n
        assert out["local"] == (r, n) and out["cross"] == (0, 1)
        assert out["average_is_new_tensor"]
        assert out["average"] == [total / n] * 3
        assert out["sum"] == [total] * 3 == out["async"] == out["legacy_average_false"] == out["scaled"]
        assert out["min_max_prod"] == [1.0, float(n), 6.0]
        assert out["in_place"] and out["polled"] and out["fp16"]
        assert out["grouped"] == [[total] * 3, [2 * total] * 3]
        assert out["allreduce_grad"] == [1.0, 1.0, 1.0]
        assert out["allgather"] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        # gradient of sum(row_index+1 * row) averaged over the ranks (as Horovod), this rank's rows
        start = sum(range(1, r + 1))
        assert out["allgather_grad"] == [float(start + i + 1) for i in range(r + 1)]
        assert out["broadcast"] == [1.0] and out["broadcast_"] == [float(n - 1)]
        received, splits = out["alltoall"]
        assert splits == [r + 1] * n and received == [float(i) for i in range(n) for _ in range(r + 1)]
        # 7 rows over 3 ranks: 3, 2, 2 (the first ranks get the extra row)
        bounds = [(0, 3), (3, 5), (5, 7)][r]
        assert out["reducescatter"] == [n * float(v) for v in range(*bounds)]
        assert out["object"] == {"from": 0} and out["objects"] == [0, 10, 20]
        assert 0 <= out["join"] < n and out["join"] == results[0]["join"]
        assert out["built"] == (True, True, True)


def _optimizer_state(world):
    from parallel import horovod as hvd

    torch.manual_seed(world.rank)  # different weights and state on every rank before the broadcasts
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if world.rank == 0:
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()["state"]
    return (
        {k: v.numpy() for k, v in model.state_dict().items()},
        {k: {name: t.numpy() for name, t in v.items()} for k, v in state.items()},
    )


@BOTH_BACKENDS
def test_broadcast_parameters_and_optimizer_state_from_root(backend) -> None:
    results = run_ranks(2, _optimizer_state, backend=backend)
    (params0, state0), (params1, state1) = results
    for name in params0:
        np.testing.assert_array_equal(params0[name], params1[name])
    assert state0 and state0.keys() == state1.keys()
    for key in state0:
        for name in state0[key]:
            np.testing.assert_array_equal(state0[key][name], state1[key][name])


def _mismatch_and_join(world):
    from parallel import horovod as hvd

    out = {}
    try:  # shapes differ between the ranks: an error on both, not a hang
        hvd.allreduce(torch.ones(3 + world.rank))
    except hvd.HorovodInternalError as exc:
        out["mismatch"] = "shape" in str(exc)
    try:  # a host tensor on one rank, a device's on the other (meta stands in for a GPU): one error, no hang
        hvd.allreduce(torch.ones(3, device="meta" if world.rank else "cpu"))
    except hvd.HorovodInternalError as exc:
        out["device"] = str(exc)
    for call in (lambda: hvd.broadcast(torch.ones(2), root_rank=5), lambda: hvd.broadcast_object("x", root_rank=-1)):
        try:  # a root out of range: one error on every rank before any message (NCCL would not name it)
            call()
        except ValueError as exc:
            out.setdefault("roots", []).append(str(exc))
    try:  # reduction ops differ: named, not their index numbers
        hvd.allreduce(torch.ones(2), op=hvd.Max if world.rank else hvd.Sum)
    except hvd.HorovodInternalError as exc:
        out["op"] = str(exc)
    int16 = hvd.allreduce(torch.full((2,), 7, dtype=torch.int16), op=hvd.Average)  # Gloo has no int16
    out["int16"] = (int16.dtype == torch.int16, int16.tolist())
    if world.rank == 0:
        out["join"] = hvd.join()  # joins first: answers rank 1's allreduce with zeros
    else:
        out["joined_sum"] = hvd.allreduce(torch.full((2,), 4.0), op=hvd.Average).tolist()
        out["join"] = hvd.join()
    return out


@BOTH_BACKENDS
def test_mismatches_raise_and_join_lets_a_rank_finish_early(backend) -> None:
    first, second = run_ranks(2, _mismatch_and_join, backend=backend)
    assert first["mismatch"] and second["mismatch"]
    assert first["device"] == second["device"] and "disagree on the device: ['cpu', 'other']" in first["device"]
    assert first["op"] == second["op"] and "disagree on the reduction op: ['Sum', 'Max']" in first["op"]
    assert first["roots"] == second["roots"] == ["root_rank 5 is not a rank of this job (0 to 1)",
                                                 "root_rank -1 is not a rank of this job (0 to 1)"]
    assert first["int16"] == second["int16"] == (True, [7, 7])
    assert second["joined_sum"] == [2.0, 2.0]  # rank 0 contributed zeros; the average divides by 2
    assert first["join"] == second["join"] == 1  # the rank that joined last


def _sync_batch_norm(world):
    from parallel import horovod as hvd

    torch.manual_seed(0)
    whole = torch.randn(8, 3, 2)  # the same batch on both ranks; each normalizes its half
    sync_bn, bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    mine = whole[4 * world.rank : 4 * (world.rank + 1)].clone().requires_grad_()
    reference = whole.clone().requires_grad_()
    out, expected = sync_bn(mine), bn(reference)
    (out * out).sum().backward()
    (expected * expected).sum().backward()
    rows = slice(4 * world.rank, 4 * (world.rank + 1))
    return (torch.allclose(out, expected[rows], atol=1e-5),
            torch.allclose(mine.grad, reference.grad[rows], atol=1e-4),
            torch.allclose(sync_bn.running_var, bn.running_var, atol=1e-5))


@BOTH_BACKENDS
def test_sync_batch_norm_matches_batch_norm_over_the_whole_batch(backend) -> None:
    for same_output, same_grad, same_running_var in run_ranks(2, _sync_batch_norm, backend=backend):
        assert same_output and same_grad and same_running_var


def _sparse_gradients(world):
    from parallel import horovod as hvd

    model = torch.nn.Embedding(6, 2, sparse=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters())
    rows = torch.tensor([[0, 1, 1], [1, 4, 5]][world.rank])  # rank 0 uses rows 0,1,1; rank 1 rows 1,4,5
    model(rows).sum().backward()
    optimizer.synchronize()
    grad = model.weight.grad
    return grad.is_sparse, grad.to_dense()[:, 0].tolist()


@BOTH_BACKENDS
def test_sparse_gradients_are_averaged_and_stay_sparse(backend) -> None:
    for is_sparse, grad in run_ranks(2, _sparse_gradients, backend=backend):
        assert is_sparse
        # row 0: 1 use on rank 0; row 1: 2 on rank 0 and 1 on rank 1; rows 4, 5: 1 use on rank 1; averaged
        assert grad == [0.5, 1.5, 0.0, 0.0, 0.5, 0.5]


def _accuracies(output: str) -> list[float]:
    return [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", output)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "mpirun"])
def test_horovod_example_runs_under_both_launchers(launcher) -> None:
    if launcher == "mpirun" and not launch.has_open_mpi():
        pytest.skip("Open MPI is not installed")
    command = [sys.executable, "-m", "hpc.cli.main", "run", "-n", "4", "--launcher", launcher, str(EXAMPLE),
               "--epochs", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    accuracies = _accuracies(done.stdout)
    assert len(accuracies) == 4, done.stdout[-2000:]  # rank 0 reports once per epoch
    assert accuracies[-1] > 70.0  # it learns: 10 classes, chance is 10%



def _named_operations(world, timeline: str):
    """Horovod's coordinator: operations with a name are matched by name, not by program order."""
    from parallel import horovod as hvd

    r, out = world.rank, {}
    x, rows = torch.full((2,), float(r + 1)), torch.full((r + 1, 2), float(r))
    if r == 0:
        hvd.start_timeline(timeline, mark_cycles=True)
        total = hvd.allreduce_async(x, name="grad", op=hvd.Sum)
        gathered = hvd.allgather_async(rows, name="grad")  # same name, another operation: no clash
        out["waiting"] = not hvd.poll(total)  # rank 1 has not issued "grad" yet
        out["duplicate"] = _raises(ValueError, hvd.allreduce_async, x, name="grad")
    hvd.barrier()  # meets rank 1's barrier although rank 0 has operations waiting
    if r == 1:
        gathered = hvd.allgather_async(rows, name="grad")  # the other order than rank 0's
        total = hvd.allreduce_async(x, name="grad", op=hvd.Sum)
        out["duplicate"] = _raises(ValueError, hvd.allgather_async, rows, name="grad")
    out["sum"] = hvd.synchronize(total).tolist()
    out["rows"] = hvd.synchronize(gathered)[:, 0].tolist()
    out["released"] = hvd.synchronize(hvd.allreduce_async(x, name="grad", op=hvd.Max)).tolist()
    # named operations issued in different orders, and of different shapes, still pair up by name
    a, b = torch.ones(3) * (r + 1), torch.ones(5) * (r + 1)
    pair = ["a", "b"] if r == 0 else ["b", "a"]
    handles = {n: hvd.allreduce_async({"a": a, "b": b}[n], name=n, op=hvd.Sum) for n in pair}
    out["pairs"] = [hvd.synchronize(handles[n]).tolist() for n in ("a", "b")]
    grouped = hvd.grouped_allreduce_async([a, b], name="g", op=hvd.Sum)  # each tensor matched by its own name
    out["grouped_waits"] = not hvd.poll(grouped)
    out["grouped"] = [t.tolist() for t in hvd.synchronize(grouped)]
    received, splits = hvd.synchronize(hvd.alltoall_async(torch.arange(3.0) + 10 * r, splits=[1, 2], name="swap"))
    out["alltoall"] = (received.tolist(), splits.tolist())
    lonely = hvd.allreduce_async(x, name=f"only_on_{r}")  # each rank waits for a name the other never issues
    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["lonely"] = _raises(hvd.HorovodInternalError, hvd.synchronize, lonely)
    out["stall_warning"] = [str(w.message) for w in caught]
    mismatched = hvd.broadcast_object if r == 0 else hvd.allgather_object
    out["object_mismatch"] = _raises(hvd.HorovodInternalError, mismatched, {"rank": r})
    out["objects"] = hvd.allgather_object({"rank": r})
    out["loss"] = hvd.allreduce(x, name="loss").tolist()  # synchronous: program order; the name labels the timeline
    if r == 0:
        hvd.stop_timeline()
    return out


def _raises(error, fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
    except error:
        return True
    return False


@BOTH_BACKENDS
def test_named_operations_are_matched_by_name_and_a_duplicate_raises(tmp_path, backend) -> None:
    timeline = tmp_path / "timeline.json"
    first, second = run_ranks(2, _named_operations, str(timeline), backend=backend)
    assert first["waiting"] and first["duplicate"] and second["duplicate"]
    for r, out in enumerate((first, second)):
        assert out["sum"] == [3.0, 3.0] and out["rows"] == [0.0, 1.0, 1.0] and out["released"] == [2.0, 2.0]
        assert out["pairs"] == out["grouped"] == [[3.0] * 3, [3.0] * 5] and out["grouped_waits"]
        assert out["lonely"] and out["object_mismatch"]
        assert len(out["stall_warning"]) == 1 and f"only_on_{r} has waited" in out["stall_warning"][0]
        assert f"rank(s) [{1 - r}]" in out["stall_warning"][0]
        assert out["objects"] == [{"rank": 0}, {"rank": 1}] and out["loss"] == [1.5, 1.5]
    # rank r sends [10r] to rank 0 and [10r+1, 10r+2] to rank 1
    assert first["alltoall"] == ([0.0, 10.0], [1, 1]) and second["alltoall"] == ([1.0, 2.0, 11.0, 12.0], [2, 2])
    events = json.loads(timeline.read_text())  # Horovod's format: one row per operation name
    rows = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    phases = {(e["pid"], e["name"]) for e in events if e["ph"] == "X"}
    assert {(rows["allreduce.grad"], "NEGOTIATE_ALLREDUCE"), (rows["allreduce.grad"], "ALLREDUCE"),
            (rows["allgather.grad"], "ALLGATHER"), (rows["barrier"], "NEGOTIATE_BARRIER"),
            (rows["allreduce.loss"], "NEGOTIATE_ALLREDUCE"), (rows["allreduce.loss"], "ALLREDUCE")} <= phases
    names = {e["name"] for e in events}
    assert {"start_time_since_epoch_in_micros", "CYCLE_START"} <= names

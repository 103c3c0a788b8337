"""The ring all-reduce against torch's all_reduce, and its compressed variants against their bounds."""

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpc.runtime import launch
from parallel.compression.base import ErrorFeedback
from parallel.compression.registry import make_codec
from parallel.ring import ring_allgather, ring_allreduce
from parallel.transport import TorchTransport, make_transport
from tests.nccl_rules import BACKEND
from tests.ranks import run_ranks, run_under_mpirun

SIZES = [0, 1, 3, 7, 1000, 4099]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEGMENT_BYTES = [1 << 20, 100]  # one segment per chunk, and many (pipelined) segments


def _inputs(rank: int, numel: int, dtype: torch.dtype, integer: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    if integer:
        return torch.randint(-50, 50, (numel,), generator=generator).to(dtype)
    return torch.randn(numel, generator=generator).to(dtype)


def compare_with_torch(world, transport_name: str = "torch"):
    """Mismatches between our ring and dist.all_reduce over sizes, dtypes, integer data and averaging."""
    transport = make_transport(transport_name, None)
    mismatches = []
    for numel, segment_bytes in itertools.product(SIZES, SEGMENT_BYTES):
        for dtype in DTYPES:
            for integer in (True, False):
                for average in (False, True):
                    x = _inputs(world.rank, numel, dtype, integer)
                    ours = ring_allreduce(x.clone(), transport, average=average, segment_bytes=segment_bytes)
                    theirs = x.clone()
                    dist.all_reduce(theirs)
                    if average:
                        theirs /= world.size
                    if integer and not average:
                        same = torch.equal(ours, theirs)
                    else:  # both sum in a different order: each of n-1 roundings is <= eps/2 * sum|x|
                        magnitude = x.abs().float()
                        dist.all_reduce(magnitude)
                        tolerance = world.size * torch.finfo(dtype).eps * magnitude + 1e-6
                        same = bool(torch.all((ours.float() - theirs.float()).abs() <= tolerance))
                    if not same:
                        mismatches.append((numel, segment_bytes, str(dtype), integer, average))
    return mismatches


@pytest.mark.parametrize(("n", "backend"), [(1, "gloo"), (2, "gloo"), (3, "gloo"), (4, "gloo"), (2, BACKEND),
                                            (3, BACKEND), (4, BACKEND)])
def test_uncompressed_ring_equals_torch_all_reduce(n, backend) -> None:
    """Also in lockstep under NCCL's rules, the ring's path there: whole chunks, empty ones of short buckets too."""
    assert run_ranks(n, compare_with_torch, backend=backend) == [[]] * n


def _compressed(world, name, numel):
    codec = make_codec(name)
    x = _inputs(world.rank, numel, torch.float32, integer=False) * 3
    error = torch.zeros_like(x)
    result = ring_allreduce(x.clone(), TorchTransport(), codec=codec, error=error, segment_bytes=1000)
    return x.numpy(), result.numpy(), error.numpy()


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8"])
def test_lossy_codecs_stay_within_bound_and_report_their_exact_error(name) -> None:
    n, numel = 4, 5000
    outputs = run_ranks(n, _compressed, name, numel)
    inputs = np.stack([o[0] for o in outputs])
    exact = inputs.sum(axis=0, dtype=np.float64)
    results = np.stack([o[1] for o in outputs])
    # Every rank ends with identical values.
    assert all(np.array_equal(results[0], r) for r in results)
    # Bound: n encodes per element, each at most the codec's bound on a partial sum,
    # and every partial sum is bounded elementwise by sum(|x_i|).
    codec = make_codec(name)
    magnitude = torch.from_numpy(np.abs(inputs).sum(axis=0).astype(np.float32))
    if name == "int8":  # the block scale comes from the block's largest partial sum
        block = codec.block
        padded = torch.nn.functional.pad(magnitude, (0, (-numel) % block)).view(-1, block)
        magnitude = padded.amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)[:numel]
    bound = n * codec.error_bound(magnitude).numpy()
    assert np.all(np.abs(results[0] - exact) <= bound + 1e-5)
    # The errors the ranks report add up to the exact error of the result.
    reported = np.stack([o[2] for o in outputs]).sum(axis=0, dtype=np.float64)
    np.testing.assert_allclose(reported, exact - results[0], atol=1e-4)


def _running_sums(world, name, steps):
    codec, feedback = make_codec(name), ErrorFeedback()
    generator = torch.Generator().manual_seed(world.rank)
    true_sum = torch.zeros(2000, dtype=torch.float64)
    decoded_sum = {"ef": torch.zeros(2000, dtype=torch.float64), "plain": torch.zeros(2000, dtype=torch.float64)}
    transport = TorchTransport()
    for _ in range(steps):
        g = torch.randn(2000, generator=generator) * 0.01 + 0.003  # small gradients with a bias
        exact = g.clone()
        dist.all_reduce(exact)
        true_sum += exact.double()
        with_ef = g.clone()
        feedback.compensate("g", with_ef)
        error = torch.zeros_like(with_ef)
        ring_allreduce(with_ef, transport, codec=codec, error=error)
        feedback.store("g", error)
        decoded_sum["ef"] += with_ef.double()
        decoded_sum["plain"] += ring_allreduce(g.clone(), transport, codec=codec).double()
    return {k: (v - true_sum).abs().max().item() for k, v in decoded_sum.items()}


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_error_feedback_keeps_the_running_sum_on_track(name) -> None:
    drift = run_ranks(3, _running_sums, name, 240)[0]
    one_step_bound = 3 * make_codec(name).error_bound(torch.tensor([3 * 0.05])).item()
    assert drift["ef"] <= 2 * one_step_bound  # bounded, does not grow with the number of steps
    assert drift["ef"] < drift["plain"] / 3


def _mpi_report(world) -> dict:
    return {"rank": world.rank, "launcher": world.info.launcher.value, "rendezvous": world.rendezvous.source,
            "mismatches": compare_with_torch(world, "mpi")}


@pytest.mark.slow
@pytest.mark.skipif(not launch.has_open_mpi(), reason="Open MPI is not installed")
def test_mpi_transport_under_mpirun_equals_torch_all_reduce() -> None:
    reports = run_under_mpirun(3, _mpi_report)
    assert sorted(r["rank"] for r in reports) == [0, 1, 2]
    for report in reports:
        assert report == {**report, "launcher": "openmpi", "rendezvous": "mpi", "mismatches": []}


class _OneWorkForTheBatch:
    """What ``batch_isend_irecv`` gives on a backend that coalesces (NCCL): one Work for the whole batch, which
    may be waited for again once done (a Gloo send's Work may not)."""

    def __init__(self, works) -> None:
        self.works = works

    def wait(self, *args) -> bool:
        while self.works:
            self.works.pop().wait()
        return True


def _coalesced(world, numel: int):
    """The lockstep ring (NCCL's way) and the ring all-gather over Gloo, each batch answered by one Work as NCCL
    answers; and torch's all-reduce and all-gather of the same tensors."""
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_OneWorkForTheBatch(batch(ops))]
    TorchTransport.in_lockstep = lambda self, device: True
    x = _inputs(world.rank, numel, torch.float32, integer=False)
    ours = ring_allreduce(x.clone(), TorchTransport()), ring_allgather(x, TorchTransport())
    dist.batch_isend_irecv = batch
    summed, gathered = x.clone(), [torch.empty_like(x) for _ in range(world.size)]
    dist.all_reduce(summed)
    dist.all_gather(gathered, x)
    return [t.numpy() for t in ours], (summed.numpy(), torch.stack(gathered).numpy())


@pytest.mark.parametrize("n", [2, 3])
def test_a_backend_that_answers_a_batch_with_one_work_runs_the_ring(n) -> None:
    """NCCL coalesces a batch of sends and receives into one Work: the transport gives every message that one
    to wait for (it raised at the first batch of two before)."""
    for (ours_sum, ours_gathered), (summed, gathered) in run_ranks(n, _coalesced, 4099):
        np.testing.assert_allclose(ours_sum, summed, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(ours_gathered, gathered)

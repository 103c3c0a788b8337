"""Host staging, checked without a GPU: a transport made to stage every tensor (the path Gloo's point-to-point
takes with CUDA tensors: sends from a host copy, receives into a host buffer copied over when waited for)
must move exactly what the direct transport moves: the ring with a codec, and a pipeline step."""

from __future__ import annotations

import pytest
import torch

from hpc.runtime.placement import StagedReceive, StagedSend, host_staging_buffer, out_of_memory
from parallel.transport import TorchTransport
from tests.ranks import run_ranks, run_under_mpirun


class StagedEverywhere(TorchTransport):
    """The CUDA-less stand-in: every tensor takes the staged path, as a CUDA tensor over Gloo would."""

    def _stages(self, tensor: torch.Tensor) -> bool:
        return True


def _ring_both_ways(world):
    from parallel.compression.int8 import Int8Codec
    from parallel.ring import ring_allreduce

    results = []
    for transport in (TorchTransport(None), StagedEverywhere(None)):
        flat = torch.arange(1000, dtype=torch.float32) * (world.rank + 1) / 7
        ring_allreduce(flat, transport, codec=Int8Codec(), average=True)
        posted = transport.post([])  # nothing to post is nothing to wait for
        results.append((flat.numpy().copy(), posted))
    return results


def test_the_ring_through_host_staging_equals_the_direct_ring() -> None:
    for (direct, _), (staged, posted) in run_ranks(3, _ring_both_ways, timeout=60):
        assert posted == []
        assert (direct == staged).all()


def _messages(world):
    transport = StagedEverywhere(None)
    peer = 1 - world.rank
    outgoing = torch.full((4, 3), float(world.rank + 1))
    incoming = torch.zeros(4, 3)
    pending = transport.post([_op(True, outgoing, peer), _op(False, incoming, peer)])
    kinds = [type(p).__name__ for p in pending]
    for p in pending:
        p.wait()
    return kinds, incoming.tolist()


def _op(is_send, tensor, peer):
    from parallel.transport import PointToPoint

    return PointToPoint(is_send, tensor, peer, tag=3)


def test_staged_messages_land_in_the_callers_tensor_when_waited_for() -> None:
    for rank, (kinds, received) in enumerate(run_ranks(2, _messages, timeout=60)):
        assert kinds == ["StagedSend", "StagedReceive"]
        assert received == [[float(2 - rank)] * 3] * 4  # the peer's value, copied from the host buffer


def test_a_staging_buffer_is_pinned_only_for_gpu_tensors_and_a_receive_copies_on_wait() -> None:
    like = torch.ones(5, dtype=torch.float16)
    buffer = host_staging_buffer(like)
    assert buffer.shape == like.shape and buffer.dtype == like.dtype and not buffer.is_pinned()

    class Done:
        def wait(self):
            return "waited"

    target, host = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    receive = StagedReceive(Done(), host, target)
    assert target.tolist() == [0.0, 0.0, 0.0]  # nothing copied before the wait
    assert receive.wait() == "waited" and target.tolist() == [1.0, 2.0, 3.0]
    assert StagedSend(Done(), host).wait() == "waited"


def test_out_of_memory_is_one_line_naming_rank_host_device_and_what_to_try() -> None:
    line = out_of_memory(torch.device("cpu"), 3, "node7")
    assert "\n" not in line
    for part in ("rank 3", "node7", "cpu", "activation_checkpointing", "parallel.zero", "parallel.pp"):
        assert part in line


@pytest.mark.parametrize(("requested", "backend", "error"), [
    ("cuda", "auto", "parallel.device='cuda' needs CUDA"),
    ("cpu", "nccl", "parallel.backend='nccl' needs parallel.device='cuda'"),
])
def test_device_and_backend_mistakes_are_one_line(requested, backend, error) -> None:
    from hpc.errors import LaunchEnvError
    from hpc.runtime.bootstrap import select_backend

    if torch.cuda.is_available() and requested == "cuda":
        pytest.skip("a GPU is visible")
    with pytest.raises(LaunchEnvError, match=error.replace("(", r"\(").replace(")", r"\)")):
        select_backend(backend, requested)


def _mpi_staged_messages(world):
    from parallel.transport import MpiTransport, PointToPoint, mpi_carries_cuda

    class StagedMpi(MpiTransport):
        def _stages(self, tensor: torch.Tensor) -> bool:
            return True

    transport, peer = StagedMpi(None), 1 - world.rank
    received = [torch.zeros(3), torch.zeros(3)]
    pending = transport.post([  # tag 3 carries 10 r + 1, tag 4 carries 10 r
        PointToPoint(False, received[1], peer, 3), PointToPoint(True, torch.full((3,), 10.0 * world.rank + 1), peer, 3),
        PointToPoint(False, received[0], peer, 4), PointToPoint(True, torch.full((3,), 10.0 * world.rank), peer, 4),
    ])
    for p in pending:
        p.wait()
    return [type(p).__name__ for p in pending], [r.tolist() for r in received], isinstance(mpi_carries_cuda(), bool)


@pytest.mark.slow
def test_the_mpi_transport_stages_through_host_buffers_where_mpi_is_not_cuda_aware() -> None:
    """Tags keep the two messages apart; each lands in the caller's tensor when waited for."""
    for rank, (kinds, received, asked) in enumerate(run_under_mpirun(2, _mpi_staged_messages, timeout=120)):
        assert kinds == ["StagedReceive", "StagedSend", "StagedReceive", "StagedSend"] and asked
        other = 1 - rank
        assert received == [[10.0 * other] * 3, [10.0 * other + 1] * 3]

"""Where tensors live: the rank's device, and the one sanctioned way through host memory.

Every module allocates on the device of the tensors it is given or of the mesh
(``Mesh.device``); the host copies below are the only exceptions, named so that
``tests/test_placement.py`` can tell them from a stray CPU allocation. They exist
because some carriers take host memory only: Gloo's send/recv (its collectives
stage CUDA tensors themselves), and an MPI library that is not CUDA-aware. A
staged send copies the tensor to pinned memory (the copy waits for the kernels
that produced it); a staged receive lands in pinned memory and is copied to the
device when waited for. Pinned blocks come from torch's caching host allocator,
so a message size seen before costs no new page locking.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


class Pending(Protocol):
    def wait(self) -> object: ...


def host_staging_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host buffer shaped like ``like``: pinned when ``like`` is on a GPU (fast, asynchronous copies)."""
    import torch

    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


def staged_copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in a host buffer: itself when already there, else a pinned copy, complete on return."""
    if not tensor.is_cuda:
        return tensor
    host = host_staging_buffer(tensor)
    host.copy_(tensor)
    return host


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) onto ``device``. To a GPU through pinned memory, so the copy is queued behind
    whatever the GPU is doing and the host goes on (from pageable memory it would wait for the GPU to drain)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_numbers_to(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Numbers the host knows (split sizes), as a tensor on ``device`` (``to_device``)."""
    import torch

    return to_device(torch.tensor(values, dtype=dtype), device)


def queued_copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """``tensor`` copied into a pinned host buffer behind the work already queued on its stream, and an event
    that passes once the copy is done; the host goes on meanwhile (a training step's numbers, read while
    the next step runs). The event is timed: two of them give the device's time between them. On the host
    already: the tensor itself and None."""
    if not tensor.is_cuda:
        return tensor, None
    import torch

    host = host_staging_buffer(tensor)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event(enable_timing=True)
    done.record(torch.cuda.current_stream(tensor.device))
    return host, done


def carries_cuda(group: ProcessGroup | None) -> bool:
    """Whether the group's backend moves CUDA tensors point to point itself (NCCL, and backends named after it
    that keep its rules, as tests/nccl_rules.py's on the CPU); Gloo does not."""
    import torch

    return moves_with_nccl(group, torch.device("cuda"))


def moves_with_nccl(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether the backend that carries ``device``'s tensors in ``group`` is NCCL (or keeps its rules): a GPU job's
    groups are ``cpu:gloo,cuda:nccl``, so its host tensors go through Gloo; tests/nccl_rules.py's backend
    carries every device's, so on the CPU the code takes the paths NCCL's tensors take on a GPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        backend = dict(part.split(":", 1) for part in backend.split(",")).get(device.type, "")
    return "nccl" in backend


@dataclass
class StagedSend:
    """A send of a host copy; the copy is kept alive until the send completes."""

    pending: Pending
    host: torch.Tensor

    def wait(self) -> object:
        return self.pending.wait()


@dataclass
class StagedReceive:
    """A receive into a host buffer, copied to ``target`` (on the device) when waited for."""

    pending: Pending
    host: torch.Tensor
    target: torch.Tensor

    def wait(self) -> object:
        result = self.pending.wait()
        self.target.copy_(self.host, non_blocking=True)  # ordered before any later use on this stream
        return result


class CommStream:
    """Orders a communication thread against compute on a GPU (nothing to do on the CPU).

    ``ready()`` records an event on the producer's current stream once a message's inputs are queued (a
    bucket's last gradient); ``after(event)`` runs the communication on a stream of its own that waits for
    that event first, so it overlaps the rest of backward yet never reads a gradient before it exists;
    ``join()`` makes the consumer's stream (the optimizer step) wait for everything communicated, ``join(event)``
    for what came before an event recorded inside ``after`` (one ZeRO-3 gather). Tensors
    the communication allocates belong to its stream's pool and are not reused before ``join``'s wait."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def ready(self) -> object | None:
        import torch

        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        return event

    @contextlib.contextmanager
    def after(self, event: object | None) -> Iterator[None]:
        import torch

        if self.stream is None:
            yield
            return
        if event is not None:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            yield

    def release(self, tensor: torch.Tensor) -> None:
        """Before dropping ``tensor`` (made on another stream) inside ``after``, while this stream's queued work
        still reads or writes it: its memory goes back to the caching allocator only once that work is done.
        Without this the allocator hands it to the compute stream at once (a ZeRO-2 rank drops the gradients it
        does not own as soon as their reduce-scatter is queued, while backward still runs)."""
        import torch

        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))

    def join(self, event: object | None = None) -> None:
        """The consumer's stream waits for everything communicated so far, or, given an event ``ready()``
        recorded inside ``after``, for the communication up to that event only."""
        import torch

        if self.stream is None:
            return
        consumer = torch.cuda.current_stream(self.stream.device)
        if event is None:
            consumer.wait_stream(self.stream)
        else:
            consumer.wait_event(event)


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (each thread starts on GPU 0); nothing on a CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)


def out_of_memory(device: torch.device, rank: int, host: str) -> str:
    """One line for a rank that ran out of device memory: where, what the allocator held, what to try."""
    import torch

    held = ""
    if device.type == "cuda":
        gib = 2.0**30
        held = (f": {torch.cuda.memory_allocated(device) / gib:.1f} GiB allocated, "
                f"{torch.cuda.memory_reserved(device) / gib:.1f} GiB reserved of "
                f"{torch.cuda.get_device_properties(device).total_memory / gib:.1f} GiB")
    return (f"rank {rank} on {host} ran out of memory on {device}{held}; try train.activation_checkpointing = true, "
            "fewer tokens per microbatch (more parallel.microbatches or a smaller data.batch_size), "
            "parallel.zero = 1-3, or more pipeline stages (parallel.pp)")

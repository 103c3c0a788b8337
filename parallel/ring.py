"""Ring all-reduce over point-to-point messages, with compression inside the ring.

We write the ring ourselves (instead of calling ``all_reduce``) because a library
all-reduce can only sum what it is given: to compress gradients to int8 it must
fall back to all-gather. Owning each hop lets a codec decode, add and re-encode
(see ``parallel.compression``).

Algorithm: the flat buffer is cut into n chunks. Reduce-scatter: n-1 steps, each
rank sends one chunk to its right neighbour and adds the chunk from its left; after
it, rank r holds the full sum of chunk r+1. All-gather: n-1 steps forwarding the
finished chunks. Each rank sends 2(n-1)/n of the buffer, the bandwidth optimum.
ZeRO stage 2 runs the reduce-scatter phase alone (``ring_reduce_scatter``): each rank
wants the sum of its own chunk only, for (n-1)/n of the buffer.
The receive of step s+1 is posted before step s's chunk is reduced, so the network
works while the CPU adds.

NCCL moves messages in lockstep (``Transport.in_lockstep``): each batch of sends and receives is one
kernel on the group's one stream, finished only when every message in it met its match, and the next
batch starts after it. Receives posted ahead of this rank's sends, as the pipelined ring posts them,
would then wait for each other all around the ring. Over NCCL the ring posts each transfer's send and
receive as one batch, whole chunks (``_Ring.run_in_lockstep``): the same bytes in the same order, the same
roundings (segments are whole codec blocks, and a codec rounds a block alike wherever it is cut), and
a few large kernels and messages, which the host only queues on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hpc.runtime.placement import Pending
from parallel.compression.base import Codec
from parallel.transport import PointToPoint, Transport

IDENTITY = Codec()


def ring_allgather(payload: torch.Tensor, transport: Transport, out: torch.Tensor | None = None,
                   shift: int = 0) -> torch.Tensor:
    """Every rank's equal-sized 1-D ``payload``, stacked in rank order (rank r's in row (r + shift) % n: the
    reduce-scatter leaves rank r chunk r + 1): n-1 forwarding steps. ``out`` (``[n, payload.numel()]``,
    contiguous) receives them in place (ZeRO-3 gathers into a bucket's buffer); ``payload`` may be its own row."""
    n, rank = dist.get_world_size(transport.group), dist.get_rank(transport.group)
    gathered = payload.new_empty((n, payload.numel())) if out is None else out
    row = (rank + shift) % n
    if gathered[row].data_ptr() != payload.data_ptr():
        gathered[row] = payload
    if n == 1 or payload.numel() == 0:
        return gathered
    left, right = (rank - 1) % n, (rank + 1) % n
    for step in range(n - 1):  # each step's receive and send in one batch: NCCL runs them together
        _wait(transport.post([PointToPoint(False, gathered[(row - step - 1) % n], left),
                              PointToPoint(True, gathered[(row - step) % n], right)]))
    return gathered


SEGMENT_BYTES = 1 << 20
RECV_WINDOW = 4


def ring_allreduce(
    flat: torch.Tensor,
    transport: Transport,
    *,
    codec: Codec = IDENTITY,
    average: bool = False,
    error: torch.Tensor | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """Sum (or average) a contiguous 1-D tensor across the group, in place; returns it.

    ``error``, if given (same shape, zeroed by the caller), receives the error this
    rank's encodes introduced; summed over ranks it is the exact error of the result.
    """
    n, rank = dist.get_world_size(transport.group), dist.get_rank(transport.group)
    if n == 1 or flat.numel() == 0:
        return flat
    if transport.in_lockstep(flat.device):
        _Ring(flat, transport, codec, error, flat.nbytes).run_in_lockstep(n, rank, gather=True)
    else:
        _Ring(flat, transport, codec, error, segment_bytes).run(n, rank)
    if average:
        flat.div_(n)
    return flat


def ring_reduce_scatter(flat: torch.Tensor, transport: Transport, *, codec: Codec = IDENTITY, average: bool = False,
                        error: torch.Tensor | None = None, segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """The all-reduce's first phase alone (ZeRO stage 2): returns chunk (rank + 1) % n of
    ``flat.tensor_split(n)``, a view holding the group's full sum (or mean) of it.

    The rest of ``flat`` is left as partial sums. The owner keeps the last hop's sum as
    added, never re-encoded; ``error`` as in ``ring_allreduce``: summed over ranks with
    the owned chunks, it gives back the sum of the inputs.
    """
    n, rank = dist.get_world_size(transport.group), dist.get_rank(transport.group)
    owned = flat.tensor_split(n)[(rank + 1) % n]
    if n == 1 or flat.numel() == 0:
        return owned
    if transport.in_lockstep(flat.device):
        _Ring(flat, transport, codec, error, flat.nbytes).run_in_lockstep(n, rank, gather=False)
        return owned.div_(n) if average else owned
    ring = _Ring(flat, transport, codec, error, segment_bytes)
    scatter_order = [(rank - t - 1) % n for t in range(n - 1)]
    _wait(ring.reduce_scatter(n, rank, ring._receives((rank - 1) % n, scatter_order, in_place=False), False))
    _wait(ring.sends)
    if average:
        owned.div_(n)
    return owned


class _Ring:
    """One all-reduce's state: chunks cut into segments that move through the ring one by one.

    Segments pipeline the ring: a rank forwards segment k of a chunk as soon as it
    has reduced it, while segment k+1 is still on the wire, so a step costs about
    max(transfer, reduce) instead of their sum. Receives are posted ``RECV_WINDOW``
    segments ahead in exactly the order the left neighbour sends them.
    """

    def __init__(self, flat: torch.Tensor, transport: Transport, codec: Codec, error, segment_bytes: int):
        self.transport, self.codec = transport, codec
        n = dist.get_world_size(transport.group)
        per_segment = max(1, segment_bytes // flat.element_size())
        self.segments = [list(chunk.split(per_segment)) for chunk in flat.tensor_split(n)]
        self.errors = None
        if error is not None and codec.lossy:
            self.errors = [list(chunk.split(per_segment)) for chunk in error.tensor_split(n)]
        self.sends: list[Pending] = []

    def run(self, n: int, rank: int) -> None:
        left, right = (rank - 1) % n, (rank + 1) % n
        # Reduce-scatter: transfer t sends chunk rank-t and receives chunk rank-t-1, which
        # this rank adds its share to and sends on at t+1. At the last transfer the chunk
        # received is the one this rank owns (rank+1): each of its segments is final once
        # reduced. A lossy codec sends it at once as the all-gather's first transfer, so its
        # final encode overlaps the phase (int8 on the 1 Gbit/s testbed: 173-207 ms became
        # 154-164); uncompressed, there is nothing to overlap, and starting early measured
        # slower (587 against 565-573 ms), so it starts after the phase as before.
        owned, early_gather = (rank + 1) % n, self.codec.lossy
        scatter_order = [(rank - t - 1) % n for t in range(n - 1)]
        gather_order = [(rank - t) % n for t in range(n - 1)]
        # Lossy payloads land in buffers of their own, so the all-gather's receives can be
        # posted while the reduce-scatter runs: the left neighbour's early segments then
        # find a receive waiting rather than a notice queued behind data on the return link.
        receives = self._receives(left, scatter_order + gather_order if early_gather else scatter_order, in_place=False)
        _wait(self.reduce_scatter(n, rank, receives, early_gather))  # they read chunks the all-gather overwrites
        # All-gather: finished segments are forwarded unchanged, so every rank decodes the
        # same bytes. Uncompressed ones are received straight into place, now that no send reads them.
        if not early_gather:
            receives = self._receives(left, gather_order, in_place=True)
            for k in range(len(self.segments[owned])):
                self._send(self._encode(owned, k, final=True), right)
        for t in range(n - 1):
            for segment in self.segments[(rank - t) % n]:
                payload = next(receives)
                if t < n - 2:
                    self._send(payload, right)
                if early_gather:
                    self.codec.decode_into(payload, segment)
        _wait(self.sends)

    def run_in_lockstep(self, n: int, rank: int, gather: bool) -> None:
        """``run``'s transfers, each send posted in one batch with the receive of the same transfer (NCCL);
        without ``gather``, the reduce-scatter alone, the owned chunk's sum kept as added."""
        left, right = (rank - 1) % n, (rank + 1) % n
        outgoing = [self._encode(rank, k) for k in range(len(self.segments[rank]))]
        for t in range(n - 1):  # reduce-scatter, as in run: add chunk rank-t-1, send it on
            index, last = (rank - t - 1) % n, t == n - 2
            received = self._exchange(outgoing, [self.codec.empty_payload(s) for s in self.segments[index]],
                                      left, right)
            outgoing = []
            for k, (payload, segment) in enumerate(zip(received, self.segments[index], strict=True)):
                self.codec.add_decoded(payload, segment)
                if not last or gather:  # the owned chunk's last encode is the all-gather's first transfer
                    outgoing.append(self._encode(index, k, final=last))
        if not gather:
            return
        for t in range(n - 1):  # all-gather: finished chunks forwarded unchanged, decoded where lossy
            segments = self.segments[(rank - t) % n]
            into = [self.codec.empty_payload(s) for s in segments] if self.codec.lossy else segments
            outgoing = self._exchange(outgoing, into, left, right)  # t=0: the owned chunk
            if self.codec.lossy:
                for payload, segment in zip(outgoing, segments, strict=True):
                    self.codec.decode_into(payload, segment)

    def _exchange(self, sends: list[torch.Tensor], receives: list[torch.Tensor], left: int,
                  right: int) -> list[torch.Tensor]:
        """One transfer: ``sends`` to the right and ``receives`` from the left as one batch; returns ``receives``
        once they are filled (over NCCL: once the device's stream has them)."""
        _wait(self.transport.post([*(PointToPoint(True, payload, right) for payload in sends),
                                   *(PointToPoint(False, buffer, left) for buffer in receives)]))
        return receives

    def reduce_scatter(self, n: int, rank: int, receives: Iterator[torch.Tensor], send_final: bool) -> list[Pending]:
        """The n-1 reduce-scatter transfers; ``send_final`` also sends the owned chunk on as it is finished
        (encoded once more). Returns the sends of the phase proper, still in flight."""
        right = (rank + 1) % n
        for k in range(len(self.segments[rank])):
            self._send(self._encode(rank, k), right)
        reduce_scatter_sends: list[Pending] = []
        for t in range(n - 1):
            index = (rank - t - 1) % n
            last = t == n - 2
            if last:
                reduce_scatter_sends, self.sends = self.sends, []
            for k, segment in enumerate(self.segments[index]):
                self.codec.add_decoded(next(receives), segment)
                if not last or send_final:
                    self._send(self._encode(index, k, final=last), right)
        return reduce_scatter_sends

    def _receives(self, left: int, chunk_order: list[int], in_place: bool) -> Iterator[torch.Tensor]:
        """Post the first ``RECV_WINDOW`` receives now (before this rank spends time encoding, so the
        left neighbour can start sending at once), then yield payloads in order, keeping the window full."""
        expected = iter([segment for index in chunk_order for segment in self.segments[index]])
        posted: deque[tuple[torch.Tensor, Pending]] = deque()

        def post_next() -> None:
            segment = next(expected, None)
            if segment is not None:
                buffer = segment if in_place else self.codec.empty_payload(segment)
                posted.append((buffer, self.transport.recv(buffer, left)))

        for _ in range(RECV_WINDOW):
            post_next()

        def in_order() -> Iterator[torch.Tensor]:
            while posted:
                buffer, pending = posted.popleft()
                pending.wait()
                post_next()
                yield buffer

        return in_order()

    def _encode(self, index: int, k: int, final: bool = False) -> torch.Tensor:
        return encode_segment(self.codec, self.segments[index][k],
                              None if self.errors is None else self.errors[index][k], final)

    def _send(self, payload: torch.Tensor, right: int) -> None:
        self.sends.append(self.transport.send(payload, right))


def encode_segment(codec: Codec, segment: torch.Tensor, error: torch.Tensor | None, final: bool) -> torch.Tensor:
    """A hop's payload of ``segment``; a lossy codec adds what it lost to ``error`` (when kept), and a ``final``
    encode leaves the owner exactly what the others decode. ``hpc plan --calibrate`` times it too."""
    if error is not None and codec.lossy:
        return codec.encode_keeping_error(segment, error, final)
    payload = codec.encode(segment)
    if final and codec.lossy:  # decoding costs as much as encoding: only when needed
        codec.decode_into(payload, segment)  # the owner keeps exactly what the others decode
    return payload


def _wait(sends: list[Pending]) -> None:
    for pending in sends:
        pending.wait()
    sends.clear()

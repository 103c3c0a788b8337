"""Top-k sparsification: its exact fast selection, its all-gather reduction, its momentum correction.

Sparse vectors with different supports cannot be summed hop by hop, so top-k is the
one codec that leaves the ring for an all-gather; and because error feedback lets a
coordinate's delayed mass arrive in bursts that heavy-ball momentum amplifies, it
also moves SGD's momentum in front of the reduction (Deep Gradient Compression).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from parallel.compression.base import MomentumCorrection, WithErrorFeedback, flatten, unflatten_into
from parallel.compression.wire import topk_ratio
from parallel.ring import ring_allgather
from parallel.transport import Transport

NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
SCAN_BLOCK = 1 << 17  # entries per block of top-k's CPU scan: its magnitudes and mask stay in L2


class TopK:
    """Keep the ``fraction`` of entries largest in magnitude; send (int32 index, value) pairs.

    Sparse vectors with different supports cannot be summed hop by hop, so top-k
    payloads are all-gathered (see ``TopKReducer``). Wire ratio per rank: 2 *
    fraction for float32 (index and value). Error: exactly the entries not sent,
    each no larger in magnitude than the smallest entry sent.
    """

    name = "topk"
    lossy = True

    def __init__(self, fraction: float = 0.01):
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self._scratch: dict[str, torch.Tensor] = {}

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def wire_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        return topk_ratio(self.fraction, dtype.itemsize)

    def top_indices(self, flat: torch.Tensor, plus: torch.Tensor | None = None) -> torch.Tensor:
        """The k entries of ``flat`` largest in magnitude: exactly the set torch.topk picks, found faster.

        With ``plus``, of ``flat + plus``, added into ``flat`` during the same pass (error
        feedback's residual update costs no trip of its own through memory). A strided
        sample estimates a threshold a little below the k-th largest magnitude; one pass
        keeps the candidates above it, and topk runs on those only (Deep Gradient
        Compression's sampling, made exact). If the estimate was too high the exact topk
        over everything runs instead. On CUDA torch's topk runs at once: the candidates'
        count (``nonzero``) and the check of it would stop the host for the device at
        every tensor, and the selection is the same set.
        """
        n, k = flat.numel(), self.k(flat.numel())
        if flat.is_cuda or n < 1 << 16 or 8 * k > n:
            return self._exact(flat, plus, k)
        stride = max(1, n // max(8192, 200 * n // k))
        sample = (flat[::stride] if plus is None else flat[::stride] + plus[::stride]).abs()
        threshold = sample.topk(max(1, math.ceil(1.5 * k * sample.numel() / n)), sorted=False).values.min()
        candidates = self._at_least(flat, plus, threshold)
        if candidates.numel() < k:
            return self._exact(flat, None, k)
        return candidates.index_select(0, flat.index_select(0, candidates).abs_().topk(k, sorted=False).indices)

    def _exact(self, flat: torch.Tensor, plus: torch.Tensor | None, k: int) -> torch.Tensor:
        if plus is not None:
            flat.add_(plus)
        return torch.abs(flat, out=self._buffer("magnitude", n=flat.numel(), like=flat)).topk(k, sorted=False).indices

    def _at_least(self, flat: torch.Tensor, plus: torch.Tensor | None, threshold: torch.Tensor) -> torch.Tensor:
        """Indices where ``|flat (+= plus)| >= threshold``, ascending.

        On CPU numpy scans in blocks that stay in cache: one trip through memory for
        the add, the magnitude and the comparison, and numpy's scan is 3-4x faster than
        torch's nonzero (16M entries, residual update and selection: 22 ms against 33 ms
        as whole-tensor passes).
        """
        if flat.device.type != "cpu" or flat.dtype not in NUMPY_FLOATS:  # no bf16 in numpy; GPUs allocate cheaply
            if plus is not None:
                flat.add_(plus)
            return (flat.abs() >= threshold).nonzero().squeeze(1)
        values, extra = flat.numpy(), None if plus is None else plus.numpy()
        magnitude = self._buffer("magnitude", n=SCAN_BLOCK, like=flat).numpy()
        above = self._buffer("above", n=SCAN_BLOCK, like=flat, dtype=torch.bool).numpy()
        limit = threshold.numpy()
        found = []
        for start in range(0, values.size, SCAN_BLOCK):
            block = values[start : start + SCAN_BLOCK]
            if extra is not None:
                np.add(block, extra[start : start + SCAN_BLOCK], out=block)
            size = block.size
            np.abs(block, out=magnitude[:size])
            np.greater_equal(magnitude[:size], limit, out=above[:size])
            found.append(np.flatnonzero(above[:size]) + start)
        return torch.from_numpy(np.concatenate(found))

    def _buffer(self, name: str, *, n: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer kept between calls: a fresh 64 MiB one costs ~30 ms of page faults, half the selection."""
        dtype = dtype or like.dtype
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < n or buffer.dtype != dtype or buffer.device != like.device:
            self._scratch[name] = buffer = torch.empty(n, dtype=dtype, device=like.device)
        return buffer[:n]

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return self.pack(flat, self.top_indices(flat))

    def pack(self, flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """One uint8 payload: k int32 indices, then their k values in ``flat``'s dtype."""
        return torch.cat([indices.to(torch.int32).view(torch.uint8), flat.index_select(0, indices).view(torch.uint8)])

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        k = self.k(into.numel())
        indices = payload[: 4 * k].view(torch.int32).long()
        into.index_add_(0, indices, payload[4 * k :].view(into.dtype))
        return into

    def error_bound(self, flat: torch.Tensor) -> torch.Tensor:
        kth_largest = flat.abs().topk(self.k(flat.numel())).values[-1]
        return torch.full_like(flat, kth_largest.item())


class TopKReducer(WithErrorFeedback):
    """Each rank sends the k largest compensated entries of every tensor; all ranks sum them in rank order.

    Selection is per tensor (k proportional to its size), not over the whole bucket:
    otherwise the layers with the largest gradients take every slot and the others
    only move once their residual has grown large (the layer-wise rule of Deep
    Gradient Compression). One all-gather carries the whole bucket.
    """

    name = "topk"

    def __init__(self, fraction: float = 0.01):
        super().__init__()
        self.codec = TopK(fraction)

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        # In place, in buffers that persist across steps: on a 64 MiB gradient each fresh
        # allocation costs ~30 ms of page faults, more than the selection itself.
        payloads = []
        for i, tensor in enumerate(tensors):
            gradient = tensor.reshape(-1)
            compensated = self.feedback.residual(f"{key}/{i}", gradient)
            indices = self.codec.top_indices(compensated, plus=gradient)
            payloads.append(self.codec.pack(compensated, indices))
            compensated.index_fill_(0, indices, 0)  # what was not sent stays behind as the next step's residual
        gathered = ring_allgather(torch.cat(payloads), transport)
        n = gathered.shape[0]
        per_tensor = gathered.split([p.numel() for p in payloads], dim=1)
        for tensor, rows in zip(tensors, per_tensor, strict=True):
            flat = flatten([tensor])
            flat.zero_()
            for row in rows:  # the same order on every rank: identical sums
                if average:  # the k values, not the whole tensor: a pass over 64 MiB costs ~3 ms
                    row[4 * self.codec.k(flat.numel()) :].view(flat.dtype).div_(n)
                self.codec.add_decoded(row, flat)
            unflatten_into(flat, [tensor])
        return (n - 1) * gathered.shape[1]

    def momentum_correction(self, optimizer: torch.optim.Optimizer) -> MomentumCorrection | None:
        return MomentumCorrection.take_from(optimizer)

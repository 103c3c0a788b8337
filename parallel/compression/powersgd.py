"""PowerSGD: each gradient matrix as a rank-r product P Q^T, found by one warm-started power iteration.

With one Q shared by all ranks, P = M Q is linear in M, so the ranks' P's (and then
their Q's) sum exactly in two uncompressed ring all-reduces per bucket, unlike
top-k's sparse vectors. The reducer keeps each matrix's Q between steps as the warm
start, state a resumed run needs.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from parallel.compression.base import WithErrorFeedback, flatten, ring_bytes, unflatten_into
from parallel.compression.wire import powersgd_compresses, powersgd_ratio
from parallel.ring import IDENTITY, ring_allreduce
from parallel.transport import Transport


class PowerSGD:
    """Rank-``rank`` approximation M ~ P Q^T by one power iteration per step, warm-started.

    Vogels et al. 2019: P = M Q, orthonormalize P, Q = M^T P. Since P has orthonormal
    columns, P Q^T = P P^T M is the projection of M onto span(P), so the error never
    exceeds ||M||_F; error feedback returns it, and a warm start lets the power
    iteration converge over steps. Wire ratio: rank * (rows + cols) / (rows * cols).
    Tensors that are vectors, or too small to gain, are sent uncompressed.
    """

    name = "powersgd"
    lossy = True

    def __init__(self, rank: int = 4):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = rank

    @staticmethod
    def matrix(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(tensor.shape[0], -1)

    def compresses(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        return powersgd_compresses(self.rank, shape[0], math.prod(shape[1:]))

    def wire_ratio_for(self, shape: torch.Size) -> float:
        return powersgd_ratio(self.rank, shape[0], math.prod(shape[1:])) if len(shape) >= 2 else 1.0

    def initial_q(self, shape: torch.Size, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The same Q on every rank: a seeded Gaussian, as the power iteration's start.

        Drawn on the CPU whatever ``device`` (the same values on every device), then moved
        there once: the first step's only host-to-device copy, none after it.
        """
        cols = math.prod(shape[1:])
        return torch.randn(cols, self.rank, generator=torch.Generator().manual_seed(seed)).to(device)

    @staticmethod
    def orthonormalize(p: torch.Tensor) -> torch.Tensor:
        return torch.linalg.qr(p).Q

    def error_bound(self, matrix: torch.Tensor) -> float:
        return torch.linalg.matrix_norm(matrix).item()


class PowerSGDReducer(WithErrorFeedback):
    """Matrices as P Q^T (two ring all-reduces per bucket, of all P's then all Q's); vectors exact."""

    name = "powersgd"
    whole_tensors = True

    def __init__(self, rank: int = 4):
        super().__init__()
        self.codec = PowerSGD(rank)
        self.qs: dict[str, torch.Tensor] = {}

    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        n = dist.get_world_size(transport.group)
        low_rank = [i for i, t in enumerate(tensors) if self.codec.compresses(t.shape)]
        exact = [t for i, t in enumerate(tensors) if i not in low_rank]
        sent = 0
        if exact:
            flat = flatten(exact)
            ring_allreduce(flat, transport, average=average)
            unflatten_into(flat, exact)
            sent += ring_bytes(flat.numel() * flat.element_size(), n)
        if not low_rank:
            return sent
        keys = [f"{key}/{i}" for i in low_rank]
        matrices = []
        for name, i in zip(keys, low_rank, strict=True):
            matrix = self.codec.matrix(tensors[i]).clone()
            self.feedback.compensate(name, matrix)
            matrices.append(matrix)
        qs = [self._q(name, m) for name, m in zip(keys, matrices, strict=True)]
        ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
        sent += self._allreduce(ps, transport)
        ps = [self.codec.orthonormalize(p) for p in ps]
        qs = [m.T @ p for m, p in zip(matrices, ps, strict=True)]
        local_qs = [q.clone() for q in qs]
        sent += self._allreduce(qs, transport)
        for name, i, matrix, p, q, local_q in zip(keys, low_rank, matrices, ps, qs, local_qs, strict=True):
            self.feedback.store(name, matrix - p @ local_q.T)
            self.qs[name] = q.clone()  # warm start: the summed Q of this step
            approx = p @ q.T
            tensors[i].copy_((approx / n if average else approx).view_as(tensors[i]))
        return sent

    def _q(self, name: str, matrix: torch.Tensor) -> torch.Tensor:
        """This matrix's warm start, on the matrix's device (a resumed Q is moved there once)."""
        q = self.qs.get(name)
        if q is None:
            q = self.codec.initial_q(matrix.shape, zlib.crc32(name.encode()), matrix.device)
        elif q.device != matrix.device:
            q = q.to(matrix.device)
        self.qs[name] = q
        return q

    @staticmethod
    def _allreduce(matrices: list[torch.Tensor], transport: Transport) -> int:
        flat = flatten(matrices)
        ring_allreduce(flat, transport, codec=IDENTITY)
        unflatten_into(flat, matrices)
        return ring_bytes(flat.numel() * flat.element_size(), dist.get_world_size(transport.group))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"q/{k}": v for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.qs = {k.removeprefix("q/"): v.clone() for k, v in state.items() if k.startswith("q/")}

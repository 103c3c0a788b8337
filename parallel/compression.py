"""Gradient codecs that work *inside* the ring: each hop encodes what it sends.

Horovod compresses only to fp16, and quantized codecs elsewhere fall back to
all-gather because quantized values cannot be summed as they travel. Because we
own the ring, a hop decodes what it receives, adds its own contribution in full
precision, and re-encodes the partial sum for the next hop; in the all-gather the
owner encodes the final chunk once and it is forwarded unchanged, so every rank
decodes identical bytes and ends with identical values.

Each codec states its wire ratio (bytes sent / float32 bytes) and its error bound
per encode; a ring of n ranks encodes each element n times (n-1 partial sums and
the final value), and with error feedback those errors are returned to the next
step rather than lost (see ``ErrorFeedback``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
SCAN_BLOCK = 1 << 17  # entries per block of top-k's CPU scan: its magnitudes and mask stay in L2


class Codec:
    """Identity: send the tensor as it is."""

    name = "none"
    lossy = False

    def wire_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        return 1.0

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk

    def decode(self, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return payload

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """``into += decode(payload)``: what a reduce-scatter hop does; codecs may fuse it."""
        return into.add_(self.decode(payload, into))

    def decode_into(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """``into[:] = decode(payload)``: what an all-gather hop does; codecs may skip the temporary."""
        return into.copy_(self.decode(payload, into))

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(like)

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        """Largest absolute error one encode of ``chunk`` may introduce, per element."""
        return torch.zeros_like(chunk)


class CastCodec(Codec):
    """fp16 or bf16 on the wire: half the bytes of float32, relative error 2^-11 (fp16) or 2^-8 (bf16).

    fp16 overflows above 65504; bf16 keeps float32's range at lower precision.
    """

    lossy = True

    def __init__(self, name: str, wire_dtype: torch.dtype):
        self.name = name
        self.wire_dtype = wire_dtype
        self.unit_roundoff = torch.finfo(wire_dtype).eps / 2

    def wire_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        return self.wire_dtype.itemsize / dtype.itemsize

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk.to(self.wire_dtype)

    def decode(self, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return payload.to(like.dtype)

    # The add and the copy convert as they go: a decoded temporary per 1 MiB segment is a
    # fresh allocation whose page faults cost more than the arithmetic on this VM.
    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        return into.add_(payload)

    def decode_into(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        return into.copy_(payload)

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=self.wire_dtype, device=like.device)

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        tiny = torch.finfo(self.wire_dtype).tiny
        return chunk.abs() * self.unit_roundoff + tiny


class Int8Codec(Codec):
    """Block-wise absmax int8: one float32 scale per block of ``block`` values.

    Wire ratio for float32: (1 + 4/block) / 4 (0.254 for 256). Error per element:
    at most half a quantization step, absmax(block) / 254.
    """

    name = "int8"
    lossy = True

    def __init__(self, block: int = 256):
        self.block = block

    def wire_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        return (1 + 4 / self.block) / dtype.itemsize

    def _blocks(self, chunk: torch.Tensor) -> torch.Tensor:
        """A (blocks, block) float32 view of ``chunk``; a zero-padded copy when the last block is short."""
        pad = (-chunk.numel()) % self.block
        flat = chunk.reshape(-1).float()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block)

    def _scales(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        scales = torch.amax(blocks.abs(), dim=1, out=out)
        return scales.div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)

    def _split(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload's float32 scales and int8 values, as views (the layout: all scales, then all values)."""
        n_blocks = -(-numel // self.block)
        return payload[: 4 * n_blocks].view(torch.float32), payload[4 * n_blocks :].view(torch.int8)

    # Encoding writes straight into the payload and decoding broadcasts the scales over
    # blocks: no concatenation and no per-element scale tensor, which made these 7x and
    # 25x slower, and this codec CPU-bound on a 1 Gbit/s link.
    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        payload = self.empty_payload(chunk)
        scales, values = self._split(payload, chunk.numel())
        blocks = self._blocks(chunk)
        self._scales(blocks, out=scales)
        quantized = blocks.div(scales[:, None]).round_().clamp_(-127, 127)
        values.copy_(quantized.view(-1)[: chunk.numel()])
        return payload

    def decode(self, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.add_decoded(payload, torch.zeros_like(like))

    def decode_into(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        return self.add_decoded(payload, into.zero_())

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        scales, values = self._split(payload, into.numel())
        if into.dtype == torch.float32 and into.is_contiguous() and into.numel() % self.block == 0:
            into.view(-1, self.block).addcmul_(values.view(-1, self.block).float(), scales[:, None])
            return into
        per_element = scales.repeat_interleave(self.block)[: into.numel()]
        return into.add_((values.float() * per_element).view_as(into).to(into.dtype))

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        n_blocks = -(-like.numel() // self.block)
        return torch.empty(4 * n_blocks + like.numel(), dtype=torch.uint8, device=like.device)

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        half_step = self._scales(self._blocks(chunk)) / 2
        return half_step.repeat_interleave(self.block)[: chunk.numel()].view_as(chunk) * 1.0001


class TopK:
    """Keep the ``fraction`` of entries largest in magnitude; send (int32 index, value) pairs.

    Sparse vectors with different supports cannot be summed hop by hop, so top-k
    payloads are all-gathered (see ``parallel.reducers``). Wire ratio per rank: 2 *
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
        return self.fraction * (4 + dtype.itemsize) / dtype.itemsize

    def top_indices(self, flat: torch.Tensor, plus: torch.Tensor | None = None) -> torch.Tensor:
        """The k entries of ``flat`` largest in magnitude: exactly the set torch.topk picks, found faster.

        With ``plus``, of ``flat + plus``, added into ``flat`` during the same pass (error
        feedback's residual update costs no trip of its own through memory). A strided
        sample estimates a threshold a little below the k-th largest magnitude; one pass
        keeps the candidates above it, and topk runs on those only (Deep Gradient
        Compression's sampling, made exact). If the estimate was too high the exact topk
        over everything runs instead.
        """
        n, k = flat.numel(), self.k(flat.numel())
        if n < 1 << 16 or 8 * k > n:
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
        rows, cols = shape[0], math.prod(shape[1:])
        return self.rank * (rows + cols) < rows * cols

    def wire_ratio_for(self, shape: torch.Size) -> float:
        if not self.compresses(shape):
            return 1.0
        rows, cols = shape[0], math.prod(shape[1:])
        return self.rank * (rows + cols) / (rows * cols)

    def initial_q(self, shape: torch.Size, seed: int) -> torch.Tensor:
        """The same Q on every rank: a seeded Gaussian, as the power iteration's start."""
        cols = math.prod(shape[1:])
        return torch.randn(cols, self.rank, generator=torch.Generator().manual_seed(seed))

    @staticmethod
    def orthonormalize(p: torch.Tensor) -> torch.Tensor:
        return torch.linalg.qr(p).Q

    def error_bound(self, matrix: torch.Tensor) -> float:
        return torch.linalg.matrix_norm(matrix).item()


RING_CODECS = ("none", "fp16", "bf16", "int8")


def make_codec(name: str) -> Codec:
    if name == "none":
        return Codec()
    if name == "fp16":
        return CastCodec("fp16", torch.float16)
    if name == "bf16":
        return CastCodec("bf16", torch.bfloat16)
    if name == "int8":
        return Int8Codec()
    raise ValueError(f"unknown ring codec {name!r} (valid: {', '.join(RING_CODECS)})")


@dataclass
class ErrorFeedback:
    """Residuals per tensor: what compression took from a step is added back to the next.

    The ring reports, per rank, exactly the error its own encodes introduced, and
    the sum over ranks of those errors is the step's total error; adding them back
    keeps the running sum of decoded results within one step's error of the truth.
    """

    residuals: dict[str, torch.Tensor] = field(default_factory=dict)

    def compensate(self, key: str, flat: torch.Tensor) -> None:
        residual = self.residuals.get(key)
        if residual is not None:
            flat.add_(residual)

    def store(self, key: str, error: torch.Tensor) -> None:
        self.residuals[key] = error

    def reusable(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A zeroed buffer for this step's error: last step's residual once ``compensate`` consumed it."""
        residual = self.residuals.get(key)
        return residual.zero_() if residual is not None else torch.zeros_like(like)

    def residual(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The residual buffer itself, zeros at first, for a codec that adds the new gradient into it
        and keeps there what it did not send."""
        residual = self.residuals.get(key)
        if residual is None:
            self.residuals[key] = residual = torch.zeros_like(like)
        return residual

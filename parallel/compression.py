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

from dataclasses import dataclass, field

import torch


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
        pad = (-chunk.numel()) % self.block
        flat = chunk.reshape(-1).float()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block)

    def _scales(self, blocks: torch.Tensor) -> torch.Tensor:
        return (blocks.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        blocks = self._blocks(chunk)
        scales = self._scales(blocks)
        quantized = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scales.view(torch.uint8), quantized.view(-1)[: chunk.numel()].view(torch.uint8)])

    def decode(self, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        n_blocks = -(-like.numel() // self.block)
        scales = payload[: 4 * n_blocks].view(torch.float32)
        quantized = payload[4 * n_blocks :].view(torch.int8).float()
        per_element = scales.repeat_interleave(self.block)[: like.numel()]
        return (quantized * per_element).view_as(like).to(like.dtype)

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        n_blocks = -(-like.numel() // self.block)
        return torch.empty(4 * n_blocks + like.numel(), dtype=torch.uint8, device=like.device)

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        half_step = self._scales(self._blocks(chunk)) / 2
        return half_step.repeat_interleave(self.block)[: chunk.numel()].view_as(chunk) * 1.0001


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

"""int8 with one float32 scale per block: a quarter of float32's bytes, re-quantized at every ring hop.

A scale per block rather than per tensor keeps one large gradient entry from
flattening every other entry to zero; the reduction is ``casts.RingReducer``'s.
"""

from __future__ import annotations

import torch

from parallel.compression import host_kernels, kernels
from parallel.compression.base import Codec
from parallel.compression.wire import INT8_BLOCK, int8_ratio


class Int8Codec(Codec):
    """Block-wise absmax int8: one float32 scale per block of ``block`` values.

    Wire ratio for float32: (1 + 4/block) / 4 (0.254 for 256). Error per element:
    at most half a quantization step, absmax(block) / 254.
    """

    name = "int8"
    lossy = True

    def __init__(self, block: int = INT8_BLOCK):
        self.block = block

    def wire_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        return int8_ratio(self.block, dtype.itemsize)

    def _blocks(self, chunk: torch.Tensor) -> torch.Tensor:
        """A (blocks, block) float32 view of ``chunk``; a zero-padded copy when the last block is short."""
        pad = (-chunk.numel()) % self.block
        flat = chunk.reshape(-1).float()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block)

    def _scales(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # max |x| as max(max x, -min x): no |x| temporary (2.4x faster on the CPU); a NaN propagates through each
        scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_(), out=out)
        return scales.div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)

    def _quantize(self, blocks: torch.Tensor, scales: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``blocks``' scales and int8 values written into the payload's views; returns the values as float32
        blocks. No clamp: |x| <= absmax and scale >= absmax / 127 (rounded, or raised to tiny) keep |x / scale|
        below 127.5, and a NaN stays NaN through a clamp too (cast to byte 0 either way)."""
        self._scales(blocks, out=scales)
        quantized = blocks.div(scales[:, None]).round_()
        values.copy_(quantized.view(-1)[: values.numel()])
        return quantized

    def _split(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload's float32 scales and int8 values, as views (the layout: all scales, then all values)."""
        n_blocks = -(-numel // self.block)
        return payload[: 4 * n_blocks].view(torch.float32), payload[4 * n_blocks :].view(torch.int8)

    # Encoding writes straight into the payload and decoding broadcasts the scales over
    # blocks: no concatenation and no per-element scale tensor, which made these 7x and
    # 25x slower, and this codec CPU-bound on a 1 Gbit/s link.
    # On CUDA one fused Triton kernel each (``kernels``), on the host one fused C kernel each for whole
    # blocks (``host_kernels``: a 1 MB segment's encode keeping its error in 0.18 ms, these ops 1.03), with the
    # same results bit for bit.
    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        payload = self.empty_payload(chunk)
        scales, values = self._split(payload, chunk.numel())
        if self._fused(chunk) and kernels.run(lambda: kernels.int8_encode(chunk, scales, values, self.block)):
            return payload
        if self._on_host_kernels(chunk):
            host_kernels.int8_encode(chunk, scales, values, self.block)
            return payload
        self._quantize(self._blocks(chunk), scales, values)
        return payload

    def encode_keeping_error(self, chunk: torch.Tensor, error: torch.Tensor, final: bool) -> torch.Tensor:
        """On the CPU, whole float32 blocks: the quantized values decoded into the quotient's buffer (``q *
        scale``, as ``decode_into`` makes them) and the residual taken from them, with no zeroed or subtracted
        temporaries: the same roundings as encode, decode and subtract, and a 2-rank int8 ring on 8 MB over
        loopback takes 12.3 ms of wall time where it took 20.6."""
        whole_blocks = chunk.numel() % self.block == 0 and chunk.is_contiguous() and error.is_contiguous()
        if self._fused(chunk) or chunk.dtype != torch.float32 or not whole_blocks:
            return super().encode_keeping_error(chunk, error, final)
        payload = self.empty_payload(chunk)
        scales, values = self._split(payload, chunk.numel())
        if self._on_host_kernels(chunk, error):
            host_kernels.int8_encode(chunk, scales, values, self.block, error, final)
            return payload
        blocks = chunk.view(-1, self.block)
        decoded = self._quantize(blocks, scales, values)
        torch.mul(values.view_as(blocks), scales[:, None], out=decoded)  # from the bytes: q = -0.0 decodes as +0.0
        residual = blocks if final else decoded
        torch.sub(blocks, decoded, out=residual)
        error.view_as(blocks).add_(residual)
        if final:
            blocks.copy_(decoded)
        return payload

    def decode(self, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self._fused(like):
            return self.decode_into(payload, torch.empty_like(like))
        return self.add_decoded(payload, torch.zeros_like(like))

    def decode_into(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        if self._fused(into) and self._decode_fused(payload, into, add=False):
            return into
        if self._on_host_kernels(into):
            host_kernels.int8_decode(*self._split(payload, into.numel()), into, self.block)
            return into
        return self.add_decoded(payload, into.zero_())

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        if self._fused(into) and self._decode_fused(payload, into, add=True):
            return into
        scales, values = self._split(payload, into.numel())
        if into.dtype == torch.float32 and into.is_contiguous():
            # whole blocks fused (addcmul_: one rounding), a ragged last block product then sum: the same
            # roundings however the tensor is cut at block boundaries (the ring's segments, or whole chunks)
            whole = into.numel() - into.numel() % self.block
            if whole and host_kernels.available(into):
                host_kernels.int8_decode(scales[: whole // self.block], values[:whole], into[:whole], self.block,
                                         add=True)
            elif whole:
                into[:whole].view(-1, self.block).addcmul_(values[:whole].view(-1, self.block).float(),
                                                           scales[: whole // self.block, None])
            if whole < into.numel():
                into[whole:].add_(values[whole:].float() * scales[-1])
            return into
        per_element = scales.repeat_interleave(self.block)[: into.numel()]
        return into.add_((values.float() * per_element).view_as(into).to(into.dtype))

    def _on_host_kernels(self, *tensors: torch.Tensor) -> bool:
        """Whether ``host_kernels`` take these float32 host tensors of whole blocks."""
        return (all(t.dtype == torch.float32 and t.numel() % self.block == 0 for t in tensors)
                and host_kernels.available(*tensors))

    def _fused(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.float32 and kernels.fits_int8(self.block) and kernels.available(tensor)

    def _decode_fused(self, payload: torch.Tensor, into: torch.Tensor, add: bool) -> bool:
        scales, values = self._split(payload, into.numel())
        return kernels.run(lambda: kernels.int8_decode(scales, values, into, self.block, add))

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        n_blocks = -(-like.numel() // self.block)
        return torch.empty(4 * n_blocks + like.numel(), dtype=torch.uint8, device=like.device)

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        half_step = self._scales(self._blocks(chunk)) / 2
        return half_step.repeat_interleave(self.block)[: chunk.numel()].view_as(chunk) * 1.0001

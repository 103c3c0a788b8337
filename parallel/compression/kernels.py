"""Fused Triton kernels for the ring codecs on CUDA: one pass over memory per encode and per decode.

Torch runs int8's encode as six kernels (max, min, scale, divide, round, cast) and its
decode as three, each a trip through device memory: 0.1x a device-to-device copy on an H100.
Here each is one kernel that reads its input once and writes its output once:

- ``int8_encode``: per block of ``block`` values the absmax, the float32 scale
  ``max(absmax / 127, tiny)`` and ``round_half_even(x / scale)`` clamped to +-127, written
  into ``Int8Codec``'s payload (all scales, then all values). NaN and inf as torch: a block holding a
  NaN gets a NaN scale, one holding an inf (and no NaN) an inf scale, either decodes all NaN, and the
  values that are NaN (x / a NaN or inf scale) are byte 0;
- ``int8_decode``: ``into = q * scale`` or, with ``add``, ``into += q * scale``;
- ``cast``: a float32 chunk to fp16/bf16 and back, ``into += payload`` with ``add``.

Every result equals the torch (CPU) path's bit for bit: IEEE division (``div_rn``, not
Triton's approximate ``/``), round half to even by adding and subtracting 1.5 * 2^23 (exact
for |v| <= 2^22), and no fused multiply-add the compiler chose (``enable_fp_fusion=False``):
an explicit ``fma`` where torch's kernel has one (``addcmul_`` on whole blocks), else (a ragged
last block) the product rounded before the sum.

Triton is imported on first use only: ``parallel`` imports without it, and ``available``
tells the codecs whether to dispatch here (CUDA tensors, Triton importable, no earlier
failure); after any failure to compile or launch they fall back to torch for the process.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import torch

ELEMENTS_PER_PROGRAM = 4096
_failed: list[str] = []


def available(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels apply: every tensor contiguous on a CUDA device and Triton importable."""
    if _failed or not all(t.is_cuda and t.is_contiguous() for t in tensors):
        return False
    return _kernels() is not None


def run(launch: Callable[[], None]) -> bool:
    """Run ``launch``; False (and torch from then on) if Triton fails to compile or launch it."""
    try:
        launch()
    except Exception as exc:  # any compiler or driver error: fall back, never fail the step
        _failed.append(repr(exc))
        warnings.warn(f"Triton codec kernels disabled, torch from now on: {exc!r}", RuntimeWarning, stacklevel=3)
        return False
    return True


@functools.cache
def _kernels() -> SimpleNamespace | None:
    """The jitted kernels, built once (Triton reads TRITON_INTERPRET when they are decorated); None without
    Triton."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a broken install
        return None
    return SimpleNamespace(triton=triton, **_define(triton, tl))


def _define(triton, tl) -> dict[str, object]:
    @triton.jit
    def int8_encode(x_ptr, scales_ptr, values_ptr, n, n_blocks, tiny,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        # absmax on the bits with the sign cleared: NaN > inf > every finite value, as integers too, so a NaN
        # anywhere makes the block's scale NaN as torch.amax does (a float max drops NaN, on the GPU and here)
        magnitudes = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        absmax = tl.max(magnitudes, axis=1).to(tl.float32, bitcast=True)
        scale = tl.maximum(tl.math.div_rn(absmax, 127.0), tiny, propagate_nan=tl.PropagateNan.ALL)
        tl.store(scales_ptr + rows, scale, mask=rows < n_blocks)
        v = tl.math.div_rn(x, scale[:, None])
        # NaN (x over a NaN or an inf scale) is byte 0, as torch's cast makes it: the clamp would make it -127
        v = tl.where(v == v, tl.minimum(tl.maximum(v, -127.0), 127.0), 0.0)
        q = (v + 12582912.0) - 12582912.0
        tl.store(values_ptr + offsets, q.to(tl.int8), mask=inside)

    @triton.jit
    def int8_decode(scales_ptr, values_ptr, into_ptr, n, n_blocks,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = offsets < n
        scale = tl.load(scales_ptr + rows, mask=rows < n_blocks, other=0.0)
        q = tl.load(values_ptr + offsets, mask=inside, other=0).to(tl.float32)
        if ADD:  # a whole block as torch's addcmul_ on the CPU (one rounding), the ragged last one product then sum
            current = tl.load(into_ptr + offsets, mask=inside, other=0.0)
            whole = (rows + 1) * BLOCK <= n
            decoded = tl.where(whole[:, None], tl.fma(q, scale[:, None], current), current + q * scale[:, None])
        else:
            decoded = q * scale[:, None]
        tl.store(into_ptr + offsets, decoded, mask=inside)

    @triton.jit
    def cast(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, ADD: tl.constexpr, BF16: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(src_ptr + offsets, mask=inside, other=0.0)
        if ADD:
            y = tl.load(dst_ptr + offsets, mask=inside, other=0.0) + x.to(tl.float32)
        elif BF16:  # round to nearest even on the bits, as torch does (Triton's interpreter truncates)
            bits = x.to(tl.uint32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
            y = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + offsets, y, mask=inside)

    return {"int8_encode": int8_encode, "int8_decode": int8_decode, "cast": cast}


def _rows(block: int) -> int:
    return max(1, ELEMENTS_PER_PROGRAM // block)


def _grid(programs: int) -> tuple[int]:
    return (max(1, programs),)


def fits_int8(block: int) -> bool:
    """Triton's ranges are powers of two: other block sizes stay on torch."""
    return block >= 16 and block & (block - 1) == 0


def int8_encode(chunk: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, block: int) -> None:
    """Fill ``scales`` (float32, one per block) and ``values`` (int8) from ``chunk``, as ``Int8Codec.encode``."""
    k, n, rows = _kernels(), chunk.numel(), _rows(block)
    k.int8_encode[_grid(-(-scales.numel() // rows))](
        chunk, scales, values, n, scales.numel(), torch.finfo(torch.float32).tiny,
        BLOCK=block, ROWS=rows, num_warps=4, enable_fp_fusion=False)


def int8_decode(scales: torch.Tensor, values: torch.Tensor, into: torch.Tensor, block: int, add: bool) -> None:
    """``into = values * scales`` per block, or ``into += ...`` with ``add``; ``into`` float32. As the torch path
    does, the add is fused (one rounding) on whole blocks, the product rounded first on a ragged last block."""
    k, n, rows = _kernels(), into.numel(), _rows(block)
    k.int8_decode[_grid(-(-scales.numel() // rows))](
        scales, values, into, n, scales.numel(), BLOCK=block, ROWS=rows, ADD=add, num_warps=4,
        enable_fp_fusion=False)


def cast(src: torch.Tensor, dst: torch.Tensor, add: bool = False) -> None:
    """``dst = src`` converted (round to nearest even), or ``dst += src`` (float32 ``dst``) with ``add``."""
    k, n = _kernels(), src.numel()
    k.cast[_grid(-(-n // ELEMENTS_PER_PROGRAM))](
        src, dst, n, BLOCK=ELEMENTS_PER_PROGRAM, ADD=add, BF16=dst.dtype == torch.bfloat16, num_warps=8,
        enable_fp_fusion=False)

"""Fused C kernels for int8's encode and decode on the host: one pass over memory each.

Torch runs int8's encode with error feedback as eight kernels (max, min, divide, round, cast, decode, subtract,
add): 66 bytes of memory traffic per element, where one pass reads the value and the error and writes the error
and a byte (13). On the 2-core testbed, four ranks of a compressed exchange spent most of their CPU there. These
are ``kernels.py``'s Triton kernels for the host: Triton's wheels have no CPU backend, and inductor's C++ may
fuse a product and a sum that torch rounds twice, where these must equal the torch path bit for bit (the same
bytes on the wire whichever path a rank took, and the exactness and resume tests unchanged). So they are C,
compiled on first use by the host's C compiler (``cc``; on x86 an AVX2-and-FMA clone and a baseline one, chosen
as the library loads: one cache serves a cluster's mixed CPUs) into a cache per source and machine, and loaded
through ctypes, which releases the GIL while they run. Without a compiler, or after any failure, the codec keeps
torch's ops for the process.

- ``int8_encode``: per block the absmax on the bits with the sign cleared (a NaN anywhere makes the scale NaN, as
  ``torch.amax``), ``scale = max(absmax / 127, tiny)``, ``round_half_even(x / scale)`` (adding and subtracting
  1.5 * 2^23), NaN as byte 0; with an error buffer, ``error += x - q * scale``, and when ``final`` ``x = q *
  scale`` (what the others decode), as ``Int8Codec.encode_keeping_error`` does it in torch;
- ``int8_decode``: ``into = q * scale`` (torch's zeroed ``addcmul_``: a product added to zero is the product) or,
  adding, ``into += q * scale`` rounded once where torch's ``addcmul_`` rounds once on this CPU (its AVX2 and
  AVX-512 kernels fuse the multiply and add), else twice.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))  /* AVX2 and FMA, or not: chosen at load */
#else
#define CLONES
#endif

CLONES static float absmax_of(const float *x, int64_t block) {
    uint32_t largest = 0;  /* NaN > inf > every finite magnitude, as unsigned integers too */
    for (int64_t i = 0; i < block; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        bits &= 0x7fffffffu;
        largest = bits > largest ? bits : largest;
    }
    float absmax;
    memcpy(&absmax, &largest, 4);
    return absmax;
}

CLONES void int8_encode(float *restrict x, float *restrict error, int final, float *restrict scales,
                        int8_t *restrict values, int64_t blocks, int64_t block, float tiny) {
    for (int64_t b = 0; b < blocks; b++) {
        float *xb = x + b * block;
        int8_t *vb = values + b * block;
        float scale = absmax_of(xb, block) / 127.0f;
        scale = scale < tiny ? tiny : scale;  /* NaN stays NaN */
        scales[b] = scale;
        for (int64_t i = 0; i < block; i++) {  /* selects, not branches: the compiler vectorizes them */
            float v = xb[i] / scale;
            float number = v == v ? v : 0.0f;
            float above = number < -127.0f ? -127.0f : number;
            float clamped = above > 127.0f ? 127.0f : above;
            vb[i] = (int8_t)(int32_t)((clamped + 12582912.0f) - 12582912.0f);
        }
        if (!error)
            continue;
        float *eb = error + b * block;
        for (int64_t i = 0; i < block; i++) {
            float decoded = (float)vb[i] * scale;
            eb[i] += xb[i] - decoded;
            if (final)
                xb[i] = decoded;
        }
    }
}

CLONES void int8_decode(const float *restrict scales, const int8_t *restrict values, float *restrict into,
                        int64_t blocks, int64_t block, int add, int fused) {
    for (int64_t b = 0; b < blocks; b++) {
        float *ib = into + b * block;
        const int8_t *vb = values + b * block;
        if (!add)
            for (int64_t i = 0; i < block; i++)
                ib[i] = (float)vb[i] * scales[b];
        else if (fused)
            for (int64_t i = 0; i < block; i++)
                ib[i] = fmaf((float)vb[i], scales[b], ib[i]);
        else
            for (int64_t i = 0; i < block; i++)
                ib[i] = ib[i] + (float)vb[i] * scales[b];
    }
}
"""
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
LIBRARIES = ("-lm",)  # fmaf where the CPU has no FMA instruction; after the source, where the linker needs it
TINY = torch.finfo(torch.float32).tiny
_failed: list[str] = []


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: contiguous host tensors, the kernels built, no earlier failure, and not
    switched off (``HPC_HOST_KERNELS=0``)."""
    if _failed or os.environ.get("HPC_HOST_KERNELS", "1") == "0":
        return False
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return False
    return _library() is not None


def int8_encode(chunk: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, block: int,
                error: torch.Tensor | None = None, final: bool = False) -> None:
    """``scales`` and ``values`` of ``chunk`` (float32, whole blocks); with ``error``, the encode's error added to
    it and, when ``final``, ``chunk`` left as decoded."""
    _library().int8_encode(chunk.data_ptr(), None if error is None else error.data_ptr(), int(final),
                           scales.data_ptr(), values.data_ptr(), scales.numel(), block, TINY)


def int8_decode(scales: torch.Tensor, values: torch.Tensor, into: torch.Tensor, block: int, add: bool = False) -> None:
    """``into = values * scales`` per block, or ``into += ...`` with ``add`` (float32, whole blocks), the add
    rounded as torch's ``addcmul_`` rounds it on this CPU (see ``addcmul_fuses``)."""
    _library().int8_decode(scales.data_ptr(), values.data_ptr(), into.data_ptr(), scales.numel(), block, int(add),
                           int(addcmul_fuses()))


@functools.cache
def addcmul_fuses() -> bool:
    """Whether torch's ``addcmul_`` (the torch path's int8 add) rounds once here, as its vectorized FMA does (AVX2,
    AVX-512), or twice (``ATEN_CPU_CAPABILITY=default``, a CPU without FMA). For a = 1 + 2^-23, a * a is 1 + 2^-22
    + 2^-46: one rounding of a * a - (1 + 2^-22) keeps the 2^-46, rounding the product first loses it."""
    a = torch.full((64,), 1.0 + 2.0**-23, device="cpu")  # torch's host kernel is the one asked about
    c = torch.full((64,), -(1.0 + 2.0**-22), device="cpu")
    return bool((c.addcmul_(a, a) == 2.0**-46).all())


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, built once per source and machine into the cache; None (with a warning) where no
    compiler builds them."""
    try:
        library = ctypes.CDLL(str(_build()))
    except Exception as exc:  # no compiler, a read-only home, a foreign loader: torch's ops instead
        _failed.append(repr(exc))
        warnings.warn(f"host codec kernels unavailable, torch's ops instead: {exc!r}", RuntimeWarning, stacklevel=3)
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.int8_encode.argtypes = [pointer, pointer, ctypes.c_int, pointer, pointer, i64, i64, ctypes.c_float]
    library.int8_decode.argtypes = [pointer, pointer, pointer, i64, i64, ctypes.c_int, ctypes.c_int]
    library.int8_encode.restype = library.int8_decode.restype = None
    return library


def _build() -> Path:
    """The shared library for this source, flags and machine, compiled into the cache unless there already
    (written under a temporary name and renamed: ranks building it at once each get a whole file)."""
    key = hashlib.sha256(f"{SOURCE}{FLAGS}{LIBRARIES}{platform.machine()}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("HPC_KERNEL_CACHE") or Path.home() / ".cache" / "hpc-batch" / "host-kernels")
    target = cache / f"codecs-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        source, built = Path(scratch) / "codecs.c", Path(scratch) / "codecs.so"
        source.write_text(SOURCE)
        subprocess.run([os.environ.get("CC", "cc"), *FLAGS, "-o", str(built), str(source), *LIBRARIES], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, target)
    return target

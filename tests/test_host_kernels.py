"""int8's fused host kernels (``parallel.compression.host_kernels``) give torch's ops' results bit for bit.

The reference is the codec with the kernels switched off (``HPC_HOST_KERNELS=0``): torch's ops, which the
Triton kernels match too (tests/test_codec_kernels.py), so every path puts the same bytes on the wire.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.compression import host_kernels
from parallel.compression.int8 import Int8Codec
from tests.test_codec_kernels import PATTERNS, ROOT, _chain, _differences, _gradient, _torch_ops

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")


@contextmanager
def _host_kernels(switch: str) -> Iterator[None]:
    """``HPC_HOST_KERNELS`` set to ``switch`` inside, restored after (hypothesis's tests take no monkeypatch)."""
    previous = os.environ.get("HPC_HOST_KERNELS")
    os.environ["HPC_HOST_KERNELS"] = switch
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HPC_HOST_KERNELS"]
        else:
            os.environ["HPC_HOST_KERNELS"] = previous


def _torch_path(run):
    """``run()`` with the host kernels switched off."""
    with _host_kernels("0"):
        return run()


@needs_compiler
def test_the_codec_runs_on_the_host_kernels_where_a_compiler_builds_them() -> None:
    assert host_kernels.available(torch.zeros(256))
    assert not host_kernels.available(torch.zeros(256)[::2])  # strided: torch's ops


@needs_compiler
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_host_kernels_keep_nan_and_inf_as_torch(pattern: str, feedback: bool) -> None:
    """Scales, values, decoded values, error buffers and final values of a block with a NaN, an inf, zeros of
    either sign or float32's extremes (whole blocks on the kernels, the ragged rest on torch's ops)."""
    codec = Int8Codec()
    expected = _torch_path(lambda: _chain(codec, _torch_ops(codec), pattern, feedback))
    assert _differences(_chain(codec, _torch_ops(codec), pattern, feedback), expected) == ""


@needs_compiler
@pytest.mark.parametrize("blocks", [1, 3, 1024 + 5])
def test_host_kernels_equal_torch_across_magnitudes(blocks: int) -> None:
    codec = Int8Codec()
    x = _gradient(256 * blocks, blocks)

    for got, want in zip(_magnitudes(codec, x), _torch_path(lambda: _magnitudes(codec, x)), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _magnitudes(codec: Int8Codec, x: torch.Tensor) -> list[torch.Tensor]:
    """Every kernel on ``x``: its payload, decoded, added into other values, and encoded keeping the error."""
    payload = codec.encode(x)
    decoded = codec.decode_into(payload, torch.full_like(x, 7.0))
    added = codec.add_decoded(payload, _gradient(x.numel(), 99))
    kept, error = x.clone(), torch.linspace(-1, 1, x.numel())
    return [payload, decoded, added, codec.encode_keeping_error(kept, error, final=True), kept, error]


@needs_compiler
def test_host_kernels_round_the_add_as_torch_does_on_a_cpu_without_fma() -> None:
    """ATen's default kernels (a CPU without AVX2) round ``addcmul_``'s product before the sum; the kernel's add
    follows torch there too (elsewhere it fuses them, as ATen's AVX2 and AVX-512 kernels do)."""
    code = (
        "import os, torch\n"
        "from parallel.compression import host_kernels\n"
        "from parallel.compression.int8 import Int8Codec\n"
        "from tests.test_host_kernels import _gradient, _magnitudes\n"
        "codec, x = Int8Codec(), _gradient(256 * 9, 5)\n"
        "got = _magnitudes(codec, x)\n"
        "os.environ['HPC_HOST_KERNELS'] = '0'\n"
        "want = _magnitudes(codec, x)\n"
        "assert not host_kernels.addcmul_fuses()\n"
        "assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    env.pop("HPC_HOST_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@needs_compiler
@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=300),
    final=st.booleans(),
)
def test_host_kernels_equal_torch_for_any_floats(values, final) -> None:
    """Subnormals, zeros of either sign, infinities and float32's largest values, two whole blocks."""
    codec = Int8Codec()
    x = torch.tensor(values, dtype=torch.float32).repeat(-(-512 // len(values)))[:512]
    results = []
    for switch in ("1", "0"):
        with _host_kernels(switch):
            kept, error = x.clone(), torch.linspace(-1, 1, x.numel())
            payload = codec.encode_keeping_error(kept, error, final)
            added = codec.add_decoded(payload, torch.linspace(-3, 3, x.numel()))
            results.append([payload, kept, error, codec.decode_into(payload, torch.empty_like(x)), added])
    for got, want in zip(*results, strict=True):
        nan = got.isnan() if got.is_floating_point() else torch.zeros_like(got, dtype=torch.bool)
        assert torch.equal(nan, want.isnan() if want.is_floating_point() else nan)
        assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8))


def test_without_a_compiler_the_codec_keeps_torch_ops(tmp_path) -> None:
    """No compiler (``CC`` names none) and an empty cache: one warning, and the codec still encodes."""
    code = (
        "import warnings, torch\n"
        "from parallel.compression import host_kernels\n"
        "from parallel.compression.int8 import Int8Codec\n"
        "x = torch.randn(512)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    codec = Int8Codec()\n"
        "    decoded = codec.decode(codec.encode(x), x)\n"
        "assert not host_kernels.available(x)\n"
        "assert [str(w.message).split(':')[0] for w in caught] == [\"host codec kernels unavailable, torch's ops "
        "instead\"], caught\n"
        "assert torch.all((decoded - x).abs() <= codec.error_bound(x))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-compiler"), "HPC_KERNEL_CACHE": str(tmp_path / "cache")}
    env.pop("HPC_HOST_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]

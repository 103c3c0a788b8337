"""Codec benchmark: what one ring hop's encode and decode cost on one device, against a copy of the same tensor.

For each codec, on a float32 tensor of each size: ``encode``, ``decode`` (``decode_into``, what
an all-gather hop does) and ``add`` (``add_decoded``, what a reduce-scatter hop does), each the
median of ``iters`` runs after ``warmup``. On a GPU a run is ``QUEUED`` calls queued back to back between
two CUDA events, divided by ``QUEUED``: the device's time per call, as in the ring, where the host queues
the next hop's kernels while the device runs this one (an event pair around a single call also times
the host's launch, about 20 us for a Triton kernel against 90 us of work at 256 MiB). ``launch_us`` is
that difference for encode: one call alone between two events, less its time queued. On the CPU, the
wall clock of one call.
``GBps`` is float32 input bytes over encode + decode, and ``vs_copy`` that rate over
``dst.copy_(src)``'s on the same tensor in the same run; ``add_GBps`` and ``add_vs_copy`` are
the same with encode + add. Counting bytes read and written, one pass each over memory puts
encode + decode at 0.8x the copy for int8 (4 + 1 bytes per value each way) and 0.67x for fp16
and bf16 (4 + 2).

Top-k (1%) has no decode into a whole tensor: its ``decode`` is empty and its encode is the
selection and packing. PowerSGD's encode is one power iteration on the tensor as a square-ish
matrix (P = M Q, orthonormalize P, Q = M^T P), its decode P Q^T.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from hpc import text
from parallel.compression.powersgd import PowerSGD
from parallel.compression.registry import make_codec
from parallel.compression.topk import TopK

CODECS = ("fp16", "bf16", "int8", "topk", "powersgd")
COLUMNS = ("bytes", "device", "codec", "encode_ms", "decode_ms", "add_ms", "GBps", "vs_copy", "add_GBps",
           "add_vs_copy", "launch_us")
HEADER = ("size", "device", "codec", "encode(ms)", "decode(ms)", "add(ms)", "enc+dec(GB/s)", "x copy",
          "enc+add(GB/s)", "x copy", "launch(us)")

Ops = dict[str, Callable[[], object] | None]
QUEUED = 10  # calls per timed run on a GPU
POWERSGD_RANK = 4


def median_seconds(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
                   queued: int = QUEUED) -> float:
    """The median of ``iters`` timed runs of ``fn`` after ``warmup`` untimed calls (a run: one call on the CPU,
    the device's time per call of ``queued`` queued back to back on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queued):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / queued)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _ring_codec_ops(name: str, x: torch.Tensor) -> Ops:
    codec = make_codec(name)
    payload, out, into = codec.encode(x), torch.empty_like(x), torch.zeros_like(x)
    return {"encode": lambda: codec.encode(x), "decode": lambda: codec.decode_into(payload, out),
            "add": lambda: codec.add_decoded(payload, into)}


def _topk_ops(x: torch.Tensor) -> Ops:
    codec = TopK(0.01)
    payload, into = codec.encode(x), torch.zeros_like(x)
    return {"encode": lambda: codec.encode(x), "decode": None, "add": lambda: codec.add_decoded(payload, into)}


def _powersgd_ops(x: torch.Tensor, rank: int = POWERSGD_RANK) -> Ops:
    rows = 2 ** (int(math.log2(x.numel())) // 2)
    m = x[: rows * (x.numel() // rows)].view(rows, -1)
    codec = PowerSGD(rank)
    q = codec.initial_q(m.shape, 0, m.device)
    p = codec.orthonormalize(m @ q)
    out = torch.empty_like(m)

    def encode() -> torch.Tensor:
        return m.T @ codec.orthonormalize(m @ q)

    return {"encode": encode, "decode": lambda: torch.mm(p, q.T, out=out), "add": lambda: out.addmm_(p, q.T)}


def least_bytes(codecs: Sequence[str]) -> tuple[int, str]:
    """The smallest size every one of ``codecs`` measures, and why: one float32, and for PowerSGD a matrix of
    at least ``POWERSGD_RANK`` rows (``_powersgd_ops`` makes it as square as a power of two of rows allows)."""
    if "powersgd" in codecs:
        return 4 * POWERSGD_RANK**2, f"powersgd's {POWERSGD_RANK}x{POWERSGD_RANK} float32 matrix"
    return 4, "one float32"


def codec_ops(name: str, x: torch.Tensor) -> Ops:
    if name == "topk":
        return _topk_ops(x)
    if name == "powersgd":
        return _powersgd_ops(x)
    return _ring_codec_ops(name, x)


def bench_codecs(sizes: Sequence[int], codecs: Sequence[str] = CODECS, iters: int = 20, warmup: int = 3,
                 device: str | torch.device | None = None) -> list[dict]:
    """A copy row, then a row per codec, for each size in bytes of float32 input."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4), generator=torch.Generator().manual_seed(0)).to(device)
        copy_dst = torch.empty_like(x)
        copy = lambda: copy_dst.copy_(x)  # noqa: B023, E731 - used at once
        copy_s = median_seconds(copy, device, iters, warmup)
        rows.append(_row(x, "copy", {"encode": copy_s, "decode": None, "add": None}, copy_s,
                         _launch_us(copy, copy_s, device, iters)))
        for name in codecs:
            ops = codec_ops(name, x)
            seconds = {op: None if fn is None else median_seconds(fn, device, iters, warmup) for op, fn in ops.items()}
            rows.append(_row(x, name, seconds, copy_s, _launch_us(ops["encode"], seconds["encode"], device, iters)))
            del ops
    return rows


def _launch_us(fn: Callable[[], object], queued_s: float, device: torch.device, iters: int) -> float | None:
    """On a GPU, what one call alone takes beyond its queued time: the host's launch, which the device waits for."""
    if device.type != "cuda":
        return None
    return (median_seconds(fn, device, iters, 0, queued=1) - queued_s) * 1e6


def _row(x: torch.Tensor, codec: str, seconds: dict[str, float | None], copy_s: float,
         launch_us: float | None) -> dict:
    nbytes, encode = 4 * x.numel(), seconds["encode"]
    decode, add = seconds["decode"], seconds["add"]
    both = encode + (decode or 0.0)
    with_add = None if add is None else encode + add
    values = (nbytes, str(x.device), codec, encode * 1e3, None if decode is None else decode * 1e3,
              None if add is None else add * 1e3, nbytes / both / 1e9, copy_s / both,
              None if with_add is None else nbytes / with_add / 1e9, None if with_add is None else copy_s / with_add,
              launch_us)
    return dict(zip(COLUMNS, values, strict=True))


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    def number(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    return (text.human_size(r["bytes"]), r["device"], r["codec"], number(r["encode_ms"], ".3f"),
            number(r["decode_ms"], ".3f"), number(r["add_ms"], ".3f"), number(r["GBps"], ".1f"),
            number(r["vs_copy"], ".3f") + "x", number(r["add_GBps"], ".1f"),
            number(r["add_vs_copy"], ".3f") + ("x" if r["add_vs_copy"] is not None else ""),
            number(r["launch_us"], ".1f"))

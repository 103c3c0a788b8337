"""What one rank of this machine computes: a GPT block's FLOP rate and fixed cost, on one thread and on every
core's, the memory bandwidth of a copy and the optimizer's cost per tensor (``hpc plan --calibrate`` writes them
into a cluster file). Torch is imported here, never by the planner."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch


def _median_of(op, iters: int, window_s: float = 0.2) -> float:
    """Median over ``iters`` windows of the mean seconds of ``op`` repeated for at least ``window_s``: a window as
    long as a small model's training step, so that on a shared machine the probe gets the share of the cores a step
    gets (a millisecond's op timed alone slips between other processes' time slices)."""
    return _medians_of([op], iters, window_s)[0]


def _medians_of(ops, iters: int, window_s: float = 0.2) -> list[float]:
    """``_median_of`` of each op, their windows taken in turn, so a slow minute of a shared machine falls on all."""
    for op in ops:
        op()  # warm-up
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(iters):
        for op, kept in zip(ops, times, strict=True):
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < window_s or count == 0:
                op()
                count += 1
            kept.append(elapsed / count)
    return [sorted(kept)[len(kept) // 2] for kept in times]


def measure_copy_gbps(copy_bytes: int = 256 << 20, iters: int = 5) -> float:
    """GB/s of a copy (read + write) on one thread: what the planner charges elementwise work at."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.empty(copy_bytes // 4)
        target = torch.empty_like(source)
        return 2 * copy_bytes / _median_of(lambda: target.copy_(source), iters) / 1e9
    finally:
        torch.set_num_threads(previous)


# (hidden, heads, sequences of 64 tokens): small to mid-sized GPT blocks, where a CPU rank's fixed cost per layer
# and its rate on small matrix products both show.
LAYER_PROBES = ((64, 4, 1), (128, 4, 2), (128, 4, 16), (256, 4, 8), (256, 4, 32))


def measure_layers(threads: Sequence[int] = (1,), iters: int = 5, seq_len: int = 64) -> list[dict]:
    """Median seconds of one GPT block's forward and backward (jobs/models/gpt.py's Block) at each of LAYER_PROBES, on
    each count of ``threads`` (their windows taken in turn): what ``hpc plan --calibrate`` fits a fixed cost per
    layer and a FLOP rate to, and compares the rates of one thread and of every core's with."""
    from jobs.models.gpt import Block

    previous = torch.get_num_threads()
    rows = []
    try:
        for hidden, heads, batch in LAYER_PROBES:
            block = Block(hidden, heads, 0.0)
            x = torch.randn(batch, seq_len, hidden, requires_grad=True)
            ops = [functools.partial(_forward_backward, block, x, n) for n in threads]
            for n, seconds in zip(threads, _medians_of(ops, iters), strict=True):
                rows.append({"hidden": hidden, "heads": heads, "batch": batch, "seq_len": seq_len, "threads": n,
                             "seconds": seconds})
    finally:
        torch.set_num_threads(previous)
    return rows


def _forward_backward(block: torch.nn.Module, x: torch.Tensor, threads: int) -> None:
    torch.set_num_threads(threads)
    block(x).sum().backward()


def measure_tensor_overhead(tensors: int = 200, iters: int = 5) -> float:
    """Seconds per parameter tensor of an AdamW step over many one-element tensors (one thread): the optimizer's
    fixed cost per tensor, which a small model's step pays for each of its weights and biases."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = [torch.zeros(1, requires_grad=True) for _ in range(tensors)]
        for param in params:
            param.grad = torch.ones(1)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        return _median_of(optimizer.step, iters) / tensors
    finally:
        torch.set_num_threads(previous)


def measure_optimizer_s(iters: int = 5) -> float:
    """Seconds per parameter of an AdamW step over OPTIMIZER_PROBE's tensors (one thread), a mid-sized model's
    weights: what the planner's optimizer traffic is fitted to, beside the cost per tensor."""
    from parallel.calibrate import OPTIMIZER_PROBE

    tensors, size = OPTIMIZER_PROBE
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = [torch.zeros(size, requires_grad=True) for _ in range(tensors)]
        for param in params:
            param.grad = torch.randn(size)
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        return _median_of(optimizer.step, iters) / (tensors * size)
    finally:
        torch.set_num_threads(previous)


def measure_int8_s(iters: int = 5) -> tuple[float, float]:
    """(seconds per element of a ring segment's int8 encode with error feedback, of a received segment's decode or
    add, their mean), one thread, on segments of the ring's size (parallel/ring.py)."""
    from parallel.compression.registry import make_codec
    from parallel.ring import SEGMENT_BYTES, encode_segment

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        codec = make_codec("int8")
        segment = torch.randn(SEGMENT_BYTES // 4, generator=torch.Generator().manual_seed(0))
        error, into = torch.zeros_like(segment), torch.zeros_like(segment)
        payload = codec.encode(segment)
        encode, add, decode = _medians_of([lambda: encode_segment(codec, segment, error, False),
                                           lambda: codec.add_decoded(payload, into),
                                           lambda: codec.decode_into(payload, into)], iters)
        return encode / segment.numel(), (add + decode) / 2 / segment.numel()
    finally:
        torch.set_num_threads(previous)

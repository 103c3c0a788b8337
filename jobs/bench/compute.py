"""What one rank of this machine computes: the FLOP rate of a matrix product and the memory bandwidth of a copy
(``hpc plan --calibrate`` writes them into a cluster file). Torch is imported here, never by the planner."""

from __future__ import annotations

import time

import torch


def _best_of(op, iters: int) -> float:
    op()  # warm-up
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - start)
    return best


def measure_compute(size: int = 1024, copy_bytes: int = 256 << 20, iters: int = 5, threads: int = 1) -> dict:
    """teraFLOP/s of an fp32 size x size matrix product (2 size^3 FLOPs) and GB/s of a copy (read + write), on
    ``threads`` threads: one rank's share of the cores when every rank of a node runs at once."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        matmul_s = _best_of(lambda: torch.mm(a, b), iters)
        source = torch.empty(copy_bytes // 4)
        target = torch.empty_like(source)
        copy_s = _best_of(lambda: target.copy_(source), iters)
    finally:
        torch.set_num_threads(previous)
    return {"tflops_fp32": 2 * size**3 / matmul_s / 1e12, "memory_gbps": 2 * copy_bytes / copy_s / 1e9}

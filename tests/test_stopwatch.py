"""Durations on the device's clock (``hpc/observe/stopwatch.py``): the host clock on the CPU, CUDA events on a GPU,
where the host only queues the work."""

from __future__ import annotations

import time

import pytest
import torch

from hpc.observe.stopwatch import Stopwatch


def test_on_the_cpu_regions_are_summed_on_the_host_clock() -> None:
    watch = Stopwatch(torch.device("cpu"))
    with watch.timing():
        time.sleep(0.02)
    start = watch.mark()
    time.sleep(0.03)
    watch.add(start)
    time.sleep(0.5)  # outside any region: counted, the total would pass 0.5 s however late the sleeps wake
    assert 0.05 <= watch.seconds() < 0.5


@pytest.mark.cuda
def test_on_a_gpu_the_region_is_what_the_device_spent_not_the_queuing() -> None:
    """A kernel that spins for a fixed number of clock cycles is queued at once; the events see it run."""
    device = torch.device("cuda")
    torch.cuda.synchronize()
    watch = Stopwatch(device)
    queued = time.perf_counter()
    with watch.timing():
        torch.cuda._sleep(200_000_000)  # about 0.1 s at 2 GHz
    queued = time.perf_counter() - queued
    torch.cuda.synchronize()
    spent = watch.seconds()
    assert spent > 0.03, spent
    assert queued < spent / 5, (queued, spent)
    side = torch.cuda.Stream()  # a region on another stream is timed on that stream
    with torch.cuda.stream(side), watch.timing():
        torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    assert watch.seconds() > spent + 0.03

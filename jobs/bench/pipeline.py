"""Pipeline benchmark: measured bubble and peak activation memory per schedule, against the theory.

Measured bubble, the simulator's definition (``parallel.schedule``) measured: on each rank
1 - (time inside F and B compute) / (the step's wall time), where the step's wall time is
the slowest rank's time from a common barrier to its last send completing (the makespan);
averaged over ranks and timed steps. Theory: (p-1)/(m+p-1), and (p-1)/(v*m+p-1)
interleaved. Peak activation bytes: the executor's count of what it keeps for backward,
the maximum over the step and over ranks.

The model is a stack of square Linear+Tanh blocks, wide enough that a forward of one
microbatch costs milliseconds, so one activation message is small next to it; it is cut
into p*v equal stages, and the microbatch size is fixed, so more microbatches mean more
work per step, as when the global batch grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hpc import text
from parallel.pipeline import run_pipeline_step, split_into_stages
from parallel.schedule import build_schedule, theoretical_bubble

COLUMNS = (
    "schedule", "stages", "microbatches", "virtual", "bubble_measured", "bubble_theory", "peak_activation_bytes",
    "step_s",
)
HEADER = ("schedule", "p", "m", "v", "bubble", "theory", "peak act MiB", "step(ms)")


def bench_pipeline(
    group: ProcessGroup, schedules: Sequence[str], microbatches: Sequence[int], virtual: int, *,
    layers: int = 16, width: int = 512, rows: int = 64, steps: int = 3, warmup: int = 1,
) -> list[dict]:
    """One row per (schedule, m) on the ranks of ``group``; every rank returns the same rows."""
    p = dist.get_world_size(group)
    return [
        _bench_one(group, name, p, m, virtual if name == "interleaved" else 1, layers, width, rows, steps, warmup)
        for name in schedules for m in microbatches
    ]


def _bench_one(
    group: ProcessGroup, name: str, p: int, m: int, v: int, layers: int, width: int, rows: int, steps: int,
    warmup: int,
) -> dict:
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    chunks = split_into_stages([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)], p, v)[rank]
    actions = build_schedule(name, p, m, v)[rank]
    inputs, targets = torch.randn(m, rows, width).unbind(), torch.randn(m, rows, width).unbind()
    compute, wall, peak = [], [], 0
    for step in range(warmup + steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        stats = run_pipeline_step(
            actions, chunks, group, activation_shape=(rows, width), loss_fn=nn.functional.mse_loss,
            inputs=inputs, targets=targets,
        )
        if step >= warmup:
            compute.append(stats.forward_s + stats.backward_s)
            wall.append(stats.wall_s)
            peak = max(peak, stats.peak_activation_bytes)
    makespans = torch.tensor(wall, dtype=torch.float64)
    dist.all_reduce(makespans, op=dist.ReduceOp.MAX, group=group)
    bubble = torch.tensor([1 - sum(c / w for c, w in zip(compute, makespans.tolist(), strict=True)) / steps])
    dist.all_reduce(bubble, group=group)
    peak_bytes = torch.tensor([peak], dtype=torch.int64)
    dist.all_reduce(peak_bytes, op=dist.ReduceOp.MAX, group=group)
    values = (name, p, m, v, bubble.item() / p, theoretical_bubble(name, p, m, v), int(peak_bytes.item()),
              makespans.mean().item())
    return dict(zip(COLUMNS, values, strict=True))


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    return (r["schedule"], r["stages"], r["microbatches"], r["virtual"], f"{r['bubble_measured']:.3f}",
            f"{r['bubble_theory']:.3f}", f"{r['peak_activation_bytes'] / 2**20:.2f}", f"{r['step_s'] * 1e3:.1f}")

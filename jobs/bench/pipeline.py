"""Pipeline benchmark: measured bubble and peak activation memory per schedule, against the theory.

Measured bubble, the simulator's definition (``parallel.schedule``) measured: on each rank
1 - (time inside F and B compute) / (the step's wall time), where the step's wall time is
the slowest rank's time from a common barrier to its last send completing (the makespan);
averaged over ranks and timed steps. Theory: (p-1)/(m+p-1), and (p-1)/(v*m+p-1)
interleaved. Peak activation bytes: the executor's count of what it keeps for backward,
the maximum over the step and over ranks.

What a message costs: ``message_s``, the one-way time of one activation between pipeline
ranks 0 and 1 (half a ping-pong round trip, median of a few, measured before the rows),
against ``chunk_compute_s``, the mean forward plus backward of one microbatch through one
chunk; ``bubble_simulated`` is the simulator's bubble of the same schedule with the
measured forward, backward and message times, so the gap between it and the theory is
what the messages cost and the gap between it and the measurement is everything else
(unequal stages, a busy machine).

The model is a stack of square Linear+Tanh blocks, by default 64 blocks 1024 wide and
64 rows per microbatch: an interleaved chunk (16 blocks at p = 2) computes forward and
backward for about 90 ms on one core while an activation (256 KiB) crosses in 0.05 ms
over MPI's shared memory and 0.15 ms over Gloo's loopback socket, a ratio of 600 or
more, as on a GPU stage (GPT-3 175B on A100s at p = 8, v = 2: about 90 ms a chunk against
0.25 ms for its 6 MB activation over 200 Gbit/s). With 16 blocks Gloo's ratio was 100 and
each message's CPU time on the busy cores showed in the interleaved bubble. It is cut into
p*v equal stages (the first stage's input asks for its gradient, so that stage computes
what the others do), and the microbatch size is fixed, so more microbatches mean more work
per step, as when the global batch grows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hpc import text
from parallel.pipeline import run_pipeline_step, split_into_stages
from parallel.schedule import build_schedule, simulate, theoretical_bubble
from parallel.transport import Transport, make_transport

COLUMNS = (
    "transport", "schedule", "stages", "microbatches", "virtual", "bubble_measured", "bubble_theory",
    "bubble_simulated", "peak_activation_bytes", "step_s", "chunk_compute_s", "message_s",
)
HEADER = ("transport", "schedule", "p", "m", "v", "bubble", "theory", "sim+msg", "peak act MiB", "step(ms)", "F+B(ms)",
          "msg(ms)")
PING_PONGS = 10


def bench_pipeline(
    group: ProcessGroup, schedules: Sequence[str], microbatches: Sequence[int], virtual: int, *,
    transports: Sequence[str] = ("torch",), layers: int = 64, width: int = 1024, rows: int = 64, steps: int = 3,
    warmup: int = 1,
) -> list[dict]:
    """One row per (transport, schedule, m) on the ranks of ``group``; every rank returns the same rows."""
    p, rows_out = dist.get_world_size(group), []
    for transport in (make_transport(name, group) for name in transports):
        message = message_seconds(group, (rows, width), transport)
        rows_out += [
            {"transport": transport.name,
             **_bench_one(group, transport, name, p, m, virtual if name == "interleaved" else 1, layers, width, rows,
                          steps, warmup, message)}
            for name in schedules for m in microbatches
        ]
    return rows_out


def message_seconds(group: ProcessGroup, shape: Sequence[int], transport: Transport) -> float:
    """One-way time of one activation from pipeline rank 0 to 1: half the median ping-pong, the same on every rank.

    Ranks past 1 only wait for the result; 0.0 for a single rank."""
    rank, seconds = dist.get_rank(group), torch.zeros(1, dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        payload, trips = torch.randn(shape), []
        dist.barrier(group=group)
        for _ in range(PING_PONGS + 1) if rank < 2 else ():
            started = time.perf_counter()
            if rank == 0:
                transport.send(payload, 1).wait()
                transport.recv(payload, 1).wait()
            else:
                transport.recv(payload, 0).wait()
                transport.send(payload, 0).wait()
            trips.append(time.perf_counter() - started)
        if rank == 0:
            seconds[0] = statistics.median(trips[1:]) / 2  # the first trip warms the connection up
    dist.broadcast(seconds, group_src=0, group=group)
    return seconds.item()


def _bench_one(
    group: ProcessGroup, transport: Transport, name: str, p: int, m: int, v: int, layers: int, width: int,
    rows: int, steps: int, warmup: int, message: float,
) -> dict:
    rank = dist.get_rank(group)
    torch.manual_seed(0)
    chunks = split_into_stages([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)], p, v)[rank]
    actions = build_schedule(name, p, m, v)[rank]
    # The first stage's backward computes its input's gradient too, as every other stage's does:
    # without it, rank 0 does one matmul fewer per microbatch and the stages are unequal.
    inputs = torch.randn(m, rows, width, requires_grad=True).unbind()
    targets = torch.randn(m, rows, width).unbind()
    compute, wall, peak, f_and_b = [], [], 0, []
    for step in range(warmup + steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        stats = run_pipeline_step(
            actions, chunks, group, activation_shape=(rows, width), loss_fn=nn.functional.mse_loss,
            inputs=inputs, targets=targets, transport=transport,
        )
        if step >= warmup:
            compute.append(stats.forward_s + stats.backward_s)
            f_and_b.append((stats.forward_s, stats.backward_s))
            wall.append(stats.wall_s)
            peak = max(peak, stats.peak_activation_bytes)
    makespans = torch.tensor(wall, dtype=torch.float64)
    dist.all_reduce(makespans, op=dist.ReduceOp.MAX, group=group)
    bubble = torch.tensor([1 - sum(c / w for c, w in zip(compute, makespans.tolist(), strict=True)) / steps])
    dist.all_reduce(bubble, group=group)
    peak_bytes = torch.tensor([peak], dtype=torch.int64)
    dist.all_reduce(peak_bytes, op=dist.ReduceOp.MAX, group=group)
    per_action = torch.tensor([sum(f for f, _ in f_and_b), sum(b for _, b in f_and_b)], dtype=torch.float64)
    dist.all_reduce(per_action, group=group)
    forward, backward = (per_action / (p * steps * m * v)).tolist()  # one microbatch through one chunk
    simulated = simulate(build_schedule(name, p, m, v), forward, backward, message).bubble
    values = (name, p, m, v, bubble.item() / p, theoretical_bubble(name, p, m, v), simulated,
              int(peak_bytes.item()), makespans.mean().item(), forward + backward, message)
    return dict(zip(COLUMNS[1:], values, strict=True))  # the caller adds the transport


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    return (r["transport"], r["schedule"], r["stages"], r["microbatches"], r["virtual"], f"{r['bubble_measured']:.3f}",
            f"{r['bubble_theory']:.3f}", f"{r['bubble_simulated']:.3f}", f"{r['peak_activation_bytes'] / 2**20:.2f}",
            f"{r['step_s'] * 1e3:.1f}", f"{r['chunk_compute_s'] * 1e3:.1f}", f"{r['message_s'] * 1e3:.3f}")

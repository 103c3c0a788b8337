"""All-to-all benchmark: expert parallelism's token exchange (``parallel.ep.all_to_all``) against torch's.

Every rank sends each peer a different number of rows (rank r sends rank d a share
proportional to ``1 + (r + d) % n``, as a router's uneven load would), ``size`` bytes in
all. Ours is given the bound torch's padded call needs anyway (the widest split, an MoE
layer's capacity): below ``parallel.ep.PADDED_LIMIT`` it sends padded messages with the
split sizes in a header, one round; above, it sends the sizes in a small all-to-all of
their own, then the rows in one ``all_to_all_single`` with uneven splits. ``ours-mpi`` is the
same exchange over ``parallel.transport = "mpi"`` (one mpi4py send and receive per peer;
ranks started by mpirun), as a job with that transport runs it.
The peers, in the same run, interleaved iteration by iteration with ours so a noisy
machine shifts them alike:

- ``torch``: ``torch.distributed.all_to_all`` (a list of tensors). Gloo's requires
  every tensor of a call to have the same shape, so it sends each peer the largest
  split, padded: what a caller without uneven splits has to do;
- ``torch+copies``: the same, with what its caller has to do around it to move uneven rows:
  pad them into the equal tensors, then keep the real rows of what arrives (given the
  receive splits in advance);
- ``torch-single``: ``all_to_all_single`` with the receive splits given (known in
  advance, which a router's caller does not know): the floor ours builds on.

A row's time is the median over iterations of the slowest rank's; ``speed_vs_torch`` is torch's time over
the row's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hpc import text
from parallel.ep import all_to_all
from parallel.transport import make_transport

COLUMNS = ("bytes", "ranks", "impl", "time_s", "algbw_GBps", "speed_vs_torch")
HEADER = ("size", "ranks", "impl", "time(ms)", "algbw(GB/s)", "speed vs torch")
ROW_FLOATS = 256  # a token of width 256


def uneven_splits(rows: int, rank: int, n: int) -> list[int]:
    """Rows this rank sends each peer: shares ``1 + (rank + peer) % n``, adding up to ``rows``."""
    weights = [1 + (rank + peer) % n for peer in range(n)]
    splits = [rows * w // sum(weights) for w in weights]
    splits[-1] += rows - sum(splits)
    return splits


def _timed_rounds(ops: dict[str, Callable[[], object]], iters: int, warmup: int) -> dict[str, float]:
    """Each op's median over iterations of the slowest rank's time, the ops interleaved within every round,
    which one goes first rotating from round to round (the median: other processes on a shared machine
    stretch single iterations, not the typical one)."""
    names = list(ops)
    times = torch.zeros(len(names), iters, dtype=torch.float64)
    for i in range(warmup + iters):
        for k in [*range(i % len(names), len(names)), *range(i % len(names))]:
            dist.barrier()
            start = time.perf_counter()
            ops[names[k]]()
            if i >= warmup:
                times[k, i - warmup] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return dict(zip(names, times.median(dim=1).values.tolist(), strict=True))


def _ops(nbytes: int, group: dist.ProcessGroup, transports: Sequence[str]) -> dict[str, Callable[[], object]]:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    send = uneven_splits(max(n, nbytes // (4 * ROW_FLOATS)), rank, n)
    recv = [uneven_splits(sum(send), peer, n)[rank] for peer in range(n)]  # every rank sends as many rows
    x = torch.randn(sum(send), ROW_FLOATS, generator=torch.Generator().manual_seed(rank))
    out = x.new_empty(sum(recv), ROW_FLOATS)
    widest = max(max(uneven_splits(sum(send), peer, n)) for peer in range(n))
    padded_in = [x.new_zeros(widest, ROW_FLOATS) for _ in range(n)]
    for padded, rows in zip(padded_in, x.split(send), strict=True):
        padded[: len(rows)] = rows
    padded_out = [x.new_empty(widest, ROW_FLOATS) for _ in range(n)]
    expected = _torch_single(x, out, send, recv, group).clone()
    ours = {_ours_name(name): None if name == "torch" else make_transport(name, group) for name in transports}
    for transport in ours.values():
        for bound in (None, widest):  # two rounds, and one when the padded exchange is small
            torch.testing.assert_close(all_to_all(x, send, group, bound, transport)[0], expected)  # same rows, order
    torch.testing.assert_close(_torch_with_copies(x, send, recv, widest, group), expected)
    return {
        **{name: lambda transport=transport: all_to_all(x, send, group, widest, transport)
           for name, transport in ours.items()},
        "torch": lambda: dist.all_to_all(padded_out, padded_in, group=group),
        "torch+copies": lambda: _torch_with_copies(x, send, recv, widest, group),
        "torch-single": lambda: _torch_single(x, out, send, recv, group),
    }


def _ours_name(transport: str) -> str:
    """"ours" over torch's collective, "ours-mpi" point-to-point over mpi4py."""
    return "ours" if transport == "torch" else f"ours-{transport}"


def _torch_with_copies(x, send, recv, widest, group) -> torch.Tensor:
    """What a caller of torch's all_to_all does to move uneven rows: pad them, exchange, keep the real rows."""
    n = len(send)
    padded = x.new_zeros(n, widest, x.shape[1])
    for peer, rows in enumerate(x.split(send)):
        padded[peer, : len(rows)] = rows
    arrived = x.new_empty(n, widest, x.shape[1])
    dist.all_to_all(list(arrived.unbind(0)), list(padded.unbind(0)), group=group)
    return torch.cat([arrived[source, :rows] for source, rows in enumerate(recv)])


def _torch_single(x, out, send, recv, group) -> torch.Tensor:
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


def bench_alltoall(group: dist.ProcessGroup, sizes: Sequence[int], iters: int = 10, warmup: int = 2,
                   transports: Sequence[str] = ("torch",)) -> list[dict]:
    """Rows per size: ours over each of ``transports``, then torch's three."""
    rows = []
    n = dist.get_world_size(group)
    for nbytes in sizes:
        seconds = _timed_rounds(_ops(nbytes, group, transports), iters, warmup)
        for impl, time_s in seconds.items():
            values = (nbytes, n, impl, time_s, nbytes / time_s / 1e9, seconds["torch"] / time_s)
            rows.append(dict(zip(COLUMNS, values, strict=True)))
    return rows


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    return (text.human_size(r["bytes"]), r["ranks"], r["impl"], f"{r['time_s'] * 1e3:.3f}",
            f"{r['algbw_GBps']:.3f}", f"{r['speed_vs_torch']:.2f}x")

"""All-to-all benchmark: expert parallelism's token exchange (``parallel.ep.all_to_all``) against torch's.

Every rank sends each peer a different number of rows (rank r sends rank d a share
proportional to ``1 + (r + d) % n``, as a router's uneven load would), ``size`` bytes in
all. Ours learns the split sizes it receives in a small all-to-all of its own, then
sends the rows in one ``all_to_all_single`` with uneven splits: what an MoE layer calls.
The peers, in the same run, interleaved iteration by iteration with ours so a noisy
machine shifts them alike:

- ``torch``: ``torch.distributed.all_to_all`` (a list of tensors). Gloo's requires
  every tensor of a call to have the same shape, so it sends each peer the largest
  split, padded: what a caller without uneven splits has to do;
- ``torch-single``: ``all_to_all_single`` with the receive splits given (known in
  advance, which a router's caller does not know): the floor ours builds on.

A row's time is the slowest rank's mean; ``speed_vs_torch`` is torch's time over the row's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hpc import text
from parallel.ep import all_to_all

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
    """Mean seconds per call of each op on the slowest rank, the ops interleaved within every round."""
    totals = dict.fromkeys(ops, 0.0)
    for i in range(warmup + iters):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            if i >= warmup:
                totals[name] += time.perf_counter() - start
    slowest = torch.tensor([totals[name] / iters for name in ops], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(ops, slowest.tolist(), strict=True))


def _ops(nbytes: int, group: dist.ProcessGroup) -> dict[str, Callable[[], object]]:
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
    ours, _ = all_to_all(x, send, group)
    torch.testing.assert_close(ours, _torch_single(x, out, send, recv, group))  # the same rows, in the same order
    return {
        "ours": lambda: all_to_all(x, send, group),
        "torch": lambda: dist.all_to_all(padded_out, padded_in, group=group),
        "torch-single": lambda: _torch_single(x, out, send, recv, group),
    }


def _torch_single(x, out, send, recv, group) -> torch.Tensor:
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


def bench_alltoall(group: dist.ProcessGroup, sizes: Sequence[int], iters: int = 10, warmup: int = 2) -> list[dict]:
    rows = []
    n = dist.get_world_size(group)
    for nbytes in sizes:
        seconds = _timed_rounds(_ops(nbytes, group), iters, warmup)
        for impl, time_s in seconds.items():
            values = (nbytes, n, impl, time_s, nbytes / time_s / 1e9, seconds["torch"] / time_s)
            rows.append(dict(zip(COLUMNS, values, strict=True)))
    return rows


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    return (text.human_size(r["bytes"]), r["ranks"], r["impl"], f"{r['time_s'] * 1e3:.3f}",
            f"{r['algbw_GBps']:.3f}", f"{r['speed_vs_torch']:.2f}x")

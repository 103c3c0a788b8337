"""All-reduce benchmark, nccl-tests style: our ring with each codec against torch's all_reduce.

Every implementation is measured on the same ranks in the same run, so ratios
hold on a noisy machine. top-k and PowerSGD carry error feedback from one iteration
to the next, as in training, so their error column is one step's error, large by
design (the residual is sent later), not a bound. Each iteration restores the input, synchronises the
ranks, and times one all-reduce; a row's time is the slowest rank's mean.
busbw = algbw * 2(n-1)/n is the per-link bandwidth a ring needs, comparable
across rank counts. Sizes are the uncompressed float32 bytes. With ``scopes`` holding ``inter-node``, each
codec also runs cut by the launcher's nodes (parallel/hierarchy.py; impl ``cut``): uncompressed inside the
node, the codec across nodes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from hpc import text
from jobs.bench.options import SCOPES
from parallel.compression.registry import RING_CODECS, make_codec, make_reducer
from parallel.hierarchy import REDUCE_SCATTER, HierarchicalReducer, NodeGroups, build_node_groups
from parallel.ring import ring_allreduce
from parallel.transport import make_transport

COLUMNS = ("bytes", "ranks", "impl", "transport", "codec", "time_s", "algbw_GBps", "busbw_GBps", "max_rel_error")
HEADER = ("size", "ranks", "impl", "transport", "codec", "time(ms)", "algbw(GB/s)", "busbw(GB/s)", "max_rel_err")


def _time_op(op, reset, iters: int, warmup: int) -> float:
    """Mean seconds per call on the slowest rank."""
    total = 0.0
    for i in range(warmup + iters):
        reset()
        dist.barrier()
        start = time.perf_counter()
        op()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            total += elapsed
    slowest = torch.tensor([total / iters], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def bench_allreduce(
    sizes: Sequence[int], codecs: Sequence[str], transports: Sequence[str], iters: int = 5, warmup: int = 1,
    scopes: Sequence[str] = ("flat",), op: str = "allreduce",
) -> list[dict]:
    """``op`` ``reduce-scatter``: ZeRO-2/3's exchange instead (torch's reduce_scatter_tensor, the ring's
    reduce-scatter with each ring codec, and cut by node), each rank's reduced chunk checked."""
    transports_by_name = {name: make_transport(name, None) for name in transports}
    unknown = set(scopes) - set(SCOPES)
    if unknown:
        raise ValueError(f"scopes {sorted(unknown)}: valid are {', '.join(SCOPES)}")
    node_groups = {name: _node_groups(name) for name in transports} if "inter-node" in scopes else {}
    bench_size = _bench_size if op == "allreduce" else _bench_reduce_scatter
    rows = []
    for nbytes in sizes:
        rows += bench_size(nbytes, codecs, transports_by_name, iters, warmup, "flat" in scopes, node_groups)
    return rows


def least_bytes(op: str, ranks: int) -> tuple[int, str]:
    """The smallest size ``op`` measures on ``ranks`` ranks, and why: one float32 (a reduce-scatter: one per
    rank, as ``_bench_reduce_scatter`` rounds down to a multiple of the ranks)."""
    if op == "reduce-scatter":
        return 4 * ranks, f"a float32 per rank, {ranks} ranks"
    return 4, "one float32"


def _node_groups(transport: str) -> NodeGroups:
    """This rank's groups cut by the nodes the launcher names (one DP group of every rank)."""
    import os

    from hpc.runtime.env import detect_rank_info
    from hpc.runtime.mesh import MeshShape, build_mesh

    mesh = build_mesh(MeshShape(dist.get_world_size(), 1, 1), dist.get_rank(),
                      node_rank=detect_rank_info(os.environ).node_rank)
    return build_node_groups(mesh, transport)


def _bench_size(nbytes: int, codecs: Sequence[str], transports: dict, iters: int, warmup: int, flat: bool,
                node_groups: dict[str, NodeGroups]) -> list[dict]:
    n = dist.get_world_size()
    numel = nbytes // 4
    source = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    exact = source.double()
    dist.all_reduce(exact)
    scale = exact.abs().max().clamp_min(1e-30)
    buffer = torch.empty_like(source)

    def reset() -> None:
        buffer.copy_(source)

    def row(impl: str, transport: str, codec: str, seconds: float) -> dict:
        error = ((buffer.double() - exact).abs().max() / scale).item() if numel else 0.0
        algbw = nbytes / seconds / 1e9
        values = (nbytes, n, impl, transport, codec, seconds, algbw, algbw * 2 * (n - 1) / n, error)
        return dict(zip(COLUMNS, values, strict=True))

    rows = [row("torch", dist.get_backend(), "none", _time_op(partial(dist.all_reduce, buffer), reset, iters, warmup))]
    for transport_name, transport in transports.items():
        for codec_name in codecs:
            if flat and codec_name in RING_CODECS:
                reduce = partial(ring_allreduce, buffer, transport, codec=make_codec(codec_name))
                rows.append(row("ring", transport_name, codec_name, _time_op(reduce, reset, iters, warmup)))
            elif flat:  # top-k and PowerSGD see the buffer as a weight matrix, as they would a layer's gradient
                matrix = buffer.view(_rows(numel), -1)
                reduce = partial(make_reducer(codec_name).reduce, "bench", [matrix], transport, False)
                rows.append(row("ring", transport_name, codec_name, _time_op(reduce, reset, iters, warmup)))
            if transport_name in node_groups:
                cut = HierarchicalReducer(make_reducer(codec_name), node_groups[transport_name])
                shape = (numel,) if codec_name in RING_CODECS else (_rows(numel), -1)
                reduce = partial(cut.reduce, "bench", [buffer.view(shape)], transport, False)
                rows.append(row("cut", transport_name, codec_name, _time_op(reduce, reset, iters, warmup)))
    return rows


def _bench_reduce_scatter(nbytes: int, codecs: Sequence[str], transports: dict, iters: int, warmup: int,
                          flat: bool, node_groups: dict[str, NodeGroups]) -> list[dict]:
    """One size of ZeRO's exchange: each rank's chunk of the sum (torch's: chunk r; the ring's and the cut's:
    chunk r + 1, the layout ``ZeroShards.flatten_by_owner`` makes), its error against the exact chunk; busbw is
    algbw * (n-1)/n, nccl-tests' for a reduce-scatter. Codecs without a reduce-scatter (top-k, PowerSGD) are
    left out, as ZeRO all-reduces them."""
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = nbytes // 4 // n * n
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    exact = source.double()
    dist.all_reduce(exact)
    chunks, scale = exact.view(n, -1), exact.abs().max().clamp_min(1e-30)
    buffer = torch.empty_like(source)
    owned: list[torch.Tensor] = []

    def reset() -> None:
        buffer.copy_(source)
        owned.clear()

    def row(impl: str, transport: str, codec: str, seconds: float, chunk: int) -> dict:
        error = ((owned[0].double() - chunks[chunk]).abs().max() / scale).item() if numel else 0.0
        algbw = nbytes / seconds / 1e9
        values = (nbytes, n, impl, transport, codec, seconds, algbw, algbw * (n - 1) / n, error)
        return {**dict(zip(COLUMNS, values, strict=True)), "op": "reduce-scatter"}

    def torch_scatter() -> None:
        out = buffer.new_empty(numel // n)
        REDUCE_SCATTER(out, buffer)
        owned.append(out)

    def ours(reducer, transport) -> None:
        owned.append(reducer.reduce_scatter("bench", buffer, transport, False)[0])

    rows = [row("torch", dist.get_backend(), "none", _time_op(torch_scatter, reset, iters, warmup), rank)]
    for transport_name, transport in transports.items():
        for codec_name in (codec for codec in codecs if codec in RING_CODECS):
            if flat:
                timed = _time_op(partial(ours, make_reducer(codec_name), transport), reset, iters, warmup)
                rows.append(row("ring", transport_name, codec_name, timed, (rank + 1) % n))
            if transport_name in node_groups:
                cut = HierarchicalReducer(make_reducer(codec_name), node_groups[transport_name])
                timed = _time_op(partial(ours, cut, transport), reset, iters, warmup)
                rows.append(row("cut", transport_name, codec_name, timed, (rank + 1) % n))
    return rows


def _rows(numel: int) -> int:
    """The largest power of two <= sqrt(numel) that divides it: a square-ish matrix."""
    rows = 1
    while rows * 2 <= numel // (rows * 2) and numel % (rows * 2) == 0:
        rows *= 2
    return rows


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    return (text.human_size(r["bytes"]), r["ranks"], r["impl"], r["transport"], r["codec"], f"{r['time_s'] * 1e3:.3f}",
            f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}", f"{r['max_rel_error']:.2e}")

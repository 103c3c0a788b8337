"""``hpc bench memory``: per-rank memory of ZeRO stages 0-3 against torch's ZeroRedundancyOptimizer and FSDP2.

The built-in GPT (``jobs.models.gpt``) trains a few Adam steps on random tokens, every rank its
own batch. ``ours`` is the trainer's path (``jobs.train.loop.build_data_parallel_optimizer``:
the ring transport, ``parallel.zero`` = 0, 1, 2, 3; stage 3 with ``ZERO3_BUCKET_MB`` buckets, about one
transformer block each, the unit FSDP2 gathers here); ``torch-zero`` is
``torch.distributed.optim.ZeroRedundancyOptimizer`` (stage 1) under DDP on the same model
and batches; ``fsdp2`` is ``torch.distributed.fsdp.fully_shard`` (stage 3), when it runs.

Per rank, the largest over ranks: bytes of parameters with memory between steps (local shards for FSDP2, the
owned ones for our stage 3), of
gradients held after a step (``p.grad`` not None), of optimizer state (every tensor in
``optimizer.state``); ``peak_bytes`` is the growth of the process's resident set, sampled
after every backward and step, over its size before the model was built (after
``malloc_trim``; one untimed run first absorbs one-time costs): torch's CPU allocator
keeps no peak counter, and ``ru_maxrss`` is a high-water mark over the whole process,
which earlier rows would hide. It includes
activations, communication buffers and the allocator's slack. ``step_s`` is the median
over the timed steps of the slowest rank's step, from a second pass in which every implementation is built at
once and they step in turn (so a shared machine's load changes fall on all alike; ``step_alone_s`` is the
first pass's); ``step_vs_zero0`` and ``step_vs_fsdp2`` divide it by ``ours`` zero 0's and by FSDP2's.
``expect_*`` is the ZeRO paper's fp32
Adam count: parameters 4Ψ, gradients 4Ψ, optimizer 8Ψ, each divided by dp once the stage
shards it (1: optimizer; 2: + gradients; 3: + parameters).
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc import text

COLUMNS = ("impl", "zero", "dp", "param_bytes", "grad_bytes", "optim_bytes", "peak_bytes", "step_s",
           "expect_param_bytes", "expect_grad_bytes", "expect_optim_bytes")
HEADER = ("impl", "zero", "dp", "params MiB", "(paper)", "grads MiB", "(paper)", "optim MiB", "(paper)",
          "RSS peak MiB", "step(ms)", "vs zero0", "vs fsdp2")
GPT_SIZE = {"vocab_size": 512, "seq_len": 64, "d_model": 256, "n_heads": 4, "n_layers": 4}
ZERO3_BUCKET_MB = 4.0  # one block of GPT_SIZE is 3.0 MiB: our stage 3 gathers about what FSDP2 does per block
BATCH = 8  # sequences per rank per step


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _nbytes(tensors) -> int:
    """Bytes of the tensors that have memory (ZeRO-3 leaves others' parameters without any between steps)."""
    return sum(t.numel() * t.element_size() for t in tensors if t.untyped_storage().nbytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors: this rank's shard


def _batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    size = (BATCH, GPT_SIZE["seq_len"] + 1)
    tokens = [torch.randint(0, GPT_SIZE["vocab_size"], size, generator=generator) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _ours(zero: int, group: ProcessGroup, mesh):
    from hpc.config import spec_from_dict
    from hpc.observe.probe import Probe
    from jobs.models.gpt import gpt
    from jobs.train.loop import build_data_parallel_optimizer

    bucket = {"bucket_mb": ZERO3_BUCKET_MB} if zero == 3 else {}
    spec = spec_from_dict({"train": {"optimizer": "adam", "lr": 1e-3},
                           "parallel": {"zero": zero, "transport": "torch", **bucket}})
    model = gpt(**GPT_SIZE)
    return model, model, build_data_parallel_optimizer(spec, model, mesh, Probe())


def _torch_zero(group: ProcessGroup):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from jobs.models.gpt import gpt

    model = gpt(**GPT_SIZE)
    wrapped = DistributedDataParallel(model, process_group=group)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                        process_group=group)
    return model, wrapped, optimizer


def _fsdp2(group: ProcessGroup):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from jobs.models.gpt import gpt

    model = gpt(**GPT_SIZE)
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(forward, optimizer, inputs: torch.Tensor, targets: torch.Tensor, group: ProcessGroup) -> tuple[float, int]:
    """One timed training step, all ranks starting together; returns its seconds and the RSS after backward."""
    from jobs.models.gpt import lm_loss

    optimizer.zero_grad(set_to_none=True)
    dist.barrier(group=group)
    started = time.perf_counter()
    lm_loss(forward(inputs), targets).backward()
    after_backward = _rss()
    optimizer.step()
    return time.perf_counter() - started, after_backward


def _measure(build: Callable[[], tuple], group: ProcessGroup, steps: int, warmup: int) -> dict:
    """Bytes held and step time of one implementation; the model is gone when this returns."""
    _trim()
    dist.barrier(group=group)
    base = peak = _rss()
    model, forward, optimizer = build()
    times = []
    for inputs, targets in _batches(warmup + steps, dist.get_rank(group)):
        seconds, after_backward = _step(forward, optimizer, inputs, targets, group)
        times.append(seconds)
        peak = max(peak, after_backward, _rss())
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's state there
    state = [t for s in local.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = (_nbytes(_local(p) for p in model.parameters()),
            _nbytes(_local(p.grad) for p in model.parameters() if p.grad is not None),
            _nbytes(_local(t) for t in state), peak - base)
    if hasattr(optimizer, "close"):
        optimizer.close()
    values = torch.tensor(held, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    slowest = torch.tensor(times[warmup:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    params, grads, optim, peak_bytes = (int(v) for v in values.tolist())
    return {"param_bytes": params, "grad_bytes": grads, "optim_bytes": optim, "peak_bytes": peak_bytes,
            "step_s": statistics.median(slowest.tolist())}


def _interleaved_step_s(builds: Sequence[Callable[[], tuple]], group: ProcessGroup, steps: int,
                        warmup: int) -> list[float]:
    """Each implementation's median step (of the slowest rank), all built at once and stepped in turn, so the load
    of a shared machine falls on all of them alike: the ratios between rows are this pass's."""
    built = [build() for build in builds]
    times: list[list[float]] = [[] for _ in built]
    for i, (inputs, targets) in enumerate(_batches(warmup + steps, dist.get_rank(group))):
        for k, (_, forward, optimizer) in enumerate(built):
            seconds, _ = _step(forward, optimizer, inputs, targets, group)
            if i >= warmup:
                times[k].append(seconds)
    for _, _, optimizer in built:
        if hasattr(optimizer, "close"):
            optimizer.close()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return [statistics.median(row) for row in slowest.tolist()]


def expected(zero: int, dp: int, numel: int) -> dict:
    """The ZeRO paper's per-rank fp32 Adam bytes at ``zero`` over ``dp`` replicas of ``numel`` parameters."""
    return {"expect_param_bytes": 4 * numel // (dp if zero >= 3 else 1),
            "expect_grad_bytes": 4 * numel // (dp if zero >= 2 else 1),
            "expect_optim_bytes": 8 * numel // (dp if zero >= 1 else 1)}


def bench_memory(group: ProcessGroup, zeros: Sequence[int], impls: Sequence[str], steps: int = 3,
                 warmup: int = 1) -> list[dict]:
    """One row per (impl, stage) on the ranks of ``group`` (the whole world); every rank returns the same rows."""
    from hpc.runtime.mesh import MeshShape, build_mesh
    from jobs.models.gpt import gpt

    dp = dist.get_world_size(group)
    mesh = build_mesh(MeshShape(dp, 1, 1), dist.get_rank(group))
    numel = sum(p.numel() for p in gpt(**GPT_SIZE).parameters())
    runs = [("ours", z, lambda z=z: _ours(z, group, mesh)) for z in zeros if "ours" in impls]
    if "torch-zero" in impls:
        runs.append(("torch-zero", 1, lambda: _torch_zero(group)))
    if "fsdp2" in impls:
        runs.append(("fsdp2", 3, lambda: _fsdp2(group)))
    _measure(runs[0][2], group, 1, 1)  # untimed: one-time costs (threads, buffers) land in no row's RSS peak
    rows = []
    for impl, zero, build in runs:
        measured = _measure(build, group, steps, warmup)
        rows.append({"impl": impl, "zero": zero, "dp": dp, **measured, **expected(zero, dp, numel)})
    for row, step_s in zip(rows, _interleaved_step_s([build for _, _, build in runs], group, steps, warmup),
                           strict=True):
        row["step_alone_s"], row["step_s"] = row["step_s"], step_s
    for key, impl, zero in (("step_vs_zero0", "ours", 0), ("step_vs_fsdp2", "fsdp2", 3)):
        base = next((r["step_s"] for r in rows if r["impl"] == impl and r["zero"] == zero), None)
        for row in rows:
            row[key] = row["step_s"] / base if base else None
    return rows


def format_table(rows: Sequence[dict]) -> str:
    return text.format_table(HEADER, [_cells(r) for r in rows], right=True)


def _cells(r: dict) -> tuple[object, ...]:
    def mib(key: str) -> str:
        return f"{r[key] / 2**20:.2f}"

    def ratio(key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.2f}x"

    return (r["impl"], r["zero"], r["dp"], mib("param_bytes"), mib("expect_param_bytes"), mib("grad_bytes"),
            mib("expect_grad_bytes"), mib("optim_bytes"), mib("expect_optim_bytes"), mib("peak_bytes"),
            f"{r['step_s'] * 1e3:.1f}", ratio("step_vs_zero0"), ratio("step_vs_fsdp2"))

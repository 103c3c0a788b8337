"""``hpc bench train``: whole training steps of our data-parallel optimizer against torch's DDP.

A user compares steps, not all-reduces: this trains the built-in GPT on every rank's own
batch (the same batches, seed and Adam for every implementation) and reports, per
implementation, steps per second of the slowest rank, weak-scaling efficiency (steps/s
at n ranks over one process's steps/s on the same per-rank batch, measured in the same
run on rank 0 while the others wait) and the mean loss after the timed steps.

Implementations: ``ours-<transport>-<codec>`` is the trainer's path
(``jobs.train.loop.build_data_parallel_optimizer``), ``ddp`` is
``torch.nn.parallel.DistributedDataParallel`` and ``ddp-fp16`` / ``ddp-powersgd`` are DDP
with torch's own communication hooks. Rounds are interleaved (every implementation once
per round, from the same initial weights) so load on the machine spreads over all of them;
each implementation's steps/s is its median over rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc import text

GPT_SIZE = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 4}
BATCH = 8  # sequences per rank per step
LR = 1e-3
POWERSGD_RANK = 4
COMPRESSION_WARMUP = 2  # exact steps before a codec (ours) or PowerSGD (DDP's hook) starts, the same for both
HEADER = ("impl", "ranks", "steps/s", "vs ddp", "weak scaling", "loss", "|loss - ddp|")



def _batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2000 + rank)
    size = (BATCH, GPT_SIZE["seq_len"] + 1)
    tokens = [torch.randint(0, GPT_SIZE["vocab_size"], size, generator=generator) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _model(size: dict) -> torch.nn.Module:
    from jobs.models.gpt import gpt

    torch.manual_seed(0)
    return gpt(**size)


def _ours(transport: str, codec: str, mesh, size: dict,
          scope: str = "flat") -> tuple[torch.nn.Module, Callable, torch.optim.Optimizer]:
    from hpc.config import spec_from_dict
    from hpc.observe.probe import Probe
    from jobs.train.loop import build_data_parallel_optimizer

    spec = spec_from_dict({"train": {"optimizer": "adam", "lr": LR},
                           "parallel": {"transport": transport, "compression": codec, "compression_scope": scope,
                                        "powersgd_rank": POWERSGD_RANK,
                                        "compression_warmup_steps": COMPRESSION_WARMUP}})
    model = _model(size)
    return model, model, build_data_parallel_optimizer(spec, model, mesh, Probe())


def _ddp(hook: str, group: ProcessGroup, size: dict) -> tuple[torch.nn.Module, Callable, torch.optim.Optimizer]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    model = _model(size)
    # torch's PowerSGD hook waits on a collective inside a future callback, which runs on one of Gloo's two
    # worker threads: two buckets in flight deadlock it on CPU, so that row reduces the model as one bucket
    cap = {"bucket_cap_mb": 1024} if hook == "ddp-powersgd" else {}
    wrapped = DistributedDataParallel(model, process_group=group, **cap)
    if hook == "ddp-fp16":
        wrapped.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "ddp-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=COMPRESSION_WARMUP, use_error_feedback=True,
                                            warm_start=True)
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model, wrapped, torch.optim.Adam(model.parameters(), lr=LR)


def _single() -> tuple[torch.nn.Module, Callable, torch.optim.Optimizer]:
    model = _model(GPT_SIZE)
    return model, model, torch.optim.Adam(model.parameters(), lr=LR)


def _train(build: Callable[[], tuple], batches: Sequence[tuple], warmup: int) -> tuple[float, float]:
    """Seconds for the steps after ``warmup`` on this rank, and the last step's loss."""
    from jobs.models.gpt import lm_loss

    _, forward, optimizer = build()
    started = 0.0
    for index, (inputs, targets) in enumerate(batches):
        if index == warmup:
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(forward(inputs), targets)
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - started
    if hasattr(optimizer, "close"):
        optimizer.close()
    return elapsed, loss.item()


def _round(build: Callable[[], tuple], group: ProcessGroup, batches, warmup: int) -> tuple[float, float]:
    """Steps/s of the slowest rank and the loss averaged over ranks, for one implementation."""
    dist.barrier(group=group)
    elapsed, loss = _train(build, batches, warmup)
    values = torch.tensor([elapsed, loss], dtype=torch.float64)
    dist.all_reduce(values[:1], op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(values[1:], group=group)
    return (len(batches) - warmup) / float(values[0]), float(values[1]) / dist.get_world_size(group)


def _single_steps_per_s(group: ProcessGroup, batches, warmup: int) -> float:
    """One process's steps/s on the same per-rank batch: rank 0 trains alone while the others wait."""
    rate = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank(group) == 0:
        elapsed, _ = _train(_single, batches, warmup)
        rate[0] = (len(batches) - warmup) / elapsed
    dist.broadcast(rate, src=dist.get_global_rank(group, 0), group=group)
    return float(rate[0])


def implementations(transports: Sequence[str], codecs: Sequence[str], ddp: Sequence[str], group: ProcessGroup,
                    size: dict | None = None, scopes: Sequence[str] = ("flat",)) -> dict[str, Callable[[], tuple]]:
    """Name -> builder of (model, forward, optimizer) for each implementation asked for, on the GPT of ``size``;
    ours under each of ``scopes`` (``-inter-node`` in the name: the exchange cut by the launcher's nodes)."""
    import os

    from hpc.runtime.env import detect_rank_info
    from hpc.runtime.mesh import MeshShape, build_mesh

    size = size or GPT_SIZE
    n = dist.get_world_size(group)
    mesh = build_mesh(MeshShape(n, 1, 1), dist.get_rank(group), node_rank=detect_rank_info(os.environ).node_rank)
    runs: dict[str, Callable[[], tuple]] = {}
    for transport in transports:
        for codec in codecs:
            for scope in scopes:
                name = f"ours-{transport}-{codec}" + ("" if scope == "flat" else f"-{scope}")
                runs[name] = lambda t=transport, c=codec, s=scope: _ours(t, c, mesh, size, s)
    for hook in ddp:
        runs[hook] = lambda h=hook: _ddp(h, group, size)
    return runs


def bench_train(group: ProcessGroup, transports: Sequence[str], codecs: Sequence[str], ddp: Sequence[str],
                steps: int = 20, warmup: int = 3, rounds: int = 3, scopes: Sequence[str] = ("flat",)) -> list[dict]:
    """One row per implementation on the ranks of ``group`` (the whole world); every rank returns the same rows."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    runs = implementations(transports, codecs, ddp, group, scopes=scopes)
    batches = _batches(warmup + steps, rank)
    single = statistics.median(_single_steps_per_s(group, batches, warmup) for _ in range(rounds))
    rates: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, float] = {}
    for _ in range(rounds):
        for name, build in runs.items():
            rate, losses[name] = _round(build, group, batches, warmup)
            rates[name].append(rate)
    reference = next((name for name in ("ddp", *runs) if name in runs), None)
    rows = []
    for name in runs:
        rate = statistics.median(rates[name])
        rows.append({"impl": name, "ranks": n, "steps_per_s": rate, "steps_per_s_rounds": rates[name],
                     "single_steps_per_s": single, "weak_scaling": rate / single, "loss": losses[name],
                     "steps": steps, "reference": reference})
    for row in rows:
        ref = next(r for r in rows if r["impl"] == reference)
        row["vs_reference"] = row["steps_per_s"] / ref["steps_per_s"]
        row["loss_diff"] = abs(row["loss"] - ref["loss"])
    return rows


def format_table(rows: Sequence[dict]) -> str:
    cells = [(r["impl"], r["ranks"], f"{r['steps_per_s']:.2f}", f"{r['vs_reference']:.2f}x",
              f"{r['weak_scaling']:.0%}", f"{r['loss']:.6f}", f"{r['loss_diff']:.1e}") for r in rows]
    return text.format_table(HEADER, cells, right=True)

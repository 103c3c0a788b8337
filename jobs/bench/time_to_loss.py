"""``hpc bench train --target-loss``: wall time to a held-out loss, per gradient codec, against DDP.

Compression exists to save training time on slow links, so it is judged by time to a loss,
not by all-reduce time: every implementation trains the built-in GPT on the license texts
(``jobs.data.datasets.licenses``) from the same weights and batches, and every ``eval_every``
steps rank 0's held-out loss (the same fixed held-out windows each time) is recorded with
the wall time spent training so far; evaluation itself is not counted. Implementations are
``jobs.bench.train``'s: ``ours-<transport>-<codec>`` and ``ddp``, ``ddp-powersgd``.
The curves are what docs/PARALLELISM.md's plot shows; the first point at or under the target
is the time to loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hpc import text

HEADER = ("impl", "ranks", "time to loss (s)", "vs ddp", "steps", "final held-out", "vs ddp final", "s/step",
          "comm s/step")
HELD_OUT_WINDOWS = 64


def _held_out(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    from jobs.data.datasets import licenses

    held_out = licenses(seq_len).held_out
    pairs = [held_out[i] for i in range(min(HELD_OUT_WINDOWS, len(held_out)))]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def _train_batches(steps: int, batch: int, seq_len: int, rank: int, world: int) -> list[tuple]:
    """Every rank its own slice of the same global batch per step, as the trainer shards it."""
    from jobs.data.datasets import dp_shard, global_batch_indices, licenses

    train = licenses(seq_len).train
    batches = []
    for step in range(steps):
        indices = dp_shard(global_batch_indices(len(train), batch * world, 0, step), rank, world)
        pairs = train.__getitems__(indices.tolist())
        batches.append((torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])))
    return batches


def _held_out_loss(model: torch.nn.Module, held_out: tuple[torch.Tensor, torch.Tensor]) -> float:
    from jobs.models.gpt import lm_loss

    with torch.no_grad():
        model.eval()
        loss = lm_loss(model(held_out[0]), held_out[1]).item()
        model.train()
    return loss


def train_curve(build: Callable[[], tuple], batches: Sequence[tuple], held_out: tuple, eval_every: int,
                target: float | None, group: ProcessGroup, comm: list[float] | None = None) -> list[tuple]:
    """(training seconds so far, step, held-out loss) every ``eval_every`` steps, until the target (None: all
    the batches) or the end. ``comm``: our optimizer's seconds inside reductions each step are appended to it
    (``parallel.optimizer.CommStats``; DDP reports none)."""
    from jobs.models.gpt import lm_loss

    model, forward, optimizer = build()
    curve = [(0.0, 0, _held_out_loss(model, held_out))]
    trained = 0.0
    reached = torch.zeros(1)
    for step, (inputs, targets) in enumerate(batches, start=1):
        dist.barrier(group=group)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        lm_loss(forward(inputs), targets).backward()
        optimizer.step()
        trained += time.perf_counter() - started
        if comm is not None and hasattr(optimizer, "stats"):
            comm.append(optimizer.stats.reduce_seconds)
        if step % eval_every and step != len(batches):
            continue
        curve.append((trained, step, _held_out_loss(model, held_out)))
        if target is None:
            continue
        reached[0] = float(curve[-1][2] <= target)
        dist.broadcast(reached, src=dist.get_global_rank(group, 0), group=group)  # rank 0's model decides
        if reached[0]:
            break
    if hasattr(optimizer, "close"):
        optimizer.close()
    return curve


def bench_time_to_loss(group: ProcessGroup, runs: dict[str, Callable[[], tuple]], target: float, max_steps: int,
                       eval_every: int, batch: int, seq_len: int, full: bool = False) -> list[dict]:
    """One row per implementation, with its curve; every rank returns rank 0's rows. ``full``: every row trains
    all ``max_steps`` (the time to the target read off its curve), so final losses compare like for like."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    batches = _train_batches(max_steps, batch, seq_len, rank, n)
    held_out = _held_out(seq_len)
    rows = []
    for name, build in runs.items():
        comm: list[float] = []
        curve = train_curve(build, batches, held_out, eval_every, None if full else target, group, comm)
        reached = next(((t, s) for t, s, loss in curve if loss <= target), None)
        rows.append({"impl": name, "ranks": n, "target_loss": target, "curve": curve,
                     "time_to_loss_s": reached[0] if reached else None, "steps": curve[-1][1],
                     "final_loss": curve[-1][2], "s_per_step": curve[-1][0] / max(curve[-1][1], 1),
                     "comm_s_per_step": _slowest_mean(comm, group)})
    _compare(rows)
    return rows


def _slowest_mean(seconds: list[float], group: ProcessGroup) -> float | None:
    """The mean of ``seconds`` on the rank where it is largest (None where no rank recorded any: DDP)."""
    mean = torch.tensor([sum(seconds) / len(seconds) if seconds else -1.0], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return None if mean.item() < 0 else mean.item()


def _compare(rows: list[dict]) -> None:
    reference = next((r for r in rows if r["impl"] == "ddp"), rows[0])
    for row in rows:
        both = row["time_to_loss_s"] is not None and reference["time_to_loss_s"]
        row["reference"] = reference["impl"]
        row["time_vs_reference"] = row["time_to_loss_s"] / reference["time_to_loss_s"] if both else None
        row["final_vs_reference"] = row["final_loss"] / reference["final_loss"]


def format_table(rows: Sequence[dict]) -> str:
    def cells(r: dict) -> tuple:
        reached = "not reached" if r["time_to_loss_s"] is None else f"{r['time_to_loss_s']:.1f}"
        ratio = "-" if r["time_vs_reference"] is None else f"{r['time_vs_reference']:.2f}x"
        comm = "-" if r.get("comm_s_per_step") is None else f"{r['comm_s_per_step']:.3f}"
        return (r["impl"], r["ranks"], reached, ratio, r["steps"], f"{r['final_loss']:.4f}",
                f"{r['final_vs_reference']:.3f}", f"{r['s_per_step']:.3f}", comm)

    return text.format_table(HEADER, [cells(r) for r in rows], right=True)


def loss_curves_figure(rows: Sequence[dict]):
    """Held-out loss against training wall time, one line per implementation, the target dashed."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 4.0), layout="constrained")
    ax = figure.add_subplot()
    for row in rows:
        ax.plot([t for t, _, _ in row["curve"]], [loss for _, _, loss in row["curve"]], marker=".",
                linewidth=1.2, label=row["impl"])
    ax.axhline(rows[0]["target_loss"], linestyle="--", color="grey", linewidth=1, label="target")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"time to loss, {rows[0]['ranks']} data-parallel ranks")
    ax.legend()
    return figure

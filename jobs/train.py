"""The training loop every launcher runs: same spec, same batches, same result.

Each step takes the global batch (identical on every rank, see
``global_batch_indices``), keeps this data-parallel rank's slice, and averages
gradients over the DP group, so N ranks compute exactly what one process would
on the whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpc.bootstrap import World
from hpc.config import JobSpec
from hpc.mesh import Mesh
from hpc.metrics import MetricsLog
from hpc.progress import Progress
from jobs.datasets import Dataset, dp_shard, global_batch_indices, load_dataset
from jobs.models import MLP
from jobs.optim import build_optimizer, learning_rate
from parallel.compression import ErrorFeedback, make_codec
from parallel.data_parallel import average_gradients
from parallel.ring import make_transport


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float
    test_accuracy: float
    samples_per_s: float
    wall_s: float


def build_model(spec: JobSpec, dataset: Dataset) -> torch.nn.Module:
    torch.manual_seed(spec.job.seed)
    return MLP(dataset.num_features, spec.model.hidden_sizes, dataset.num_classes, spec.model.dropout)


def evaluate(model: torch.nn.Module, dataset: Dataset) -> float:
    model.eval()
    with torch.no_grad():
        predicted = model(dataset.x_test).argmax(dim=1)
    model.train()
    return (predicted == dataset.y_test).float().mean().item()


def train(spec: JobSpec, world: World, mesh: Mesh, progress_mode: str = "off") -> tuple[TrainResult, torch.nn.Module]:
    dataset = load_dataset(spec.data.name)
    model = build_model(spec, dataset)
    optimizer = build_optimizer(spec.train, model.parameters())
    dp_group, dp_rank, dp_size = mesh.group("dp"), mesh.index("dp"), mesh.size("dp")
    transport = make_transport(spec.parallel.transport, dp_group)
    codec = make_codec(spec.parallel.compression)
    feedback = ErrorFeedback()
    cfg = spec.train
    is_reporter = world.rank == 0
    progress = Progress(cfg.steps, cfg.log_every, progress_mode if is_reporter else "off")
    metrics = MetricsLog(spec.run_path / "metrics.jsonl") if is_reporter else None
    started = time.perf_counter()
    throughput = 0.0
    loss_value = float("nan")
    try:
        for step in range(cfg.steps):
            step_start = time.perf_counter()
            lr = learning_rate(cfg.lr, step, cfg.steps, cfg.warmup_steps, cfg.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = global_batch_indices(len(dataset.y_train), spec.data.batch_size, spec.job.seed, step)
            local = torch.from_numpy(dp_shard(batch, dp_rank, dp_size))
            loss = F.cross_entropy(model(dataset.x_train[local]), dataset.y_train[local])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(model.parameters(), transport, codec, feedback)
            grad_norm = None
            if cfg.grad_clip:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
            optimizer.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, group=dp_group)
            loss_value = mean_loss.item() / dp_size
            step_time = time.perf_counter() - step_start
            rate = spec.data.batch_size / step_time
            throughput = rate if step == 0 else 0.9 * throughput + 0.1 * rate
            progress.update(step, loss_value, lr, throughput)
            if metrics is not None:
                metrics.write(
                    {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                     "samples_per_s": rate, "step_time_s": step_time}
                )
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    wall = time.perf_counter() - started
    result = TrainResult(
        steps=cfg.steps,
        final_loss=loss_value,
        test_accuracy=evaluate(model, dataset),
        samples_per_s=cfg.steps * spec.data.batch_size / wall,
        wall_s=wall,
    )
    return result, model

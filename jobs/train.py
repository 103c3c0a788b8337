"""The training loop every launcher runs: same spec, same batches, same result, under any layout.

Each step takes the global batch (a pure function of (seed, step), identical on every
rank), keeps this data-parallel replica's slice, runs forward and backward over this
rank's share of the model (``jobs.workloads``: TP shards, pipeline stages through
``parallel.pipeline`` when there are several stages or microbatches), and averages
gradients over the DP group, so every layout computes what one process would on the
whole batch. Gradient clipping uses the global norm across TP and PP
(``parallel.clip``); the reported loss is the global batch's mean, which the last
pipeline stage holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc.bootstrap import World
from hpc.config import JobSpec, TrainConfig
from hpc.mesh import Mesh
from hpc.metrics import MetricsLog
from hpc.preemption import Preempted, Preemption
from hpc.progress import Progress
from jobs.layout import check_job_layout, uses_pipeline
from jobs.optim import build_optimizer, learning_rate
from jobs.state import TrainingCheckpoints
from jobs.workloads import Workload, build_workload, sum_over_replicas
from jobs.workloads import build_mlp as build_model
from parallel.clip import clip_grad_norm_
from parallel.optimizer import distributed_optimizer
from parallel.pipeline import run_pipeline_step
from parallel.reducers import make_reducer
from parallel.ring import make_transport
from parallel.schedule import Action, build_schedule
from parallel.tensor_parallel import tp_split_dims

# build_model: the MLP, which tests build as the single-process reference
__all__ = ["TrainResult", "base_learning_rate", "build_model", "clip_gradients", "forward_backward", "train"]


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float
    evaluation: Mapping[str, float]  # the workload's end-of-run measures (train_loss, test_accuracy, held_out_loss)
    throughput: float  # ``unit``s per second over the run
    unit: str  # samples (MLP) or tokens (GPT)
    wall_s: float

    @property
    def train_loss(self) -> float:
        """The MLP's loss on its whole training set."""
        return self.evaluation["train_loss"]


def base_learning_rate(cfg: TrainConfig, global_batch: int) -> float:
    """``train.lr``, scaled linearly with the global batch when ``train.lr_reference_batch`` is set."""
    return cfg.lr * global_batch / cfg.lr_reference_batch if cfg.lr_reference_batch else cfg.lr


def clip_gradients(model: torch.nn.Module, mesh: Mesh, max_norm: float) -> float:
    """Clip to the single-device model's global norm: TP shards counted on every TP rank, tensors
    replicated over TP on TP rank 0 only, summed over TP and PP. Returns the norm before clipping."""
    split = tp_split_dims(model)
    counted = [p for name, p in model.named_parameters() if name in split or mesh.index("tp") == 0]
    return clip_grad_norm_(model.parameters(), max_norm, counted=counted, groups=(mesh.group("tp"), mesh.group("pp")))


def forward_backward(
    workload: Workload, actions: list[Action] | None, pp_group: dist.ProcessGroup,
    inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
) -> float | None:
    """Accumulate this step's gradients; returns the replica's mean loss on its last pipeline stage, else None."""
    if actions is None:
        loss = workload.loss(workload.chunks[0](inputs), targets)
        loss.backward()
        return loss.item()
    return run_pipeline_step(
        actions, workload.chunks, pp_group, activation_shape=workload.activation_shape(len(inputs) // microbatches),
        loss_fn=workload.loss, inputs=inputs.chunk(microbatches), targets=targets.chunk(microbatches),
    ).loss


def train(
    spec: JobSpec, world: World, mesh: Mesh, progress_mode: str = "off", preemption: Preemption | None = None
) -> tuple[TrainResult, torch.nn.Module]:
    """Train on this rank's share; returns the result (the same on every rank) and that share of the model.

    Raises Preempted after a checkpoint when ``preemption`` caught a signal on any rank (hpc/preemption.py).
    """
    check_job_layout(spec, mesh.shape)
    workload = build_workload(spec, mesh)
    model = workload.model
    dp_group, dp_size, pp_group = mesh.group("dp"), mesh.size("dp"), mesh.group("pp")
    par = spec.parallel
    pipelined = uses_pipeline(par)
    actions = build_schedule(par.schedule, mesh.size("pp"), par.microbatches, par.virtual_stages)[
        mesh.index("pp")] if pipelined else None
    optimizer = distributed_optimizer(
        build_optimizer(spec.train, model.parameters()),
        make_transport(par.transport, dp_group),
        named_parameters=model.named_parameters(),
        reducer=make_reducer(par.compression, par.topk_fraction, par.powersgd_rank),
        bucket_bytes=int(par.bucket_mb * 2**20),
        backward_passes_per_step=par.microbatches if pipelined else 1,  # every microbatch's backward adds to .grad
        overlap=par.overlap,
        warmup_steps=par.compression_warmup_steps,
    )
    cfg = spec.train
    base_lr = base_learning_rate(cfg, spec.data.batch_size)
    items_per_step = spec.data.batch_size * workload.items_per_sample
    checkpoints = TrainingCheckpoints(spec, dist.group.WORLD, mesh, model, optimizer, optimizer.reducer)
    start_step = checkpoints.resume()
    is_reporter = world.rank == 0
    progress = Progress(cfg.steps, cfg.log_every, progress_mode if is_reporter else "off", workload.unit,
                        start_step=start_step)
    metrics = MetricsLog(spec.run_path / "metrics.jsonl") if is_reporter else None
    started = time.perf_counter()
    throughput = 0.0
    loss_value = float("nan")
    try:
        for step in range(start_step, cfg.steps):
            step_start = time.perf_counter()
            lr = learning_rate(base_lr, step, cfg.steps, cfg.warmup_steps, cfg.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = workload.batch(step)
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(workload, actions, pp_group, inputs, targets, par.microbatches)
            optimizer.synchronize()
            grad_norm = None
            if cfg.grad_clip:
                grad_norm = clip_gradients(model, mesh, cfg.grad_clip)
            with optimizer.skip_synchronize():
                optimizer.step()
            loss_value = sum_over_replicas([loss or 0.0], mesh)[0] / dp_size
            step_time = time.perf_counter() - step_start
            rate = items_per_step / step_time
            throughput = rate if step == start_step else 0.9 * throughput + 0.1 * rate
            progress.update(step, loss_value, lr, throughput)
            if metrics is not None:
                metrics.write(
                    {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                     f"{workload.unit}_per_s": rate, "step_time_s": step_time,
                     "comm_bytes": optimizer.stats.bytes_sent, "comm_s": optimizer.stats.reduce_seconds}
                )
            stop = preemption.agreed(dist.group.WORLD) if preemption is not None and step + 1 < cfg.steps else None
            checkpoints.after_step(step + 1, force=stop is not None)  # preempted: save now, off schedule
            if stop is not None:  # the requeued job resumes from this checkpoint
                checkpoints.finalize()
                raise Preempted(step + 1, stop, checkpointed=checkpoints.checkpointer is not None)
        checkpoints.finalize()
    finally:
        optimizer.close()
        progress.close()
        if metrics is not None:
            metrics.close()
    wall = time.perf_counter() - started
    result = TrainResult(
        steps=cfg.steps,
        final_loss=loss_value,
        evaluation=workload.evaluate(),
        throughput=(cfg.steps - start_step) * items_per_step / wall,
        unit=workload.unit,
        wall_s=wall,
    )
    return result, model

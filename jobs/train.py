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

import contextlib
import math
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc.config import JobSpec, TrainConfig
from hpc.observe.health import check_mesh
from hpc.observe.metrics import RANK_TOTALS, MetricsLog, peak_memory_bytes, write_rank_totals
from hpc.observe.probe import Probe
from hpc.observe.progress import Progress
from hpc.observe.stall import StallWatch
from hpc.observe.timeline import Timeline, merge_rank_files
from hpc.rundir import METRICS_FILE
from hpc.runtime.bootstrap import World
from hpc.runtime.mesh import Mesh
from hpc.runtime.preemption import Preempted, Preemption
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
    start_step: int = 0  # the step a resume started from; 0 for a fresh run

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
    inputs: torch.Tensor, targets: torch.Tensor, microbatches: int, probe: Probe | None = None,
) -> tuple[float | None, float]:
    """Accumulate this step's gradients. Returns the replica's mean loss on its last pipeline stage
    (else None) and the seconds spent waiting for pipeline messages."""
    probe = probe or Probe()
    if actions is None:
        with probe.span("forward"):
            loss = workload.loss(workload.chunks[0](inputs), targets)
        with probe.span("backward"):
            loss.backward()
        return loss.item(), 0.0
    stats = run_pipeline_step(
        actions, workload.chunks, pp_group, activation_shape=workload.activation_shape(len(inputs) // microbatches),
        loss_fn=workload.loss, inputs=inputs.chunk(microbatches), targets=targets.chunk(microbatches), probe=probe,
    )
    return stats.loss, max(0.0, stats.wall_s - stats.forward_s - stats.backward_s)


def build_probe(cfg: TrainConfig, world: World) -> Probe:
    """The run's timeline and stall inspector, as ``train.timeline`` and the world size ask."""
    timeline = Timeline(world.rank) if cfg.timeline else None
    stall = None
    if world.size > 1:
        stall = StallWatch.connect(world.rendezvous.addr, world.rendezvous.port, world.rank,
                                   cfg.stall_warn_s, cfg.stall_abort_s)
    return Probe(timeline, stall)


def train(
    spec: JobSpec, world: World, mesh: Mesh, progress_mode: str = "off", preemption: Preemption | None = None
) -> tuple[TrainResult, torch.nn.Module]:
    """Train on this rank's share; returns the result (the same on every rank) and that share of the model.

    Raises Preempted after a checkpoint when ``preemption`` caught a signal on any rank (hpc/preemption.py).
    """
    check_job_layout(spec, mesh.shape)
    probe = build_probe(spec.train, world)
    with probe.stall or contextlib.nullcontext():
        return _train(spec, world, mesh, progress_mode, preemption, probe)


def _train(
    spec: JobSpec, world: World, mesh: Mesh, progress_mode: str, preemption: Preemption | None, probe: Probe
) -> tuple[TrainResult, torch.nn.Module]:
    cfg = spec.train
    if cfg.health_check and world.size > 1:
        report = check_mesh(mesh, probe, cfg.health_check_timeout_s)
        if world.rank == 0:
            print("\n".join(report.lines()), flush=True)
    workload = build_workload(spec, mesh)
    model = workload.model
    dp_group, dp_size, pp_group = mesh.group("dp"), mesh.size("dp"), mesh.group("pp")
    everyone = range(world.size)
    par = spec.parallel
    pipelined = uses_pipeline(par)
    actions = build_schedule(par.schedule, mesh.size("pp"), par.microbatches, par.virtual_stages)[
        mesh.index("pp")] if pipelined else None
    optimizer = distributed_optimizer(
        build_optimizer(cfg, model.parameters()),
        make_transport(par.transport, dp_group),
        named_parameters=model.named_parameters(),
        reducer=make_reducer(par.compression, par.topk_fraction, par.powersgd_rank),
        bucket_bytes=int(par.bucket_mb * 2**20),
        backward_passes_per_step=par.microbatches if pipelined else 1,  # every microbatch's backward adds to .grad
        overlap=par.overlap,
        warmup_steps=par.compression_warmup_steps,
        probe=probe,
    )
    base_lr = base_learning_rate(cfg, spec.data.batch_size)
    items_per_step = spec.data.batch_size * workload.items_per_sample
    checkpoints = TrainingCheckpoints(spec, dist.group.WORLD, mesh, model, optimizer)
    start_step = checkpoints.resume()
    is_reporter = world.rank == 0
    progress = Progress(cfg.steps, cfg.log_every, progress_mode if is_reporter else "off", workload.unit,
                        start_step=start_step)
    metrics = MetricsLog(spec.run_path / METRICS_FILE) if is_reporter else None
    totals = dict.fromkeys(RANK_TOTALS, 0.0)
    grad_norm_peers = sorted({*mesh.members["tp"], *mesh.members["pp"]})
    if probe.timeline is not None:
        dist.barrier()  # time zero, the same instant on every rank
        probe.timeline.start()
    started = time.perf_counter()
    throughput = 0.0
    loss_value = float("nan")
    try:
        for step in range(start_step, cfg.steps):
            step_start = time.perf_counter()
            probe.set_step(step + 1)
            lr = learning_rate(base_lr, step, cfg.steps, cfg.warmup_steps, cfg.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with probe.span("data"):
                inputs, targets = workload.batch(step)
            optimizer.zero_grad(set_to_none=True)
            loss, pipeline_wait = forward_backward(workload, actions, pp_group, inputs, targets, par.microbatches,
                                                   probe)
            optimizer.synchronize()
            with probe.collective("gradient norm", "grad-norm", grad_norm_peers):
                grad_norm = clip_gradients(model, mesh, cfg.grad_clip or math.inf)
            with probe.span("optimizer step"), optimizer.skip_synchronize():
                optimizer.step()
            with probe.collective("loss all-reduce", "world", everyone):
                loss_value = sum_over_replicas([loss or 0.0], mesh)[0] / dp_size
            step_time = time.perf_counter() - step_start
            rate = items_per_step / step_time
            throughput = rate if step == start_step else 0.9 * throughput + 0.1 * rate
            progress.update(step, loss_value, lr, throughput)
            comm = optimizer.stats
            wait = comm.wait_seconds + pipeline_wait
            timings = {"step_time_s": step_time, "compute_s": step_time - wait,
                       "comm_s": comm.reduce_seconds + pipeline_wait, "wait_s": wait}
            for key, value in timings.items():
                totals[key] += value
            if metrics is not None:
                metrics.write(
                    {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                     f"{workload.unit}_per_s": rate, **timings,
                     "comm_bytes": comm.bytes_sent, "raw_bytes": comm.raw_bytes,
                     "compression_ratio": comm.raw_bytes / comm.bytes_sent if comm.bytes_sent else None,
                     "peak_memory_bytes": peak_memory_bytes(world.device)}
                )
            stop = None
            if preemption is not None and step + 1 < cfg.steps:
                with probe.collective("preemption check", "world", everyone):
                    stop = preemption.agreed(dist.group.WORLD)
            if checkpoints.due(step + 1, force=stop is not None):  # preempted: save now, off schedule
                with probe.span("checkpoint"):
                    checkpoints.save(step + 1)
            if stop is not None:  # the requeued job resumes from this checkpoint
                checkpoints.finalize()
                write_run_records(spec, world, probe, totals, step + 1 - start_step)
                raise Preempted(step + 1, stop, checkpointed=checkpoints.checkpointer is not None)
        checkpoints.finalize()
    finally:
        optimizer.close()
        progress.close()
        if metrics is not None:
            metrics.close()
    wall = time.perf_counter() - started
    write_run_records(spec, world, probe, totals, cfg.steps - start_step)
    result = TrainResult(
        steps=cfg.steps,
        final_loss=loss_value,
        evaluation=workload.evaluate(),
        throughput=(cfg.steps - start_step) * items_per_step / wall,
        unit=workload.unit,
        wall_s=wall,
        start_step=start_step,
    )
    return result, model


def write_run_records(spec: JobSpec, world: World, probe: Probe, totals: dict[str, float], steps: int) -> None:
    """Every rank's time totals and timeline spans, then rank 0 merges the timeline (collective)."""
    write_rank_totals(spec.run_path, world.rank, {
        "host": socket.gethostname(), "steps": steps, **totals, "peak_memory_bytes": peak_memory_bytes(world.device)})
    if probe.timeline is None:
        return
    probe.timeline.write_rank_file(spec.run_path)
    dist.barrier()
    if world.rank == 0:
        merge_rank_files(spec.run_path, world.size)

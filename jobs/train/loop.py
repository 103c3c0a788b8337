"""The training loop every launcher runs: same spec, same batches, same result, under any layout.

Each step takes the global batch (a pure function of (seed, step), identical on every
rank), keeps this data-parallel replica's slice, runs forward and backward over this
rank's share of the model (``jobs.train.workloads``: TP shards, pipeline stages through
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.config import JobSpec, TrainConfig
from hpc.errors import ConfigError, DeviceOutOfMemoryError, LayoutError, NodeUnhealthy
from hpc.observe.health import HealthReport, Link, check_mesh, check_nodes, slow_links
from hpc.observe.metrics import RANK_TOTALS, device_peak_flops, peak_memory_bytes, write_rank_totals
from hpc.observe.probe import Probe
from hpc.observe.profile import StepProfiler
from hpc.observe.progress import Progress
from hpc.observe.stall import StallWatch
from hpc.observe.straggler import Straggler, StragglerWatch
from hpc.observe.timeline import Timeline, merge_rank_files
from hpc.run_session import RunSession, spec_options
from hpc.runtime.bootstrap import World
from hpc.runtime.mesh import Mesh
from hpc.runtime.placement import out_of_memory, queued_copy_to_host, to_device
from hpc.runtime.preemption import Preempted
from jobs.train.checkpointing import LoopState, resume
from jobs.train.layout import check_job_layout, uses_pipeline
from jobs.train.optim import build_optimizer, freeze_parameters, learning_rate
from jobs.train.workloads import Workload, counted_targets, sum_over_replicas, token_weighted
from parallel.clip import clip_grad_norm_, scaled_step
from parallel.compression.registry import make_reducer
from parallel.ep import ExpertGroups, reduce_expert_gradients
from parallel.hierarchy import HierarchicalReducer, build_node_groups, dp_nodes, resolve_scope
from parallel.optimizer import CommStats, distributed_optimizer
from parallel.pipeline import StepStats, run_pipeline_step
from parallel.schedule import Action, build_schedule, lockstep_deadlock
from parallel.tensor_parallel import tp_split_dims
from parallel.tied import owned_first
from parallel.transport import Transport, make_transport

__all__ = ["StepReport", "StepRunner", "TrainResult", "base_learning_rate", "clip_gradients", "forward_backward",
           "freeze", "train"]


@dataclass(frozen=True)
class TrainResult:
    steps: int
    final_loss: float | None  # the last step's; with no steps left, the resumed checkpoint's (None: not recorded)
    evaluation: Mapping[str, float]  # the workload's end-of-run measures (held_out_loss, held_out_<metric>)
    throughput: float  # ``unit``s per second over the run
    unit: str  # samples, or tokens for integer sequences
    wall_s: float
    start_step: int = 0  # the step a resume started from; 0 for a fresh run
    mfu: float | None = None  # model FLOPs utilization over the run; None where the device's peak is unknown
    peak_memory_bytes: int = 0  # this rank's: the CUDA allocator's peak on a GPU, else the resident set's

    def as_record(self) -> dict[str, object]:
        """Flat, as result.json holds it: the evaluation's measures at the top level."""
        record: dict[str, object] = {}
        for key, value in asdict(self).items():
            record.update(value if isinstance(value, Mapping) else {key: value})
        return record


def base_learning_rate(cfg: TrainConfig, global_batch: int) -> float:
    """``train.lr``, scaled linearly with the global batch when ``train.lr_reference_batch`` is set."""
    return cfg.lr * global_batch / cfg.lr_reference_batch if cfg.lr_reference_batch else cfg.lr


def clip_gradients(model: torch.nn.Module, mesh: Mesh, max_norm: float, optimizer=None,
                   experts: tuple[ExpertGroups, list[torch.nn.Parameter]] | None = None,
                   uncounted: Sequence[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Clip to the single-device model's global norm: TP shards counted on every TP rank, tensors
    replicated over TP on TP rank 0 only, summed over TP and PP. Under ZeRO-2 (``optimizer.zero_stage``)
    each DP rank holds only its owners' gradients: it counts those, and the sum goes over DP too.
    With sharded ``experts`` (their groups and this rank's expert parameters) each EP rank counts its
    experts and EP rank 0 the dense rest, summed over the EP group too. Returns the norm before clipping, a 0-dim
    tensor on the gradients' device. A fused Adam/AdamW ``optimizer`` takes the clip factor into its next step,
    which must run inside ``parallel.clip.scaled_step`` (``parallel.clip``). ``uncounted``: copies another
    pipeline stage counts (tied embeddings' last-stage copy, ``parallel.tied``)."""
    split = tp_split_dims(model)
    sharded = optimizer is not None and getattr(optimizer, "zero_stage", 0) >= 2
    own, skip = ({id(p) for p in experts[1]} if experts else set()), {id(p) for p in uncounted}
    counted = [p for name, p in model.named_parameters() if p.requires_grad and id(p) not in skip
               and (name in split or mesh.index("tp") == 0)
               and (not sharded or optimizer.holds_gradient(p))
               and (not experts or id(p) in own or experts[0].ep_rank == 0)]
    groups = (mesh.group("tp"), mesh.group("pp"), *((mesh.group("dp"),) if sharded else ()),
              *((experts[0].ep_group,) if experts else ()))
    return clip_grad_norm_(model.parameters(), max_norm, counted=counted, groups=groups, optimizer=optimizer)


def forward_backward(
    workload: Workload, actions: list[Action] | None, pp: Transport,
    inputs: torch.Tensor, targets: torch.Tensor, microbatches: int, probe: Probe | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, StepStats | None]:
    """Accumulate this step's gradients; ``pp`` carries the pipeline's messages over its group. Returns the
    replica's mean loss (with targets marked -100, its share of the global mean times dp) on its last pipeline
    stage (else None) as a 0-dim tensor on the device (no host synchronization mid-step), and the pipeline's
    statistics (None without one: their times are read after the step's synchronization). ``loss_fn``: what
    each (micro)batch backpropagates (``StepRunner.step_loss``), default ``workload.loss``."""
    probe, loss_fn = probe or Probe(), loss_fn or workload.loss
    if actions is None:
        with probe.span("forward"):
            loss = loss_fn(workload.chunks[0](inputs), targets)
        with probe.span("backward"):
            loss.backward()
        return loss.detach(), None
    stats = run_pipeline_step(
        actions, workload.chunks, pp.group, activation_shape=workload.activation_shape(len(inputs) // microbatches),
        loss_fn=loss_fn, inputs=inputs.chunk(microbatches), targets=targets.chunk(microbatches), probe=probe,
        transport=pp, device=workload.device,
    )
    return stats.loss_sum, stats


def build_probe(cfg: TrainConfig, world: World, run_path: Path | None = None) -> Probe:
    """The run's timeline and stall inspector, as ``train.timeline`` and the world size ask; a stall abort is
    recorded in ``run_path``'s failures."""
    timeline = Timeline(world.rank) if cfg.timeline else None
    stall = None
    if world.size > 1:
        stall = StallWatch.connect(world.rendezvous.addr, world.rendezvous.port, world.rank,
                                   cfg.stall_warn_s, cfg.stall_abort_s, run_path)
    return Probe(timeline, stall)


def watch_groups(probe: Probe, mesh: Mesh, workload: Workload) -> None:
    """The groups whose collectives code holding no probe reports (TP layers and loss, EP all-to-alls), on
    channels named by axis and ranks (``tp group [0, 1]``), for the run's stall inspector."""
    probe.watch_group("tp", mesh.group("tp"), mesh.members["tp"])
    if workload.expert_groups is not None:
        probe.watch_group("ep", workload.expert_groups.ep_group, workload.expert_groups.ep_members)


def train(
    spec: JobSpec, world: World, mesh: Mesh, progress_mode: str = "off", run: RunSession | None = None
) -> tuple[TrainResult, torch.nn.Module]:
    """Train on this rank's share; returns the result (the same on every rank) and that share of the model.

    ``run``: the rank's run session (``hpc-rank`` starts it: ``hpc/run_session.py``), which resumes, saves, logs and
    watches for Slurm's warning signals; None: a session of ``spec``'s settings attached to ``world`` for this
    call. Raises Preempted after a checkpoint when the session's watch caught a signal on any rank.
    """
    check_job_layout(spec, mesh.shape)
    probe = build_probe(spec.train, world, spec.run_path)
    attached = RunSession(world, spec.run_path, **spec_options(spec)) if run is None else None
    try:
        with probe:  # the stall inspector's thread, and the groups it watches, for this run only
            return _train(spec, world, mesh, progress_mode, run or attached, probe)
    finally:
        if attached is not None:
            attached.close()


def check_links(report: HealthReport, cluster_name: str, rank: int) -> None:
    """Every rank alike: the slowest link under a quarter of the cluster file's model fails the health check; the
    rank it leads to raises (its host is named, and excluded by a restart with a spare), the others go on and see
    it leave."""
    from parallel.cluster import load_cluster

    cluster = load_cluster(cluster_name)

    def expected_s(link: Link) -> float:
        alpha, beta = cluster.link(1 if link.src_host == link.dst_host else cluster.devices_per_node + 1)
        return alpha + link.nbytes / beta

    slow = slow_links(report, expected_s)
    if slow and slow[0][0].dst == rank:
        link, want = slow[0]
        raise NodeUnhealthy(f"host {link.dst_host} failed its health check: the link {link} took "
                            f"{link.seconds / want:.1f}x the {want * 1e3:.2f} ms that {cluster.name}'s model gives",
                            rank=rank)


def _train(
    spec: JobSpec, world: World, mesh: Mesh, progress_mode: str, run: RunSession, probe: Probe
) -> tuple[TrainResult, torch.nn.Module]:
    """Build the step's parts, resume, then run the steps from where the last checkpoint left off."""
    if spec.train.health_check:
        lines = check_nodes(mesh, probe, spec.train.health_check_timeout_s, world.info.local_rank, spec.run_path)
        if world.size > 1:
            report = check_mesh(mesh, probe, spec.train.health_check_timeout_s)
            lines += report.lines()
            if spec.train.health_cluster:
                check_links(report, spec.train.health_cluster, world.rank)
        if world.rank == 0:
            print("\n".join(lines), flush=True)
    workload = Workload(spec, mesh)
    watch_groups(probe, mesh, workload)
    freeze(workload.model, spec.train.freeze, mesh)
    optimizer = build_data_parallel_optimizer(spec, workload.model, mesh, probe, exclude=workload.expert_params,
                                              owned_first=owned_first(workload.embedding_group, workload.model))
    steps = StepRunner(spec, workload, mesh, probe, optimizer)
    state = LoopState(workload.model, steps.optimizer, mesh, spec.parallel.ep, world.rank)
    start_step, resumed_loss = resume(spec, run, state)
    records = RunRecords(spec, run, workload, progress_mode, start_step, resumed_loss, probe)
    if probe.timeline is not None:
        dist.barrier()  # time zero, the same instant on every rank
        probe.timeline.start()
    profiler = StepProfiler(spec.train.profile_steps, spec.run_path, world.rank, mesh.device)
    started = records.restart_clock()
    try:
        for step in range(start_step, spec.train.steps):
            report = steps.run(step)
            with probe.span("step report"):  # the step before's, once the device finished it (a GPU's runs on)
                records.hold(report)
            profiler.step()
            _checkpoint_or_stop(spec, step + 1, run, state, probe, records, start_step)
        records.settle()
        run.wait_for_saves()
        steps.optimizer.unshard()  # ZeRO-3: the model whole again for evaluation and the caller
    except torch.OutOfMemoryError:
        records.settle()  # the last step that fitted, which the loop held, is in the metrics
        raise DeviceOutOfMemoryError(out_of_memory(mesh.device, world.rank, socket.gethostname())) from None
    finally:
        profiler.close()
        steps.optimizer.close()
        records.close()
    wall = time.perf_counter() - started
    ran = max(0, spec.train.steps - start_step)  # none where the checkpoint is past train.steps (lowered since)
    records.write(probe, ran)
    throughput = ran * records.items_per_step / wall
    result = TrainResult(
        steps=spec.train.steps,
        final_loss=records.loss,
        evaluation=workload.evaluate(),
        throughput=throughput,
        unit=workload.unit,
        wall_s=wall,
        start_step=start_step,
        mfu=records.mfu(throughput),
        peak_memory_bytes=peak_memory_bytes(world.device),
    )
    return result, workload.model


def freeze(model: torch.nn.Module, patterns: Sequence[str], mesh: Mesh) -> None:
    """``train.freeze`` on this rank's share of ``model`` (``jobs.train.optim.freeze_parameters``). A pattern that
    matches no parameter on any rank, or patterns that leave nothing to train, are one ConfigError, raised on
    every rank alike (collective over the world, when there are patterns)."""
    if not patterns:
        return
    matched = freeze_parameters(model, patterns)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    tally = torch.tensor([*matched, trainable], dtype=torch.int64, device=mesh.device)
    dist.all_reduce(tally)
    *hits, left = tally.tolist()
    missing = [pattern for pattern, hit in zip(patterns, hits, strict=True) if not hit]
    if missing:
        firsts: list[str | None] = [None] * dist.get_world_size()  # each rank's first name, the same everywhere
        dist.all_gather_object(firsts, next((name for name, _ in model.named_parameters()), None))
        example = ", ".join(repr(name) for name in dict.fromkeys(firsts) if name is not None)
        raise ConfigError(f"train.freeze: {missing[0]!r} matches no parameter name of the model (fnmatch over the "
                          f"single-device model's names, '*' crossing dots; they read like {example})")
    if not left:
        raise ConfigError(f"train.freeze={list(patterns)} leaves no parameter of the model to train")


def build_data_parallel_optimizer(spec: JobSpec, model: torch.nn.Module, mesh: Mesh, probe: Probe,
                                  exclude: list[torch.nn.Parameter] | None = None,
                                  owned_first: list[torch.nn.Parameter] | None = None):
    """The spec's optimizer, its gradients averaged over the DP group through the ring and the codec,
    except those of ``exclude`` (sharded experts: ``parallel.ep`` reduces them over their replicas). Frozen
    parameters (``train.freeze``) are in neither the optimizer nor a bucket (their hooks would never fire).
    ``owned_first``: what ZeRO gives the DP group's rank 0 (tied copies, ``parallel.tied``)."""
    par = spec.parallel
    split = tp_split_dims(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    tp_split = [p for name, p in trainable if name in split]
    excluded = {id(p) for p in exclude or ()}
    reducer = make_reducer(par.compression, par.topk_fraction, par.powersgd_rank)
    if resolve_scope(par.compression_scope, par.compression, dp_nodes(mesh)) == "inter-node":
        reducer = HierarchicalReducer(reducer, build_node_groups(mesh, par.transport))
    return distributed_optimizer(
        build_optimizer(spec.train, [p for _, p in trainable], mesh.group("tp"), tp_split),
        make_transport(par.transport, mesh.group("dp")),
        named_parameters=[(name, p) for name, p in trainable if id(p) not in excluded],
        reducer=reducer,
        bucket_bytes=int(par.bucket_mb * 2**20),
        backward_passes_per_step=par.microbatches if uses_pipeline(par) else 1,  # each microbatch adds to .grad
        overlap=par.overlap,
        warmup_steps=par.compression_warmup_steps,
        probe=probe,
        zero=par.zero,
        module=model,
        bucket_views=True,
        owned_first=owned_first,
    )


@dataclass(frozen=True)
class Batch:
    step: int
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # StepRunner.step_loss


@dataclass(frozen=True)
class StepOutcome:
    loss: float  # the global batch's mean, the same on every rank
    lr: float
    grad_norm: float  # before clipping
    pipeline_wait_s: float
    moe: Mapping[str, object] = field(default_factory=dict)  # Workload.moe_metrics(): empty for a dense model


@dataclass(frozen=True)
class StepReport:
    """A step's numbers as its queued work will leave them. On a GPU they are copied to the host behind that
    work and read (``outcome``) once the next step is queued, so the device goes from one step to the next
    with no idle gap while the host waits, then launches (a loop's ``loss.item()`` makes that gap each step)."""

    step: int
    lr: float
    numbers: torch.Tensor  # on the host once ``ready`` passed: [global loss sum, grad norm, MoE totals...]
    ready: object | None  # a CUDA event; None: ``numbers`` are there already
    replicas: int  # the DP size, which the loss sum is over
    comm: CommStats  # the optimizer's, this step's
    pipeline: StepStats | None
    moe_metrics: Callable[[Sequence[float]], Mapping[str, object]]  # Workload.moe_metrics

    def outcome(self) -> StepOutcome:
        """The numbers, waiting for the device to finish the step first when it has not."""
        if self.ready is not None:
            self.ready.synchronize()
        loss_sum, grad_norm, *moe = self.numbers.tolist()
        return StepOutcome(loss_sum / self.replicas, self.lr, grad_norm,
                           self.pipeline.wait_s if self.pipeline else 0.0, self.moe_metrics(moe))


class StepRunner:
    """One training step: the batch, forward and backward (pipelined or not), DP averaging, clipping, update."""

    def __init__(self, spec: JobSpec, workload: Workload, mesh: Mesh, probe: Probe, optimizer) -> None:
        self.cfg, self.par, self.workload, self.mesh, self.probe = spec.train, spec.parallel, workload, mesh, probe
        self.optimizer = optimizer
        self.base_lr = base_learning_rate(spec.train, spec.data.batch_size)
        schedule = build_schedule(self.par.schedule, mesh.size("pp"), self.par.microbatches, self.par.virtual_stages)
        self.actions = schedule[mesh.index("pp")] if uses_pipeline(self.par) else None
        self.pp = workload.pp_transport
        if self.actions is not None and self.pp.in_lockstep(mesh.device) and (why := lockstep_deadlock(schedule)):
            raise LayoutError(f"parallel.schedule={self.par.schedule!r} with pp={mesh.size('pp')} would hang or mix "
                              f"up messages under NCCL's rules: {why}", rank=mesh.rank)
        dp = mesh.members["dp"] if self.par.zero >= 2 else ()
        experts = workload.expert_groups.ep_members if workload.expert_groups else ()
        self.grad_norm_peers = sorted({*mesh.members["tp"], *mesh.members["pp"], *dp, *experts})
        self.everyone = range(mesh.shape.size)
        self.expert_params = [p for p in workload.expert_params if p.requires_grad]  # sharded experts not frozen
        self.may_mask = getattr(workload.data.train, "masks_targets", True)  # see step_loss
        self.prefetched: Batch | None = None  # the next step's, queued behind this step's work (see run)

    def run(self, step: int) -> StepReport:
        """Queue step ``step``'s work, reading nothing from the device: its report is read later."""
        cfg, probe, optimizer = self.cfg, self.probe, self.optimizer
        probe.set_step(step + 1)
        lr = learning_rate(self.base_lr, step, cfg.steps, cfg.warmup_steps, cfg.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = self.prefetched if self.prefetched is not None and self.prefetched.step == step else self.batch(step)
        self.prefetched = None
        optimizer.zero_grad(set_to_none=True)
        loss, pipeline = forward_backward(self.workload, self.actions, self.pp, batch.inputs, batch.targets,
                                          self.par.microbatches, probe, batch.loss_fn)
        optimizer.synchronize()
        groups = self.workload.expert_groups
        if groups is not None:
            with probe.collective("expert gradient all-reduce", "expert-grad", groups.replica_members):
                reduce_expert_gradients(self.expert_params, groups)
        tied, model = self.workload.embedding_group, self.workload.model
        if tied is not None:  # the first and last stage's copies of tied embeddings: one gradient, before clipping
            with probe.collective("tied gradient all-reduce", "embedding", tied.members):
                tied.reduce_gradients(model, optimizer.holds_gradient)
        with probe.collective("gradient norm", "grad-norm", self.grad_norm_peers):
            grad_norm = clip_gradients(model, self.mesh, cfg.grad_clip or math.inf, optimizer,
                                       (groups, self.expert_params) if groups is not None else None,
                                       tied.uncounted(model) if tied is not None else ())
        with probe.span("optimizer step"), optimizer.skip_synchronize(), scaled_step(optimizer):
            optimizer.step()
        if step + 1 < cfg.steps:  # read and copied while the device runs this step, not after its end
            self.prefetched = self.batch(step + 1)
        with probe.collective("loss all-reduce", "world", self.everyone):
            loss_sum = sum_over_replicas([loss], self.mesh)
        with (probe.collective("MoE totals all-reduce", "world", self.everyone) if self.workload.moe_names
              else contextlib.nullcontext()):
            moe = self.workload.moe_totals()
        numbers = torch.cat([loss_sum, grad_norm.to(loss_sum).view(1), *(() if moe is None else (moe,))])
        host, ready = queued_copy_to_host(numbers)  # the step's one read, after its work, on the host's schedule
        return StepReport(step, lr, host, ready, self.mesh.size("dp"), optimizer.stats, pipeline,
                          self.workload.moe_metrics)

    def batch(self, step: int) -> Batch:
        """Step ``step``'s share of the global batch on the device, and what it backpropagates."""
        with self.probe.span("data"):
            inputs, targets = self.workload.host_batch(step)
        loss_fn = self.step_loss(targets)
        return Batch(step, to_device(inputs, self.mesh.device), to_device(targets, self.mesh.device), loss_fn)

    def step_loss(self, targets: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """What each (micro)batch backpropagates, from this replica's host ``targets``: the workload's mean loss
        when every target of the global batch counts (the numbers exactly as ever); with targets marked -100
        (prompt tokens), the sum over a microbatch's counted targets / the global batch's count * dp * m, so that
        the pipeline's 1/m and the DP average make the global batch's mean over its counted targets, whatever
        the layout. The count is summed over the DP group (a collective of one integer, when dp > 1), unless the
        training set says it never marks a target (``masks_targets = False``, as the built-in sets do)."""
        if not self.may_mask:
            return self.workload.loss
        counted = counted_targets(targets)
        if counted is None:
            return self.workload.loss
        dp = self.mesh.size("dp")
        total = torch.tensor(counted, dtype=torch.int64)
        if dp > 1:
            with self.probe.collective("counted targets all-reduce", "token-count", self.mesh.members["dp"]):
                dist.all_reduce(total, group=self.mesh.group("dp"))
        if int(total) == targets.numel() * dp:
            return self.workload.loss
        m = self.par.microbatches if self.actions is not None else 1
        return token_weighted(self.workload.loss, dp * m / int(total) if int(total) else 0.0)


class RunRecords:
    """What a run reports: the progress line, rank 0's metrics.jsonl, every rank's time totals."""

    def __init__(self, spec: JobSpec, run: RunSession, workload: Workload, progress_mode: str, start_step: int,
                 loss: float | None = None, probe: Probe | None = None) -> None:
        self.spec, self.run, self.world, self.unit, self.start_step = spec, run, run.world, workload.unit, start_step
        self.probe = probe or Probe()  # where the host's wait for the device is registered (see settle)
        is_reporter = run.rank == 0
        self.progress = Progress(spec.train.steps, spec.train.log_every, progress_mode if is_reporter else "off",
                                 self.unit, start_step=start_step)
        self.totals = dict.fromkeys(RANK_TOTALS, 0.0)
        self.items_per_step = spec.data.batch_size * workload.items_per_sample
        self.throughput = 0.0
        self.flops_per_item = workload.flops_per_item
        self.peak_flops = device_peak_flops(run.device, spec.train.bf16_autocast)
        self.loss = loss  # the last step's; until one runs, the resumed checkpoint's (None: unknown)
        self.held: StepReport | None = None  # the step queued last, not yet reported
        self.clock = time.perf_counter()  # when the last step reported was seen done (or the loop started)
        train = spec.train
        self.watch = StragglerWatch(train.straggler_every, train.straggler_threshold, run.device) \
            if train.straggler_every else None  # collective: every rank makes it
        self.stragglers: list[Straggler] = []  # named at the last comparison, for the next metrics record
        self.last_ready: object | None = None  # that step's event on a GPU; None: time the next on the host

    def restart_clock(self) -> float:
        """The next step's time runs from now (the loop's start, or the end of a save); returns now."""
        self.clock, self.last_ready = time.perf_counter(), None
        return self.clock

    def hold(self, report: StepReport) -> None:
        """Keep a just-queued step's report; report the one held before, waiting for the device to finish it.
        A step whose numbers are on the host already (a CPU's) is reported at once."""
        self.settle()
        self.held = report
        if report.ready is None:
            self.settle()

    def settle(self) -> None:
        """Report the held step, if any, once the device finished it. Its time runs from the one before's end:
        on a GPU between the two steps' events, on the device's clock (the host sees steps end only when it
        looks, two at once at times); after a restart of the clock, and on a CPU, on the host's."""
        if self.held is None:
            return
        report, self.held = self.held, None
        with self.probe.device(report.step + 1) if report.ready is not None else contextlib.nullcontext():
            outcome = report.outcome()  # a GPU that hangs in a collective is named by what each rank issued
        now = time.perf_counter()
        if report.ready is not None and self.last_ready is not None:
            step_time = self.last_ready.elapsed_time(report.ready) / 1e3
        else:
            step_time = now - self.clock
        self.step_done(report.step, outcome, step_time, report.comm)
        self.clock, self.last_ready = now, report.ready

    def step_done(self, step: int, outcome: StepOutcome, step_time: float, comm) -> None:
        self.loss = outcome.loss
        rate = self.items_per_step / step_time
        self.throughput = rate if step == self.start_step else 0.9 * self.throughput + 0.1 * rate
        self.progress.update(step, outcome.loss, outcome.lr, self.throughput)
        wait = comm.wait_seconds + outcome.pipeline_wait_s
        timings = {"step_time_s": step_time, "compute_s": step_time - wait,
                   "comm_s": comm.reduce_seconds + outcome.pipeline_wait_s, "wait_s": wait}
        for key, value in timings.items():
            self.totals[key] += value
        if self.watch is not None:
            self.watch.add(timings["compute_s"])
            self.name_stragglers(step + 1)  # in this step's record: the last comparison's too
        if self.world.rank == 0:
            self.run.log(
                {"step": step + 1, "loss": outcome.loss, "lr": outcome.lr, "grad_norm": outcome.grad_norm,
                 f"{self.unit}_per_s": rate, **timings,
                 "comm_bytes": comm.bytes_sent, "raw_bytes": comm.raw_bytes,
                 "compression_ratio": comm.raw_bytes / comm.bytes_sent if comm.bytes_sent else None,
                 "peak_memory_bytes": peak_memory_bytes(self.world.device), "mfu": self.mfu(rate), **outcome.moe,
                 **({"stragglers": [s.record() for s in self.stragglers]} if self.stragglers else {})}
            )
            self.stragglers = []

    def name_stragglers(self, done: int) -> None:
        """When a comparison is due after ``done`` steps: every rank's step compute compared (collective, as each
        rank reports that step), and rank 0 names the stragglers, on its output and in the step's metrics record."""
        if self.watch is None or not self.watch.due(done):
            return
        named = self.watch.check()
        if self.world.rank == 0 and named:
            self.stragglers = named
            print("\n".join(f"[step {done}] {s.line()}" for s in named), flush=True)

    def mfu(self, items_per_s: float) -> float | None:
        """Model FLOPs utilization at a global rate: the model's FLOPs over every rank's device peak (ranks
        sharing a GPU count once each); None where the device's peak is unknown (a CPU)."""
        if self.peak_flops is None:
            return None
        return items_per_s * self.flops_per_item / (self.peak_flops * self.world.size)

    def write(self, probe: Probe, steps: int) -> None:
        write_run_records(self.spec, self.world, probe, self.totals, steps)

    def close(self) -> None:
        self.progress.close()


def _checkpoint_or_stop(spec: JobSpec, done: int, run: RunSession, state: LoopState, probe: Probe,
                        records: RunRecords, start_step: int) -> None:
    """Save when due; when any rank caught a preemption signal, save now and raise Preempted on every rank."""
    stop = None
    if run.watcher is not None and done < spec.train.steps:
        with probe.collective("preemption check", "world", range(records.world.size)):
            stop = run.stop_signal()
    every = spec.checkpoint.every_steps
    if every and (stop is not None or done % every == 0 or done == spec.train.steps):  # preempted: now, off schedule
        records.settle()  # the step's loss goes into the checkpoint
        with probe.span("checkpoint"):
            run.save(done, state, **({} if records.loss is None else {"loss": records.loss}))
        records.restart_clock()  # the next step's time leaves the save out
    local = spec.checkpoint.local_every_steps
    if local and done % local == 0 and done < spec.train.steps:  # not twice: save_local skips a step saved
        records.settle()
        with probe.span("local checkpoint"):
            run.save_local(done, state, **({} if records.loss is None else {"loss": records.loss}))
        records.restart_clock()
    if stop is not None:  # the requeued job resumes from this checkpoint
        records.settle()
        run.wait_for_saves()
        records.write(probe, done - start_step)
        raise Preempted(done, stop, checkpointed=bool(every))


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

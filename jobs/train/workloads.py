"""What the training loop needs from a model and its data, whatever the model and the (dp, tp, pp) layout.

A workload builds the full single-device model from the spec's entry and seed
(``jobs.models.protocol``: built-in or the user's) on the meta device, then keeps this rank's
share of it: the TP plan applied on the TP group, the experts sharded, then the pipeline
stages of this PP rank (``jobs.train.parallelize``); then gives that share the host build's
values, tensor by tensor on the device (``jobs.models.materialize``). A model that does not defer
its init that way is built whole on the host and then cut, as before. It draws this
data-parallel replica's batch, a pure function of (seed, step), and evaluates the model
on the held-out set at the end of a run. There is no per-model code here: the built-in
MLP and GPT go through the same protocol as a user's model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from hpc.config import JobSpec
from hpc.runtime.mesh import Mesh
from hpc.runtime.placement import to_device
from jobs.data.datasets import DataSplits, dp_shard, global_batch_indices
from jobs.data.protocol import build_data
from jobs.models.materialize import NotReplayable, build_on_meta
from jobs.models.moe import expert_parameters, moe_layers
from jobs.models.protocol import build_model, fused_head, tied_across_stages, tp_plan
from jobs.train.float8 import apply_float8
from jobs.train.parallelize import Stage, keep_stages, parallelize_ep, parallelize_tp
from parallel.ep import ExpertGroups, build_expert_groups
from parallel.tensor_parallel import IGNORE_INDEX, LinearCrossEntropy
from parallel.tied import EmbeddingGroup, build_embedding_group
from parallel.transport import TorchTransport, Transport, make_transport

EVAL_SAMPLES = 256  # held-out samples evaluated, spread evenly over the whole held-out set


def fetch(data: Any, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a map-style data set's ``indices``: a ``TensorDataset`` indexed once per tensor
    (a tenth of the per-sample path's time, on the step's critical path), else by ``__getitems__`` when the
    data set has it, else sample by sample, then collated."""
    if isinstance(data, TensorDataset):
        inputs, targets = data[torch.as_tensor(np.asarray(indices, dtype=np.int64))]
        return inputs, targets
    indices = [int(i) for i in indices]
    samples = data.__getitems__(indices) if hasattr(data, "__getitems__") else [data[i] for i in indices]
    inputs, targets = default_collate(samples)
    return inputs, targets


def _unit(sample_inputs: torch.Tensor) -> tuple[str, int]:
    """What throughput counts: tokens for integer sequences (ids), else samples."""
    if not sample_inputs.is_floating_point() and sample_inputs.dim() > 1:
        return "tokens", sample_inputs[0].numel()
    return "samples", 1


class Workload:
    """This rank's share of the spec's model and its data; see the module docstring."""

    def __init__(self, spec: JobSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh
        self.data: DataSplits = build_data(spec)
        self.device = mesh.device
        # seeded: the same full model on every rank; on meta (no memory yet), or whole on the host for a model
        # that does not defer its init (jobs/models/materialize.py)
        model, replay = build_on_meta(spec)
        sample_inputs, _ = fetch(self.data.train, [0])
        self.unit, self.items_per_sample = _unit(sample_inputs)
        self.flops_per_item = model_flops_per_item(model, sample_inputs, self.unit)
        self.hidden_shape = _hidden_shape(model, sample_inputs) if self._cut() else ()
        self.tp_group = mesh.group("tp") if mesh.size("tp") > 1 else None
        par = spec.parallel
        self.pp_transport = make_transport(par.transport, mesh.group("pp"))
        self.expert_groups: ExpertGroups | None = (
            build_expert_groups(mesh, par.ep, par.transport) if par.ep > 1 else None)
        # tied embeddings under pp > 1: a copy on the first and the last stage, kept equal (parallel/tied.py)
        tied = tied_across_stages(model) if mesh.size("pp") > 1 else []
        self.embedding_group: EmbeddingGroup | None = build_embedding_group(mesh, tied)
        self.built_on = "meta" if replay is not None else "host"  # where the model was built, and why
        self._cut_share(model)
        if replay is not None:
            try:  # each tensor of the share made on the host, sliced, moved to the device, the full one dropped
                replay.materialize(model, self.device, mesh.index("tp"))
            except NotReplayable as exc:  # the same values, from the whole model built on the host
                self.built_on = f"host: {exc}"
                model = build_model(spec)
                self._cut_share(model)
        model.to(self.device)  # this rank's share only (already there when materialized)
        if spec.train.float8 != "off":  # on the materialized share, before compile traces it
            apply_float8([block for chunk in self.chunks for block in chunk.blocks], spec.train.float8, self.device)
        if spec.train.compile:
            for chunk in self.chunks:
                chunk.compile_layers()
        self.model: nn.Module = model  # this rank's share, with the single-device parameter names
        # sharded experts: their gradients are reduced over their replicas, not the DP group (parallel/ep.py)
        self.expert_params = expert_parameters(model) if self.expert_groups else []

    def _cut_share(self, model: nn.Module) -> None:
        """Keep this rank's share of the full ``model`` (on meta or on the host; collective-free): the TP plan
        applied, the experts sharded, this pipeline rank's stages kept (``jobs.train.parallelize``)."""
        spec, mesh, train, par = self.spec, self.mesh, self.spec.train, self.spec.parallel
        self.split_output = parallelize_tp(model, tp_plan(model, spec), self.tp_group) if self.tp_group else False
        self.fused_head: LinearCrossEntropy | None = None
        if train.fused_head_loss:  # before the cut: the last stage's head module is this one
            self.fused_head = LinearCrossEntropy.from_head(
                fused_head(model), torch.bfloat16 if train.bf16_autocast else torch.float32)
            parent, _, child = model.head_name.rpartition(".")
            setattr(model.get_submodule(parent), child, self.fused_head)
            self.split_output = False
        self.moe_names = [name for name, _ in moe_layers(model)]  # every MoE layer, before the pipeline cut
        self.moe_experts = max((layer.n_experts for _, layer in moe_layers(model)), default=0)
        parallelize_ep(model, self.expert_groups, par.microbatches,
                       spec.data.batch_size // (mesh.size("dp") * par.microbatches))
        if getattr(model, "pipeline_parts", None) is None:
            self.chunks = [Stage([model], train.bf16_autocast, [model])]
        else:
            self.chunks = keep_stages(model, mesh.size("pp"), mesh.index("pp"), par.virtual_stages,
                                      train.bf16_autocast, train.activation_checkpointing, train.recompute)

    def moe_totals(self) -> torch.Tensor | None:
        """What the MoE layers routed since the last call, over the global batch, as one float64 tensor
        on the device, all-reduced (collective over the world when the model has MoE layers) but not read:
        ``moe_metrics`` reads it. None for a dense model."""
        if not self.moe_names:
            return None
        totals = torch.zeros(len(self.moe_names), self.moe_experts + 4, dtype=torch.float64, device=self.device)
        for name, layer in moe_layers(self.model):  # this rank's stages
            row, index = layer.stats.vector(self.device), self.moe_names.index(name)
            layer.stats.reset()
            if self.mesh.index("tp") == 0:  # TP peers route the same tokens
                totals[index] = row
        dist.all_reduce(totals)
        return totals.view(-1)

    def moe_metrics(self, totals: Sequence[float]) -> dict[str, Any]:
        """From ``moe_totals``, read: kept tokens per expert of each MoE layer, the fraction of routed choices
        dropped, the mean load-balancing loss. Empty for a dense model."""
        if not self.moe_names:
            return {}
        width = self.moe_experts + 4
        rows = [totals[i * width:(i + 1) * width] for i in range(len(self.moe_names))]
        dropped, routed, aux_sum, calls = (sum(column) for column in zip(*(row[-4:] for row in rows), strict=True))
        return {"moe_tokens_per_expert": [[round(x) for x in row[:-4]] for row in rows],
                "moe_dropped_fraction": dropped / routed if routed else 0.0,
                "moe_aux_loss": aux_sum / calls if calls else 0.0}

    def _cut(self) -> bool:
        return self.mesh.size("pp") * self.spec.parallel.virtual_stages > 1

    def activation_shape(self, rows: int) -> tuple[int, ...]:
        """What crosses a pipeline stage boundary for a microbatch of ``rows`` samples."""
        return (rows, *self.hidden_shape)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel replica's (inputs, targets) at ``step`` on the device, identical on its TP and PP
        ranks."""
        inputs, targets = self.host_batch(step)
        return to_device(inputs, self.device), to_device(targets, self.device)

    def host_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch(step)`` as the data set gives it (on the host: what is counted there costs no device sync)."""
        train, cfg = self.data.train, self.spec
        sampler = getattr(train, "batch_indices", None)
        indices = (sampler(step, cfg.data.batch_size, cfg.job.seed) if sampler is not None
                   else global_batch_indices(len(train), cfg.data.batch_size, cfg.job.seed, step))
        return fetch(train, dp_shard(np.asarray(indices), self.mesh.index("dp"), self.mesh.size("dp")))

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a (micro)batch from the last stage's output (over its counted targets: not -100); with
        ``train.fused_head_loss`` that output is the head's input, and the fused head makes the loss."""
        if self.fused_head is not None:
            return self.fused_head(output, targets)
        if self.split_output:
            return self.model.loss(output, targets, tp_group=self.tp_group)
        return self.model.loss(output, targets)

    def evaluate(self) -> dict[str, float]:
        """Mean loss (and the model's ``metrics``) on up to ``EVAL_SAMPLES`` held-out samples, split over
        the DP replicas; the same on every rank (collective). Empty without a held-out set.

        Each replica runs its share in forwards of a training microbatch's samples at most, which training has
        shown to fit: 256 samples in one forward would make logits of 256 x seq_len x vocabulary (at 2048 tokens
        and Llama 3's 128k, 134 GB in bf16) at the end of a run that fitted all along. Where experts are sharded,
        every replica runs as many forwards as the largest share needs (their EP peers' all-to-alls pair them):
        a replica out of samples runs one sample (the first) and does not count it."""
        held_out = self.data.held_out
        if held_out is None:
            return {}
        picks = np.linspace(0, len(held_out) - 1, min(EVAL_SAMPLES, len(held_out))).astype(int)
        shares = np.array_split(picks, self.mesh.size("dp"))
        local = shares[self.mesh.index("dp")]
        rows = max(1, self.spec.data.batch_size // (self.mesh.size("dp") * self.spec.parallel.microbatches))
        forwards = -(-len(shares[0] if self.expert_groups is not None else local) // rows)
        sums: dict[str, float] = {}
        self.model.eval()
        with torch.no_grad():
            for first in range(0, forwards * rows, rows):
                part = local[first:first + rows]
                counted = len(part) > 0
                # the same on every TP and PP rank of this replica, so their collectives match
                inputs, targets = (to_device(t, self.device) for t in fetch(held_out, part if counted else picks[:1]))
                output = forward_through_stages(self.chunks, self.mesh.group("pp"), inputs,
                                                self.activation_shape(len(inputs)), self.pp_transport)
                if output is not None:  # every TP rank: a loss on vocabulary-split logits is collective
                    measures = self._measures(output, targets, len(inputs))
                    if self.mesh.index("tp") == 0 and counted:
                        sums = {name: sums.get(name, 0.0) + value for name, value in measures.items()}
        self.model.train()
        return _mean_over_reports(sums)

    def _measures(self, output: torch.Tensor, targets: torch.Tensor, count: int) -> dict[str, float]:
        """Count-weighted sums of the held-out loss and the model's metrics on one replica's share; the loss
        weighted by the counted targets instead where some are -100 (its mean is over those)."""
        counted = counted_targets(targets)
        weight = float(count) if counted is None or counted == targets.numel() else count * counted / targets.numel()
        loss = self.loss(output, targets).item() * weight if weight else 0.0
        sums = {"count": float(count), "loss_weight": weight, "held_out_loss": loss}
        metrics = getattr(self.model, "metrics", None)
        if metrics is not None:
            sums.update({f"held_out_{name}": value * count for name, value in metrics(output, targets).items()})
        return sums


def model_flops_per_item(model: nn.Module, sample_inputs: torch.Tensor, unit: str) -> float:
    """Training FLOPs per token (or sample) of the whole model, what MFU counts: 6 per parameter (2 forward,
    4 backward) plus attention's 12 L s h per token where the model tells its depth L and width h (a
    transformers config, or ``n_layers``/``d_model``), as PaLM's appendix B counts them."""
    flops = 6.0 * sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(model, "n_layers", None)
    width = getattr(config, "hidden_size", None) or getattr(model, "d_model", None)
    if unit == "tokens" and layers and width:
        flops += 12.0 * layers * sample_inputs.shape[-1] * width
    return flops


def _hidden_shape(model: nn.Module, sample_inputs: torch.Tensor) -> tuple[int, ...]:
    """The shape per sample of what ``first`` hands the blocks: one sample through it (on the meta device when
    the model is there), without touching the RNG (dropout) or the model's mode."""
    first = model.pipeline_parts()[0] if getattr(model, "pipeline_parts", None) else None
    if first is None:
        return ()
    was_training = model.training
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        model.eval()
        hidden = first(sample_inputs.to(next(first.parameters(), sample_inputs).device))  # meta for a meta build
    model.train(was_training)
    return tuple(hidden.shape[1:])


def _mean_over_reports(sums: dict[str, float]) -> dict[str, float]:
    """Each measure's count-weighted mean over the ranks that report one (collective over the world)."""
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    reports = [entry for entry in gathered if entry]
    count = sum(entry["count"] for entry in reports)
    weights = {"held_out_loss": sum(entry["loss_weight"] for entry in reports)}  # the counted targets' share
    means = {}
    for name in (name for name in (reports[0] if reports else {}) if name not in ("count", "loss_weight")):
        weight = weights.get(name, count)
        means[name] = sum(entry[name] for entry in reports) / weight if weight else float("nan")
    return means


def forward_through_stages(
    chunks: Sequence[nn.Module], group: dist.ProcessGroup, inputs: torch.Tensor, activation_shape: Sequence[int],
    transport: Transport | None = None,
) -> torch.Tensor | None:
    """Forward only, stage after stage (no microbatches, no backward): the last stage's output on
    the rank that holds it, None elsewhere. For evaluation, where a schedule would buy nothing.
    Messages go through ``transport`` (the pipeline's; default torch.distributed's), on the inputs' device."""
    transport = transport or TorchTransport(group)
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    last = p * len(chunks) - 1
    x = inputs
    for stage in range(rank, last + 1, p):
        if stage > 0 and p > 1:
            x = torch.empty(tuple(activation_shape), device=inputs.device)
            transport.recv(x, (stage - 1) % p).wait()
        x = chunks[stage // p](x)
        if stage < last and p > 1:
            transport.send(x.contiguous(), (stage + 1) % p).wait()
    return x if rank == last % p else None


def counted_targets(targets: torch.Tensor) -> int | None:
    """The targets a loss counts: those not ``IGNORE_INDEX`` (-100); None for floating-point targets, which
    are values, never a mark."""
    if targets.is_floating_point():
        return None
    return int((targets != IGNORE_INDEX).sum())


def token_weighted(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   scale: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss`` (a mean over a microbatch's counted targets) turned into their sum times ``scale``; 0, with
    no gradient, for a microbatch without a counted target (where a mean is 0/0). On the device: no sync."""

    def weighted(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counted = (targets != IGNORE_INDEX).sum()
        mean = loss(output, targets)
        return torch.where(counted > 0, mean * (counted * scale), torch.zeros_like(mean))

    return weighted


def sum_over_replicas(values: Sequence[torch.Tensor | None], mesh: Mesh) -> torch.Tensor:
    """Sums over the DP replicas of 0-dim tensors held by the last pipeline stage (None elsewhere), on every
    rank: a float64 tensor on the device, not read (the caller reads it after the step).

    One all-reduce over the whole mesh in float64, to which only the ranks of the last
    stage with TP index 0 contribute (their TP peers hold the same numbers).
    """
    reports = mesh.index("pp") == mesh.size("pp") - 1 and mesh.index("tp") == 0
    if reports:
        totals = torch.stack([value.detach().to(torch.float64) for value in values])
    else:
        totals = torch.zeros(len(values), dtype=torch.float64, device=mesh.device)
    dist.all_reduce(totals)
    return totals

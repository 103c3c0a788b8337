"""Apply a tensor-parallel plan to a single-device model, and cut it into pipeline stages.

The plan maps module-name patterns to styles (``jobs.models.protocol.TP_STYLES``); each
matching ``nn.Linear`` or ``nn.Embedding`` is swapped, in place, for the layer of
``parallel.tensor_parallel`` holding this rank's slice (taken from the full module,
so a seed means the same weights under every layout). Pipeline cuts follow the
model's ``pipeline_parts()``: the blocks split into ``pp * virtual_stages`` equal
chunks, ``first`` joining stage 0 and ``last`` the last stage; a weight both use (tied
embeddings) stays on both, one copy each (``parallel.tied`` keeps them equal), and the TP
shards of a weight shared whole are shared alike. Modules a rank does not hold become
``Elsewhere`` placeholders, so the parameters it keeps have their single-device names, and
checkpoints and comparisons speak of the same tensors under every layout.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from hpc.errors import LayoutError
from hpc.observe.probe import group_collective
from jobs.models.moe import moe_layers
from jobs.models.protocol import check_pipeline, check_tied_split, plan_targets
from parallel.ep import ExpertGroups
from parallel.pipeline import split_into_stages
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def _tp_layer(module: nn.Module, style: str, group: ProcessGroup) -> nn.Module:
    if style == "replicated_with_grad_allreduce":
        for param in module.parameters():
            param.register_hook(functools.partial(_sum_over_tp, group=group))
        return module
    if style == "rowwise":
        return RowParallelLinear.from_full(module, group)
    if isinstance(module, nn.Embedding):  # vocab, embedding_rowwise
        return VocabParallelEmbedding.from_full(module, group)
    gather = style in ("colwise_gather_output", "colwise_rep")
    return ColumnParallelLinear.from_full(module, group, gather_output=gather)


def _sum_over_tp(grad: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """A whole weight used on each rank's share of the heads: its gradient is the sum of the shares'."""
    grad = grad.clone(memory_format=torch.contiguous_format)
    with group_collective(group, "gradient all-reduce"):
        dist.all_reduce(grad, group=group)  # counted by the stall inspector on the TP group's channel
    return grad


def parallelize_tp(model: nn.Module, plan: Mapping[str, str], group: ProcessGroup) -> bool:
    """Swap the plan's modules for tensor-parallel ones (collective-free). True when the model's
    output stays split over the vocabulary (a ``vocab`` Linear): its loss then needs ``tp_group``."""
    check_tied_split(model, plan)
    split_output = False
    swapped: dict[int, nn.Module] = {}  # id of a whole weight -> the first TP layer made of it
    for _, style, module, name in plan_targets(model, plan):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = _tp_layer(module, style, group)
        tied = swapped.setdefault(id(getattr(module, "weight", layer)), layer)
        if tied is not layer:  # a weight shared whole (tied embeddings): the shards are shared alike
            layer.weight = tied.weight
        setattr(parent, child, layer)
        split_output |= style == "vocab" and isinstance(module, nn.Linear)
    return split_output


def parallelize_ep(model: nn.Module, groups: ExpertGroups | None, microbatches: int, sequences: int = 0) -> None:
    """Shard every MoE layer's experts over the EP group (``parallel.ep``; collective-free), the experts this
    rank does not hold replaced by ``Elsewhere``; scale their aux losses as the pipeline scales the loss.
    ``sequences``: what every rank routes per training forward (its share of a microbatch)."""
    for name, layer in moe_layers(model):
        layer.loss_scale = 1.0 / microbatches
        if groups is None:
            continue
        layer.placement = groups.placement(layer.n_experts, sequences)
        for index in range(layer.n_experts):
            if not layer.placement.holds(index):
                layer.experts[index] = Elsewhere(f"{name}.experts.{index}", "expert-parallel")


class Stage(nn.Module):
    """One pipeline chunk as the executor calls it: its layers in order, under the run's autocast,
    the model's blocks optionally recomputed in backward instead of keeping their activations."""

    def __init__(self, layers: Sequence[nn.Module], bf16_autocast: bool, blocks: Collection[nn.Module] = (),
                 recompute: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.bf16_autocast = bf16_autocast
        self.blocks = [layer for layer in layers if any(layer is block for block in blocks)]  # the model's blocks
        self.recompute = {id(layer) for layer in self.blocks} if recompute else set()

    def compile_layers(self) -> None:
        """``torch.compile`` each layer in place (``nn.Module.compile``: names, parameters and checkpoints stay
        the module's): one graph per block, reused by every block of the same shape."""
        for layer in self.layers:
            layer.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False) if id(layer) in self.recompute else layer(x)
        return x


class Elsewhere(nn.Module):
    """Stands in for a module another pipeline (or expert-parallel) rank holds, keeping the names of the
    modules this rank holds."""

    def __init__(self, name: str, axis: str = "pipeline") -> None:
        super().__init__()
        self.name, self.axis = name, axis

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise LayoutError(f"{self.name} is held by another {self.axis} rank; run this rank's share instead")


def keep_stages(model: nn.Module, p: int, rank: int, v: int, bf16_autocast: bool, recompute: bool) -> list[Stage]:
    """Cut ``model.pipeline_parts()`` into p*v stages and keep pipeline rank ``rank``'s v chunks,
    replacing every module it does not hold by ``Elsewhere``."""
    first, blocks, last = model.pipeline_parts()
    blocks = list(blocks)
    final = p * v - 1
    chunks = []
    for k, chunk in enumerate(split_into_stages(blocks, p, v)[rank]):
        stage = k * p + rank
        layers = [*([first] if stage == 0 else []), *chunk, *([last] if stage == final else [])]
        chunks.append(Stage(layers, bf16_autocast, chunk, recompute))
    held = {id(param) for stage in chunks for param in stage.parameters()}
    if p * v > 1:
        check_pipeline(model, p * v, f"parallel.pp * virtual_stages = {p}*{v}")
    _drop_unheld(model, held, "")
    return chunks


def _drop_unheld(module: nn.Module, held: set[int], prefix: str) -> None:
    """Replace each child holding parameters, none of them held, by ``Elsewhere``; recurse into the rest."""
    for name, child in list(module.named_children()):
        params = [id(param) for param in child.parameters()]
        if params and not held.intersection(params):
            setattr(module, name, Elsewhere(prefix + name))
        elif params:
            _drop_unheld(child, held, f"{prefix}{name}.")

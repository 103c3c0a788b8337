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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

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


# The products train.recompute = "selective" keeps: matrix products and every SDPA kernel this torch has.
SELECTIVELY_KEPT_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))


def keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective recompute policy (torchtitan's op-level SAC, torchtitan/distributed/activation_checkpoint.py
    ``_apply_op_sac``): keep what the matrix products and attention output, nearly all of a block's FLOPs, and
    recompute in backward only the elementwise ops between them (norms, activations, rotary, residual adds),
    cheap to redo but most of the bytes a block keeps. Collectives (the TP all-reduces) are recomputed, as full
    checkpointing does, by every rank alike."""
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVELY_KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class Recomputed(nn.Module):
    """A block run under ``checkpoint``: recomputed in backward whole (``policy="full"``) or all but its
    products (``"selective"``: ``keep_products``)."""

    def __init__(self, block: nn.Module, policy: str) -> None:
        super().__init__()
        self.block = block
        self.context_fn = (functools.partial(create_selective_checkpoint_contexts, keep_products)
                           if policy == "selective" else noop_context_fn)

    def compile(self, *args, **kwargs) -> None:
        """Full: the block compiled, the checkpoint around it. Selective: the checkpoint compiled with the block
        inside (torchtitan's order), so the compiler keeps what ``keep_products`` keeps: around compiled code the
        policy would only see the calls the kernels make."""
        if self.context_fn is noop_context_fn:
            self.block.compile(*args, **kwargs)
        else:
            super().compile(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


class Stage(nn.Module):
    """One pipeline chunk as the executor calls it: its layers in order, under the run's autocast,
    the model's blocks optionally recomputed in backward (``Recomputed``) instead of keeping their activations."""

    def __init__(self, layers: Sequence[nn.Module], bf16_autocast: bool, blocks: Collection[nn.Module] = (),
                 recompute: bool = False, policy: str = "full"):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.bf16_autocast = bf16_autocast
        self.blocks = [layer for layer in layers if any(layer is block for block in blocks)]  # the model's blocks
        recomputed = {id(layer) for layer in self.blocks} if recompute else set()
        # what forward calls, not registered: the parameters stay the layers' (and their names the model's)
        self.calls = [Recomputed(layer, policy) if id(layer) in recomputed else layer for layer in layers]

    def compile_layers(self) -> None:
        """``torch.compile`` each layer in place (``nn.Module.compile``: names, parameters and checkpoints stay
        the module's): one graph per block, reused by every block of the same shape."""
        for call in self.calls:
            call.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast):
            for call in self.calls:
                x = call(x)
        return x


class Elsewhere(nn.Module):
    """Stands in for a module another pipeline (or expert-parallel) rank holds, keeping the names of the
    modules this rank holds."""

    def __init__(self, name: str, axis: str = "pipeline") -> None:
        super().__init__()
        self.name, self.axis = name, axis

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise LayoutError(f"{self.name} is held by another {self.axis} rank; run this rank's share instead")


def keep_stages(model: nn.Module, p: int, rank: int, v: int, bf16_autocast: bool, recompute: bool,
                policy: str = "full") -> list[Stage]:
    """Cut ``model.pipeline_parts()`` into p*v stages and keep pipeline rank ``rank``'s v chunks,
    replacing every module it does not hold by ``Elsewhere``; ``recompute``: their blocks by ``policy``."""
    first, blocks, last = model.pipeline_parts()
    blocks = list(blocks)
    final = p * v - 1
    chunks = []
    for k, chunk in enumerate(split_into_stages(blocks, p, v)[rank]):
        stage = k * p + rank
        layers = [*([first] if stage == 0 else []), *chunk, *([last] if stage == final else [])]
        chunks.append(Stage(layers, bf16_autocast, chunk, recompute, policy))
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

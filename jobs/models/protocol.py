"""The model protocol: how ``model.entry`` brings any torch model (``hpc.entry`` loads it; the data's
protocol is ``jobs.data.protocol``). The built-in models are entries like any other (``BUILTIN_MODELS``).
docs/USER_MODELS.md is the user's guide; in short:

A model is a single-device ``nn.Module`` (built under ``torch.manual_seed(job.seed)``) with

- ``loss(output, targets) -> Tensor``: the batch's mean loss (required). When its
  plan keeps the output split over the vocabulary (``vocab`` on a Linear), the trainer
  passes ``tp_group=`` too (``jobs.models.gpt.lm_loss`` takes it);
- ``pipeline_parts() -> (first, blocks, last)`` (for ``parallel.pp > 1``): ``first``
  runs before the first block on the first stage (embeddings), ``blocks`` are equal
  modules mapping one activation shape to itself (cut into ``pp * virtual_stages``
  chunks), ``last`` runs after the last block on the last stage (norm, head); a weight ``first`` and
  ``last`` share (tied embeddings) is held by both stages and kept equal (``parallel.tied``);
- ``tp_plan`` (for ``parallel.tp > 1``): module-name patterns (``*`` stands for one
  name, e.g. ``layers.*.mlp.up_proj``) to a style of ``TP_STYLES``, the spelling of the
  ``base_model_tp_plan`` that ``transformers`` configs carry; ``[model.tp_plan]`` in the
  spec adds to it or overrides it;
- ``tp_divisors`` (optional): spec key -> a count the TP degree must divide (attention heads);
- ``metrics(output, targets) -> dict[str, float]`` (optional): batch means reported on
  the held-out set as ``held_out_<name>``;
- ``head_name`` (optional, for ``train.fused_head_loss``): the name of the bias-free Linear whose output
  are the logits ``loss`` takes its next-token cross-entropy of; the trainer swaps it for
  ``parallel.tensor_parallel.LinearCrossEntropy``, which passes its input through, and computes the loss
  from that input and the head's weight a chunk of tokens at a time.

Mixture-of-experts layers (``jobs.models.moe.MoE``) anywhere in the model need nothing more: the
trainer shards their experts over ``parallel.ep`` and reports their routing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpc.entry import call_entry, load_entry
from hpc.errors import ConfigError, LayoutError

if TYPE_CHECKING:
    from torch import nn

    from hpc.config import JobSpec, ModelConfig

# style -> what it does (aliases are transformers' spellings); STYLE_MODULES: what it applies to.
TP_STYLES = {
    "colwise": "Linear: output features split, the output stays split (feeds a rowwise layer)",
    "rowwise": "Linear: input features split, partial products summed: the output is whole",
    "colwise_gather_output": "Linear: output features split, then gathered: the output is whole",
    "colwise_rep": "Linear: as colwise_gather_output (older transformers spelling)",
    "vocab": "Embedding: rows (the vocabulary) split; Linear: logits split over the vocabulary, "
             "the loss gets tp_group",
    "embedding_rowwise": "Embedding: as vocab (transformers spelling)",
    "replicate": "left whole on every rank",
    "replicated_with_grad_allreduce": "whole on every rank, but applied to split activations (per-head norms): "
                                      "its gradients are summed over the TP group",
}

STYLE_MODULES = {"vocab": "Linear or Embedding", "embedding_rowwise": "Embedding", "replicate": "",
                 "replicated_with_grad_allreduce": "",
                 **dict.fromkeys(("colwise", "rowwise", "colwise_gather_output", "colwise_rep"), "Linear")}

BUILTIN_MODELS = {"mlp": "jobs.models.mlp:mlp", "gpt": "jobs.models.gpt:gpt"}


def model_entry(spec: JobSpec) -> tuple[str, dict[str, Any]]:
    """The model's entry and keyword arguments: ``model.entry`` or the built-in ``model.kind``."""
    model = spec.model
    if model.entry:
        return model.entry, dict(model.args)
    if model.kind == "mlp":
        return BUILTIN_MODELS["mlp"], {"hidden_sizes": model.hidden_sizes, "dropout": model.dropout}
    return BUILTIN_MODELS["gpt"], {"vocab_size": model.vocab_size, "seq_len": model.seq_len, "d_model": model.d_model,
                                   "n_heads": model.n_heads, "n_layers": model.n_layers, "dropout": model.dropout,
                                   "seed": spec.job.seed, **moe_args(model)}


def moe_args(model_cfg: ModelConfig) -> dict[str, int | float]:
    """The spec's ``model.moe_*`` settings as ``gpt()``'s keyword arguments (none for a dense model)."""
    if not model_cfg.moe_experts:
        return {}
    names = ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef")
    return {name: getattr(model_cfg, name) for name in names}


def build_model(spec: JobSpec) -> nn.Module:
    """The full single-device model, the same for a seed on every rank."""
    import torch

    entry, args = model_entry(spec)
    function = load_entry(entry, "model.entry")
    torch.manual_seed(spec.job.seed)
    model = call_entry(function, args, entry, "model.entry")
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "loss", None)):
        raise ConfigError(f"model.entry={entry!r} must return a torch.nn.Module with a loss(output, targets) method, "
                          f"got {type(model).__name__}")
    return model


def tp_plan(model: nn.Module, spec: JobSpec) -> dict[str, str]:
    """The model's own plan with the spec's ``[model.tp_plan]`` over it."""
    return {**dict(getattr(model, "tp_plan", None) or {}), **dict(spec.model.tp_plan)}


def _pattern(name_pattern: str) -> re.Pattern[str]:
    return re.compile(r"[^.]+".join(re.escape(part) for part in name_pattern.split("*")))


def plan_targets(model: nn.Module, plan: Mapping[str, str]) -> list[tuple[str, str, nn.Module, str]]:
    """(pattern, style, module, module name) for every module the plan splits; checks every entry first."""
    from torch import nn

    named = dict(model.named_modules())
    targets = []
    for name_pattern, style in plan.items():
        key = f"model.tp_plan.{name_pattern!r}"
        if style not in TP_STYLES:
            raise ConfigError(f"{key} = {style!r} is not a style we apply (valid: {', '.join(TP_STYLES)})")
        regex = _pattern(name_pattern)
        matched = [(name, module) for name, module in named.items() if name and regex.fullmatch(name)]
        if not matched:
            raise ConfigError(f"{key} matches no module of the model (e.g. {next(iter(named.keys() - {''}), '-')})")
        for name, module in matched:
            is_linear, is_embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
            wanted = STYLE_MODULES[style]
            fits = not wanted or ("Linear" in wanted and is_linear) or ("Embedding" in wanted and is_embedding)
            if not fits:
                raise ConfigError(f"{key} = {style!r} applies to an nn.{wanted}, but {name} is a "
                                  f"{type(module).__name__}")
            if style != "replicate":
                targets.append((name_pattern, style, module, name))
    return targets


def split_size(module: nn.Module, style: str) -> tuple[int, str]:
    """The dimension a style splits, and what it is, for the divisibility check."""
    if style in ("vocab", "embedding_rowwise") and hasattr(module, "num_embeddings"):
        return module.num_embeddings, "vocabulary rows"
    if style == "rowwise":
        return module.in_features, "input features"
    return module.out_features, "output features"


def check_tp(model: nn.Module, spec: JobSpec, tp: int) -> None:
    """Raise naming the key when the plan cannot split this model over ``tp`` ranks (pure: no process group)."""
    if tp == 1:
        return
    for key, count in dict(getattr(model, "tp_divisors", None) or {}).items():
        if count % tp:
            raise LayoutError(f"{key}={count} is not divisible by parallel.tp={tp}")
    plan = tp_plan(model, spec)
    if not plan:
        raise LayoutError(f"parallel.tp={tp}, but the model has no tp_plan: give one in [model.tp_plan] "
                          f"(module-name patterns to {', '.join(TP_STYLES)})")
    check_tied_split(model, plan)
    for name_pattern, style, module, name in plan_targets(model, plan):
        if style == "replicated_with_grad_allreduce":
            continue  # nothing split
        size, what = split_size(module, style)
        if size % tp:
            raise LayoutError(f"model.tp_plan.{name_pattern!r} ({style}): {name} has {size} {what}, "
                              f"not divisible by parallel.tp={tp}")


def check_pipeline(model: nn.Module, chunks: int, key_hint: str) -> None:
    """Raise when the model cannot be cut into ``chunks`` equal pipeline chunks."""
    if chunks == 1:
        return
    parts = getattr(model, "pipeline_parts", None)
    if parts is None:
        raise LayoutError(f"{key_hint} = {chunks} pipeline chunks, but the model has no pipeline_parts(): "
                          "it cannot be cut into stages (docs/USER_MODELS.md)")
    _, blocks, _ = parts()
    if len(blocks) < chunks or len(blocks) % chunks:
        raise LayoutError(f"the model's {len(blocks)} blocks cannot be cut into {key_hint} = {chunks} equal "
                          "pipeline chunks")


def shared_parameters(model: nn.Module, first: nn.Module, last: nn.Module) -> list[str]:
    """Names of the parameters both ``first`` and ``last`` use."""
    both = {id(param) for param in first.parameters()} & {id(param) for param in last.parameters()}
    return [name for name, param in model.named_parameters() if id(param) in both]


def tied_across_stages(model: nn.Module) -> list[str]:
    """Names of the parameters the first and the last pipeline part share (tied embeddings): under
    ``parallel.pp > 1`` the first and the last stage each hold a copy, kept equal over the embedding group
    (``parallel.tied``). Empty for a model without ``pipeline_parts()``."""
    parts = getattr(model, "pipeline_parts", None)
    if parts is None:
        return []
    first, _, last = parts()
    return shared_parameters(model, first, last)


def split_dim(module: nn.Module, style: str | None) -> int | None:
    """The dimension of ``module.weight`` a plan style splits (None: whole)."""
    if style in (None, "replicate", "replicated_with_grad_allreduce"):
        return None
    return 1 if style == "rowwise" else 0


def check_tied_split(model: nn.Module, plan: Mapping[str, str]) -> None:
    """Raise when modules sharing a weight (tied embeddings) would split it differently: their shards are tied
    as the whole weights were (``jobs.train.parallelize``), so every holder must cut it alike."""
    styles = {name: style for _, style, _, name in plan_targets(model, plan)}
    holders: dict[int, list[tuple[str, int | None]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append((name, split_dim(module, styles.get(name))))
    for held in holders.values():
        if len({dim for _, dim in held}) > 1:
            cuts = ", ".join(f"{name} ({'whole' if dim is None else f'split on dim {dim}'})" for name, dim in held)
            raise LayoutError(f"model.tp_plan: {cuts} share one weight (tied embeddings): split them alike "
                              "(e.g. embedding_rowwise and colwise_gather_output, or replicate both)")


def check_model_layout(spec: JobSpec, tp: int, pp: int, virtual: int) -> nn.Module:
    """Build the model on the meta device (no memory, no init cost) and check the layout cuts it; returns it."""
    import torch

    with torch.device("meta"):
        model = build_model(spec)
    check_tp(model, spec, tp)
    check_pipeline(model, pp * virtual, f"parallel.pp * virtual_stages = {pp}*{virtual}")
    if spec.train.activation_checkpointing and getattr(model, "pipeline_parts", None) is None:
        raise ConfigError("train.activation_checkpointing recomputes the model's blocks: it needs pipeline_parts()")
    if spec.train.fused_head_loss:
        fused_head(model)
    return model


def fused_head(model: nn.Module) -> nn.Module:
    """The LM head ``train.fused_head_loss`` fuses with the loss (the model's ``head_name``), checked: a
    bias-free Linear (or its TP shard) and no ``metrics`` reading the logits."""
    name = getattr(model, "head_name", None)
    where = f"train.fused_head_loss: {type(model).__name__}"
    if name is None:
        raise ConfigError(f"{where} names no head_name (the Linear making its logits); jobs.models.hf's causal "
                          "LMs and the built-in GPT do")
    if getattr(model, "metrics", None) is not None:
        raise ConfigError(f"{where} has metrics(), which read the logits the fused loss never makes whole")
    try:
        head = model.get_submodule(name)
    except AttributeError:
        raise ConfigError(f"{where}.head_name={name!r} is not a module of the model") from None
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if weight is None or weight.dim() != 2 or bias is not None:
        raise ConfigError(f"{where}.head_name={name!r} is {type(head).__name__}, not a Linear without bias")
    return head

"""Tied weights across pipeline stages: Megatron's embedding group.

A model whose first and last pipeline parts share a weight (tied embeddings: the input embedding is the
LM head, as in Llama 3.2, Qwen2.5, Gemma) keeps it under ``parallel.pp > 1`` as two copies: the first
stage's (the embedding) and the last stage's (the head). Both start equal (each rank materializes the same
single-device tensor, or reads the same checkpoint tensor), and after the data-parallel reduction and before
clipping their gradients are summed over the embedding group: the first and the last stage of one pipeline,
pipeline ranks 0 and p - 1 with the same (dp, tp) coordinates. Each copy then holds the single-device
gradient (the embedding's part plus the head's), the optimizer steps both alike, and the copies stay bitwise
equal (a sum of two is the same either way round). The global gradient norm counts the tensor once: on the
first stage (``uncounted`` lists the last stage's copies). Under ZeRO the copies must be stepped by the same DP
index on both stages (at stage 2 and 3 only the owner keeps the gradient), so every DP group's rank 0 owns
them (``owned_first``). A checkpoint holds the tensor once, under its first name (the embedding's), which
both copies write as replicas and both read.

Groups are made by every rank, in the same order (``build_embedding_group``), as the mesh's are.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hpc.runtime.mesh import Mesh, MeshShape


def embedding_group_ranks(shape: MeshShape) -> list[tuple[int, int]]:
    """Every pipeline's (first stage, last stage) global ranks, one pair per (dp, tp) coordinate; none at pp = 1."""
    if shape.pp == 1:
        return []
    return [(shape.rank_of(dp, tp, 0), shape.rank_of(dp, tp, shape.pp - 1))
            for dp in range(shape.dp) for tp in range(shape.tp)]


@dataclass
class EmbeddingGroup:
    """This rank's embedding group and the names of the tied weights it holds a copy of."""

    group: ProcessGroup
    members: tuple[int, int]  # global ranks: the first stage's, the last stage's
    first: bool  # whether this rank holds the first stage's copy
    names: tuple[str, ...]  # the tied weights, by the first name the single-device model gives them

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """This rank's copies in ``model`` (its share), in the same order on both ranks."""
        named = dict(model.named_parameters())
        return [named[name] for name in self.names]

    def uncounted(self, model: nn.Module) -> list[nn.Parameter]:
        """The copies a global gradient norm leaves out here: the last stage's (the first stage counts them)."""
        return [] if self.first else self.parameters(model)

    def reduce_gradients(self, model: nn.Module, holds_gradient: Callable[[torch.Tensor], bool]) -> None:
        """Sum each trained copy's gradient with the other stage's (collective over the group), where this rank
        keeps it (``holds_gradient``: ZeRO-2's owners; both ranks decide alike, see ``owned_first``)."""
        for param in self.parameters(model):
            if not param.requires_grad or not holds_gradient(param):
                continue
            if param.grad is None:  # unused on this stage this step: it adds nothing
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self.group)


def build_embedding_group(mesh: Mesh, names: Sequence[str]) -> EmbeddingGroup | None:
    """Create every pipeline's embedding group (collective: every rank calls it, in the same order, with the same
    ``names``: the model's weights tied across its first and last pipeline parts); this rank's, or None where
    there is none (no tied weights, pp = 1, a middle stage)."""
    if not names:
        return None
    timeout = None if mesh.timeout_s is None else datetime.timedelta(seconds=mesh.timeout_s)
    mine = None
    for ranks in embedding_group_ranks(mesh.shape):
        group = dist.new_group(list(ranks), timeout=timeout)  # the mesh's timeout, as its groups
        if mesh.rank in ranks:
            mine = EmbeddingGroup(group, ranks, ranks[0] == mesh.rank, tuple(names))
    return mine


def owned_first(group: EmbeddingGroup | None, model: nn.Module) -> list[nn.Parameter]:
    """The parameters ZeRO must give every DP group's rank 0 (``parallel.zero``): the tied copies, so that the
    same DP index steps them on both stages."""
    return [] if group is None else group.parameters(model)

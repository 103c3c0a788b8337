"""A small byte-level GPT, written as plain single-device code.

Parallelism is applied from outside, through the model protocol (``jobs.models.protocol``):
``tp_plan`` splits attention by heads (the QKV projection column-parallel, its output
projection row-parallel), the MLP column then row, and the token embedding and the LM
head over the vocabulary (the logits stay split; ``loss`` then takes the TP group);
``pipeline_parts()`` cuts ``[embedding, *blocks, head]`` into stages. LayerNorms,
position embeddings and row-parallel biases stay whole on every rank. Two choices
make that possible without touching this file:

- the fused QKV projection lays its outputs out head by head (``[head, q|k|v,
  head_dim]``, as Megatron does), so a contiguous split of its rows is a split by
  heads, and attention infers how many heads it holds from the tensor it gets;
- dropout only acts on full-width activations (embedding output and the residual
  branches), which every TP rank holds whole, so the same seed drops the same units
  under every tensor-parallel layout.

Weights are drawn from a private generator seeded by the caller (GPT-2's scheme:
N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)), so a seed means
the same model wherever and however it is built.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jobs.models.materialize import run_init
from jobs.models.moe import MoE
from jobs.models.protocol import moe_args
from parallel.tensor_parallel import IGNORE_INDEX, cross_entropy, mean_over_counted

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hpc.config import ModelConfig

INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.head_dim = d_model // n_heads
        # Outputs ordered [head, q|k|v, head_dim]. No bias: a key bias shifts every score of a
        # query by the same amount, so softmax ignores it and its gradient is rounding noise
        # that Adam would blow up into updates.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        qkv = self.qkv(x).view(batch, time, -1, 3, self.head_dim)  # -1: the heads this module holds
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [batch, heads, time, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln_attention = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = mlp if mlp is not None else MLP(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.ln_attention(x)))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class Embedding(nn.Module):
    """Token plus learned position embeddings: the first pipeline stage's own layer."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = self.positions.num_embeddings
        if ids.shape[-1] > seq_len:
            raise ValueError(f"sequence of {ids.shape[-1]} tokens is longer than seq_len={seq_len}")
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


class Head(nn.Module):
    """Final LayerNorm and the (untied) projection to the vocabulary: the last pipeline stage's layer."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.linear = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.ln(x))


class GPT(nn.Module):
    head_name = "head.linear"  # the LM head, for train.fused_head_loss (jobs.models.protocol)
    tp_plan = types.MappingProxyType({
        "embedding.tokens": "vocab", "blocks.*.attention.qkv": "colwise", "blocks.*.attention.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise", "head.linear": "vocab",
    })

    def __init__(
        self, vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int, dropout: float = 0.0,
        moe: MoESettings | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.d_model, self.n_heads, self.n_layers = vocab_size, d_model, n_heads, n_layers
        self.embedding = Embedding(vocab_size, seq_len, d_model, dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout, moe.layer(i, d_model) if moe else None)
                                    for i in range(n_layers))
        self.head = Head(d_model, vocab_size)
        self.tp_divisors = {"model.n_heads": n_heads}  # attention is split by heads
        if moe and moe.every == 1:  # no dense MLP left for the plan to split (experts stay whole under TP)
            self.tp_plan = {key: style for key, style in GPT.tp_plan.items() if ".mlp." not in key}

    def pipeline_parts(self) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
        return self.embedding, self.blocks, self.head

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, tp_group: ProcessGroup | None = None) -> torch.Tensor:
        return lm_loss(logits, targets, tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, time, vocab]`` (a vocabulary slice once the head is tensor-parallel)."""
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def init_weights(self, seed: int) -> None:
        """Draw every weight from ``seed`` alone; call it on the full model, before any split. Module by module
        through ``run_init``: a meta build records it, and a rank replays it keeping only its share
        (``jobs.models.materialize``)."""
        run_init(self.init_steps(seed))

    def init_steps(self, seed: int) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
        """``init_weights`` as (module, init) in module order, one generator drawing through all of them."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = INIT_STD / math.sqrt(2 * self.n_layers)
        steps = []
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("proj") else INIT_STD
                steps.append((module, functools.partial(_draw_normal, std=std, generator=generator)))
            elif isinstance(module, nn.LayerNorm):
                steps.append((module, nn.LayerNorm.reset_parameters))
        return steps


def _draw_normal(module: nn.Module, std: float, generator: torch.Generator) -> None:
    """A Linear's or Embedding's weight from N(0, std), its bias zero."""
    module.weight.normal_(0.0, std, generator=generator)
    if getattr(module, "bias", None) is not None:
        module.bias.zero_()


@dataclass(frozen=True)
class MoESettings:
    """Which blocks get a mixture-of-experts feed-forward (jobs/models/moe.py) and how it routes."""

    experts: int
    top_k: int = 1
    every: int = 1  # blocks every-1, 2*every-1, ... (0-based) are MoE
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0

    def layer(self, index: int, d_model: int) -> MoE | None:
        if (index + 1) % self.every:
            return None
        return MoE(d_model, self.experts, functools.partial(MLP, d_model), self.top_k, self.capacity_factor,
                   self.aux_loss_coef, self.z_loss_coef)


def gpt(vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int, dropout: float = 0.0,
        seed: int = 0, moe_experts: int = 0, moe_top_k: int = 1, moe_every: int = 1,
        moe_capacity_factor: float = 1.25, moe_aux_loss_coef: float = 0.01, moe_z_loss_coef: float = 0.0) -> GPT:
    """The built-in GPT's entry (``model.kind = "gpt"``), its weights drawn from ``seed``; ``moe_experts`` > 0
    makes every ``moe_every``-th block's feed-forward a mixture of experts."""
    moe = (MoESettings(moe_experts, moe_top_k, moe_every, moe_capacity_factor, moe_aux_loss_coef, moe_z_loss_coef)
           if moe_experts else None)
    model = GPT(vocab_size, seq_len, d_model, n_heads, n_layers, dropout, moe)
    model.init_weights(seed)
    return model


def build_gpt(model_cfg: ModelConfig, seed: int) -> GPT:
    return gpt(model_cfg.vocab_size, model_cfg.seq_len, model_cfg.d_model, model_cfg.n_heads, model_cfg.n_layers,
               model_cfg.dropout, seed, **moe_args(model_cfg))


TORCH_LOSS_ELEMENTS = 1 << 22  # logits this small take torch's loss on a float32 copy: 16 MiB at most


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, tp_group: ProcessGroup | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in float32 over the targets that are not ``IGNORE_INDEX`` (-100: prompt
    tokens, as torch and Hugging Face count them; 0 when none is counted), from logits of any float dtype (bf16
    under autocast); with ``tp_group`` the logits are that group's vocabulary slices. Logits of up to
    ``TORCH_LOSS_ELEMENTS`` whole on one rank go through torch's own loss on a float32 copy (16 MiB at most);
    larger ones, or split ones, through ``parallel.tensor_parallel.cross_entropy``, which makes no copy."""
    if tp_group is None and logits.numel() <= TORCH_LOSS_ELEMENTS:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)
    return mean_over_counted(cross_entropy(logits, targets, tp_group, IGNORE_INDEX), targets)

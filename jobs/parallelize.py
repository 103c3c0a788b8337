"""Turn the single-device GPT into its tensor-parallel form, and check a layout fits it first.

``check_gpt_layout`` is pure and imports nothing heavy, so the launcher can reject a
layout before any rank starts; the tensor-parallel layers (and torch with them) are
imported only by ``parallelize_tp``, on the ranks.

Attention is split by heads (the QKV projection column-parallel, its output
projection row-parallel), the MLP column then row, the token embedding and the LM
head over the vocabulary (train it with ``jobs.gpt.lm_loss(..., tp_group)``). LayerNorms,
position embeddings and row-parallel biases stay whole on every rank. The MLP width
4 * d_model needs no check of its own: n_heads divides d_model and tp divides n_heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc.errors import LayoutError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hpc.config import ModelConfig
    from jobs.gpt import GPT


def _check_tp_fits(n_heads: int, vocab_size: int, tp: int) -> None:
    if n_heads % tp:
        raise LayoutError(f"model.n_heads={n_heads} is not divisible by parallel.tp={tp} (attention is split by heads)")
    if vocab_size % tp:
        raise LayoutError(
            f"the vocabulary of {vocab_size} tokens is not divisible by parallel.tp={tp} "
            "(the embedding and the LM head are split by vocabulary)"
        )


def check_gpt_layout(model_cfg: ModelConfig, tp: int, pp: int, virtual: int = 1) -> None:
    """Raise ``LayoutError`` naming the numbers when (tp, pp, virtual stages) cannot cut this GPT."""
    _check_tp_fits(model_cfg.n_heads, model_cfg.vocab_size, tp)
    chunks = pp * virtual
    if model_cfg.n_layers % chunks:
        raise LayoutError(
            f"model.n_layers={model_cfg.n_layers} is not divisible by parallel.pp * virtual stages = "
            f"{pp}*{virtual} = {chunks}"
        )


def parallelize_tp(model: GPT, tp_group: ProcessGroup) -> GPT:
    """Swap the GPT's layers for tensor-parallel ones holding this rank's shard; in place (collective-free)."""
    import torch.distributed as dist

    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    _check_tp_fits(model.n_heads, model.vocab_size, dist.get_world_size(tp_group))
    model.embedding.tokens = VocabParallelEmbedding.from_full(model.embedding.tokens, tp_group)
    for block in model.blocks:
        block.attention.qkv = ColumnParallelLinear.from_full(block.attention.qkv, tp_group)
        block.attention.proj = RowParallelLinear.from_full(block.attention.proj, tp_group)
        block.mlp.fc = ColumnParallelLinear.from_full(block.mlp.fc, tp_group)
        block.mlp.proj = RowParallelLinear.from_full(block.mlp.proj, tp_group)
    model.head.linear = ColumnParallelLinear.from_full(model.head.linear, tp_group)
    return model

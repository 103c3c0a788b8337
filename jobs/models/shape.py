"""What ``hpc plan`` knows of a spec's model: parallel/plan.py's ``Transformer`` (the built-in GPT read from the spec).

``jobs.models.hf:causal_lm``: read from the transformers config that ``[model.args]`` make (over ``pretrained``'s
config.json when it is given), nothing built: layers, hidden, heads, KV heads, head size, the gated MLP's
intermediate size, the vocabulary, tied embeddings, the sliding window and which layers have it, and the biases
(and Qwen3's per-head norms) a config adds. Any other ``model.entry``: built on the meta device (no memory, no
initialization) and counted through its ``pipeline_parts()``: its blocks are the layers, the head's linear (or the
first part's embedding) gives the vocabulary and the hidden size, an attribute of the model or its first block the
heads. What cannot be found is one line naming it, with ``--model`` as the way out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc.errors import ConfigError
from jobs.models.hf_config import hf_config
from parallel.plan import Transformer, spec_gpt

if TYPE_CHECKING:
    from torch import nn

    from hpc.config import JobSpec

HINT = "give --model layers=,hidden=,heads=,seq=,vocab= (and kv_heads=,ffn=,gated=1) with --batch instead"
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # mixtures of experts transformers configures
HEAD_NAMES = ("num_attention_heads", "num_heads", "n_heads", "n_head")


def spec_model(spec: JobSpec) -> Transformer:
    """The planner's picture of a spec's model: the built-in GPT from the spec (parallel/plan.py), a
    ``jobs.models.hf:causal_lm`` from its config, any other ``model.entry`` (or ``model.kind``) counted."""
    if not spec.model.entry and spec.model.kind == "gpt":
        return spec_gpt(spec)
    from jobs.models.hf import is_hf_entry

    return hf_model(spec) if is_hf_entry(spec) else counted_model(spec)


def hf_model(spec: JobSpec) -> Transformer:
    """A Llama-shaped transformers causal LM, from its config alone."""
    from jobs.models.hf import attention_type

    config = hf_config(spec.model.args)
    kind = config.model_type
    experts = [key for key in EXPERT_KEYS if getattr(config, key, None)]
    if experts:
        raise ConfigError(f"hpc plan does not count the experts of a {kind} config (model.args.{experts[0]}); {HINT}")
    hidden, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    sliding = sum(attention_type(config, index) == "sliding_attention" for index in range(layers))
    return Transformer(
        layers, hidden, heads, spec.model.seq_len, config.vocab_size, kv_heads=kv, head_dim=dim,
        ffn=config.intermediate_size, gated=True, tied=bool(getattr(config, "tie_word_embeddings", False)),
        window=(getattr(config, "sliding_window", None) or 0) if sliding else 0, window_layers=sliding,
        family="llama", layer_biases=layer_biases(config, heads * dim, kv * dim, dim), name=kind)


def layer_biases(config: Any, q: int, kv: int, dim: int) -> int:
    """A decoder layer's parameters beyond its matrices and two norm weights, by the rules transformers' Llama-shaped
    models follow: ``attention_bias`` (Q, K, V and O), ``mlp_bias`` (gate, up, down), Qwen2's Q, K and V biases,
    Qwen3's Q and K norms over the head size."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    count = 0
    if getattr(config, "attention_bias", False):
        count += q + 2 * kv + hidden
    elif config.model_type == "qwen2":
        count += q + 2 * kv
    if getattr(config, "mlp_bias", False):
        count += 2 * ffn + hidden
    if config.model_type == "qwen3":
        count += 2 * dim
    return count


def counted_model(spec: JobSpec) -> Transformer:
    """Any other model, built on the meta device and counted: (first part, one block, last part) parameters."""
    import torch

    from jobs.models.protocol import build_model, model_entry

    entry = model_entry(spec)[0]
    where = f"hpc plan cannot count model.entry={entry!r}"
    with torch.device("meta"):
        model = build_model(spec)
    if getattr(model, "pipeline_parts", None) is None:
        raise ConfigError(f"{where}: it has no pipeline_parts() to find its layers in; {HINT}")
    first, blocks, last = model.pipeline_parts()
    vocab, hidden = _vocab_and_hidden(first, last)
    heads = _heads(model, blocks, hidden)
    found = {"blocks": len(blocks), "embedding or head (vocabulary, hidden size)": vocab, "attention heads": heads}
    missing = [name for name, value in found.items() if not value]
    if missing:
        raise ConfigError(f"{where}: its pipeline_parts() show no {' and no '.join(missing)}; {HINT}")
    block = sum(_count(b) for b in blocks) // len(blocks)
    total = sum(p.numel() for p in model.parameters())  # each parameter once: tied ones too
    shared = _count(first) + len(blocks) * block + _count(last) - total  # the parts' double counts
    return Transformer(len(blocks), hidden, heads, spec.model.seq_len, vocab,
                       counted=(_count(first), block, _count(last)), shared=shared, name=entry)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _vocab_and_hidden(first: nn.Module, last: nn.Module) -> tuple[int, int]:
    """(vocabulary, hidden size): the head's last linear's outputs and inputs, else the first embedding's."""
    from torch import nn

    linears = [m for m in last.modules() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1].out_features, linears[-1].in_features
    embeddings = [m for m in first.modules() if isinstance(m, nn.Embedding)]
    return (embeddings[0].num_embeddings, embeddings[0].embedding_dim) if embeddings else (0, 0)


def _heads(model: nn.Module, blocks: list[nn.Module], hidden: int) -> int:
    """Attention heads: an attribute of the model, its config or its first block's modules (``num_heads`` of
    ``nn.MultiheadAttention``, ``n_heads``, ...), else the hidden size over a ``head_dim``; 0 when none says."""
    places = [model, getattr(model, "config", None), *(blocks[0].modules() if blocks else ())]
    for place in places:
        for name in HEAD_NAMES:
            value = getattr(place, name, None)
            if isinstance(value, int) and value > 0:
                return value
    for place in places[2:]:
        dim = getattr(place, "head_dim", None)
        if isinstance(dim, int) and dim > 0 and hidden and hidden % dim == 0:
            return hidden // dim
    return 0

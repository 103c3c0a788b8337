"""Hugging Face ``transformers`` causal LMs (Llama and its look-alikes) as a ``model.entry``.

Researchers arrive with a transformers model, not with ours; this adapter lets the
3D trainer run the model's own modules (embeddings, decoder layers, rotary embedding,
norm, head) under DP x TP x PP, and lets ``hpc ckpt export --format hf`` hand the
result back to ``from_pretrained``. The adapter's children are the transformers
model's children, so parameter names (and checkpoint names) are exactly the Hugging
Face ones (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), and its
TP plan is the one the transformers model carries.

A pipeline block is one decoder layer that computes its own position ids, rotary
(cos, sin) and causal mask from the hidden state, so one tensor is all that crosses
stages. The model is built from a config alone (random init, offline), float32,
with SDPA attention: its causal mask may be None and SDPA then masks causally
(eager attention with no mask would attend to the future). The trainer builds it on the
meta device, recording transformers' weight initialization (``_recorded_inits``) for each
rank to replay keeping only its share (``jobs.models.materialize``); the forward check then runs on
a one-layer twin of the config. With ``pretrained = DIR`` the config is DIR/config.json
under ``[model.args]`` and the weights are DIR's safetensors files (``jobs.models.pretrained``): checked
against the model on every build (the pre-launch one too), then read by each rank, its own tensors'
slices only, instead of the recorded init. transformers is imported lazily: importing this
module is cheap, and ``pip install hpc-batch[hf]`` is only needed when the entry is used.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from torch import nn

from hpc.errors import ConfigError
from jobs.models.hf_config import ENTRY, hf_config, import_transformers, last_line
from jobs.models.materialize import recording, run_init, unrecorded

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hpc.config import JobSpec

# What "Llama-shaped" means: the modules the adapter runs, by their names in the model.
LLAMA_SHAPED = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
CHECK_TOKENS = 5  # the forward compared with the transformers model's own at build time
TWIN_VOCAB = 256  # the vocabulary of the small model the check runs on when the model is built on meta


def causal_lm(model_type: str | None = None, pretrained: str | None = None, **fields: Any) -> CausalLM:
    """The entry: a transformers causal LM of ``model_type`` (default llama), float32, as a ``CausalLM``: randomly
    initialized, or with ``pretrained = DIR`` of DIR/config.json (``fields`` over it) and DIR's safetensors
    weights, checked against the model before anything is read (``jobs.models.pretrained``). On the meta device the
    weights are left to ``jobs.models.materialize`` (``stored_weights``); on the host they are read whole."""
    transformers = import_transformers()
    args = {**fields, **({"model_type": model_type} if model_type else {})}
    config = hf_config({**args, "pretrained": pretrained} if pretrained is not None else args)
    if recording():  # a meta build the trainer materializes: check the forward on a small twin instead
        with unrecorded(), torch.random.fork_rng(devices=[]), torch.device("cpu"):
            _check_small_twin(transformers, config)
    if pretrained is None or torch.get_default_device().type == "meta":
        model = _from_config(transformers, config)
        weights = None if pretrained is None else _open_weights(pretrained, model)
    else:  # on the host: checked on a meta build first; the random init, overwritten, leaves the generator be
        with unrecorded(), torch.device("meta"):
            weights = _open_weights(pretrained, _from_config(transformers, config))
        with torch.random.fork_rng(devices=[]):
            model = _from_config(transformers, config)
    adapter = CausalLM(model)
    if weights is not None:
        adapter.stored_weights = weights
        if not adapter.lm_head.weight.is_meta:
            weights.load_whole(adapter)
    _check_same_forward(adapter, model)
    return adapter


def _from_config(transformers: Any, config: Any) -> nn.Module:
    """The transformers model of ``config`` (float32, SDPA); one error line when it cannot be built."""
    try:
        with _recorded_inits(transformers):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                  dtype=torch.float32)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ConfigError(f"model.args.model_type={config.model_type!r} has no causal LM in transformers") from None
        raise ConfigError(f"model.args do not make a {config.model_type} model: {last_line(exc)}") from None
    except Exception as exc:
        raise ConfigError(f"model.args do not make a {config.model_type} model: {last_line(exc)}") from None


def _open_weights(directory: str, model: nn.Module) -> Any:
    from jobs.models.pretrained import open_weights

    return open_weights(directory, model)


@contextlib.contextmanager
def _recorded_inits(transformers: Any) -> Iterator[None]:
    """While a meta build is recorded (``jobs.models.materialize``), each ``post_init`` records transformers' weight
    initialization, which it skips on the meta device, where the host build would run it (sub-models first:
    a sub-model's ``__init__`` runs its own ``post_init``)."""
    if not recording():
        yield
        return
    original = transformers.PreTrainedModel.init_weights

    def init_weights(self: Any) -> None:
        run_init(_init_steps(self))
        original(self)  # on meta: ties the weights only

    with mock.patch.object(transformers.PreTrainedModel, "init_weights", init_weights):
        yield


def _init_steps(model: Any) -> list[tuple[nn.Module, Any]]:
    """``PreTrainedModel.initialize_weights`` as (module, init) steps: ``smart_apply``'s order (children first,
    a sub-model's modules by its own ``_init_weights``), skipping and flagging ``_is_hf_initialized`` as it does."""
    from transformers import PreTrainedModel

    steps = []

    def visit(module: nn.Module, owner: Any) -> None:
        for child in module.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        if not getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = True
            steps.append((module, owner._init_weights))

    visit(model, model)
    return steps


def _check_small_twin(transformers: Any, config: Any) -> None:
    """``_check_same_forward`` on a model of ``config`` cut to one layer and a small vocabulary: what the check
    looks for (embedding or logit scaling, soft-capping) does not depend on either, and the whole model is
    never on one host when the trainer materializes it shard by shard."""
    twin = copy.deepcopy(config)
    twin.num_hidden_layers = 1
    if getattr(twin, "layer_types", None):
        twin.layer_types = twin.layer_types[:1]
    twin.vocab_size = min(config.vocab_size, TWIN_VOCAB)
    if getattr(twin, "pad_token_id", None) is not None and twin.pad_token_id >= twin.vocab_size:
        twin.pad_token_id = None
    model = transformers.AutoModelForCausalLM.from_config(twin, attn_implementation="sdpa", dtype=torch.float32)
    _check_same_forward(CausalLM(model), model)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


class Head(nn.Module):
    """The last pipeline part: final norm, then the LM head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class RotaryTables:
    """The position ids 0..s-1 and their rotary (cos, sin), made once per (s, device, dtype) and shared by every
    decoder block, as the transformers model makes them once per forward for all its layers: per block they were
    about ten small kernels, 160 a step of the bench Llama. Not kept for the rope types whose frequencies change
    with what they have seen (dynamic, longrope), nor under torch.compile, which fuses them into the block's graph."""

    def __init__(self, rotary_emb: nn.Module) -> None:
        self.rotary_emb = rotary_emb
        self.kept = getattr(rotary_emb, "rope_type", "default") not in ("dynamic", "longrope")
        self._made: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The position ids 0..s-1 of ``hidden``'s sequences, and their (cos, sin)."""
        if not self.kept or torch.compiler.is_compiling():
            return self._make(hidden)
        key = (hidden.shape[1], hidden.device, hidden.dtype)
        if key not in self._made:
            with torch.no_grad():
                self._made = {key: self._make(hidden)}
        return self._made[key]

    def _make(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return positions, self.rotary_emb(hidden, positions)


class DecoderBlock(nn.Module):
    """One decoder layer as a pipeline block: hidden state in, hidden state out.

    Position ids, the rotary (cos, sin) and the causal mask are made here from the
    hidden state, as the transformers model makes them once for all layers (the rotary through the
    model's one ``RotaryTables``). The mask is asked for without the position ids: ours are always 0..s-1,
    one sequence per row, and given them with no cache transformers checks each row for packed sequences
    with a host read (on a GPU, one synchronization per layer and step; its own model passes a cache,
    which skips the check).
    """

    def __init__(self, layer: nn.Module, rotary: RotaryTables, config: Any, attention_type: str) -> None:
        super().__init__()
        self.layer, self.rotary_emb, self.rotary = layer, rotary.rotary_emb, rotary
        self.config, self.attention_type = config, attention_type

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        positions, rotary = self.rotary(hidden)
        mask = None
        if not kernel_masks_causally(self.config, self.attention_type, hidden.shape[1]):
            make_mask = (masking_utils.create_sliding_window_causal_mask
                         if self.attention_type == "sliding_attention" else masking_utils.create_causal_mask)
            mask = make_mask(self.config, hidden, None, None)
        return self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)


def kernel_masks_causally(config: Any, attention_type: str, seq_len: int) -> bool:
    """Whether SDPA's own causal masking (``is_causal``, no mask tensor) is this layer's mask: SDPA attention and
    a window no shorter than the sequence, our rows being whole sequences at positions 0..s-1 with no padding.
    transformers decides the same in eager mode, but under torch.compile (before transformers 5.2x on torch
    < 2.14: 5.17 on the GPU machine) it always builds the boolean mask, and a mask keeps SDPA off its flash
    kernel: deciding here keeps a compiled block on flash attention."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    window = getattr(config, "sliding_window", None) if attention_type == "sliding_attention" else None
    return window is None or seq_len < window


def attention_type(config: Any, index: int) -> str:
    """Which mask layer ``index`` gets, by the rule transformers' models follow (``layer_types``, else a
    ``sliding_window`` for every layer, as Mistral's)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class CausalLM(nn.Module):
    """A Llama-shaped transformers causal LM under the model protocol (jobs/models/protocol.py)."""

    head_name = "lm_head"  # for train.fused_head_loss

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        config = hf_model.config
        missing = [name for name in LLAMA_SHAPED if not _has(hf_model, name)]
        if missing:
            raise ConfigError(f"model.args.model_type={config.model_type!r}: {type(hf_model).__name__} has no "
                              f"{missing[0]}; jobs.models.hf takes Llama-shaped models ({', '.join(LLAMA_SHAPED)})")
        for name, child in hf_model.named_children():  # parameter names stay the Hugging Face ones
            self.add_module(name, child)
        self.config = config
        self.rotary = RotaryTables(self.model.rotary_emb)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.tp_plan = dict(getattr(hf_model, "_tp_plan", None) or {})
        if self.tied:  # both split over the vocabulary alike: their shards stay one tensor (jobs.train.parallelize)
            self.tp_plan["model.embed_tokens"] = "embedding_rowwise"
            self.tp_plan.setdefault("lm_head", "colwise_gather_output")
        heads = config.num_attention_heads
        self.tp_divisors = {"model.args.num_attention_heads": heads,
                            "model.args.num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads}

    def pipeline_parts(self) -> tuple[nn.Module, list[nn.Module], nn.Module]:
        """(embed_tokens, one ``DecoderBlock`` per layer, norm + lm_head), sharing the model's modules."""
        blocks = [DecoderBlock(layer, self.rotary, self.config, attention_type(self.config, i))
                  for i, layer in enumerate(self.model.layers)]
        return self.model.embed_tokens, blocks, Head(self.model.norm, self.lm_head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first, blocks, last = self.pipeline_parts()
        hidden = first(ids)
        for block in blocks:
            hidden = block(hidden)
        return last(hidden)

    def loss(self, output: torch.Tensor, targets: torch.Tensor, tp_group: ProcessGroup | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy against already-shifted targets, in float32 as transformers' own loss
        and the GPT's (bf16 logits under autocast would round the loss and the softmax to 3 digits);
        ``tp_group`` when a ``vocab`` plan keeps the logits split over the vocabulary."""
        from jobs.models.gpt import lm_loss

        return lm_loss(output, targets, tp_group)


def _check_same_forward(adapter: CausalLM, hf_model: nn.Module) -> None:
    """One short forward of both: a model whose own forward does more than embed -> layers -> norm -> head
    (embedding or logit scaling, soft-capping) is not Llama-shaped, and would train as another model."""
    if adapter.lm_head.weight.is_meta:
        return
    ids = (torch.arange(CHECK_TOKENS) % adapter.config.vocab_size).unsqueeze(0)
    training = adapter.training
    adapter.eval()
    try:
        with torch.no_grad():
            ours, theirs = adapter(ids), hf_model(input_ids=ids, use_cache=False).logits
    finally:
        adapter.train(training)
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
        raise ConfigError(f"model.args.model_type={adapter.config.model_type!r}: {type(hf_model).__name__}'s forward "
                          "is not embed_tokens -> layers -> norm -> lm_head (it scales or caps something), so "
                          "jobs.models.hf cannot run it")


def is_hf_entry(spec: JobSpec) -> bool:
    return spec.model.entry == ENTRY


def export_hf(step_dir: str | Path, dest: str | Path, spec: JobSpec, max_shard_bytes: int | None = None) -> int:
    """Write ``dest/config.json`` and the ``model/`` tensors (whatever layout saved them) as ``model.safetensors``,
    or as shards of at most ``max_shard_bytes`` and their index when the model is larger (default
    ``hpc.checkpoint.export.MAX_SHARD_BYTES``), from a checkpoint of ``spec``; returns how many tensors.
    ``from_pretrained(dest)`` loads it, in float32 (the trainer's masters). A model of ``pretrained = DIR``
    needs DIR/config.json still (its weights, no longer)."""
    from hpc.checkpoint.export import MAX_SHARD_BYTES, check_destination, export_model_dir
    from hpc.checkpoint.format import CheckpointError
    from hpc.checkpoint.load import open_checkpoint
    from hpc.checkpoint.state import model_pieces
    if not is_hf_entry(spec):
        model = f"model.entry={spec.model.entry!r}" if spec.model.entry else f"model.kind={spec.model.kind!r}"
        raise ConfigError(f"{step_dir}: its {model} is not model.entry={ENTRY!r}: --format hf exports "
                          "transformers models only (use --format safetensors)")
    config = hf_config(spec.model.args)
    with torch.device("meta"):
        built = CausalLM(_from_config(import_transformers(), config))
    expected = {piece.name: tuple(piece.tensor.shape) for piece in model_pieces(built)}  # a tied weight once
    aliases = {f"model/{name}" for name in built.state_dict()} - expected.keys()  # older checkpoints hold both
    index = open_checkpoint(step_dir)
    stored = {name: tuple(record.shape) for name, record in index.tensors.items()
              if name.startswith("model/") and name not in aliases}
    if stored != expected:
        differ = sorted(set(stored.items()) ^ set(expected.items()))[0][0]
        raise CheckpointError(f"{index.path}: its model tensors do not match model.args "
                              f"({differ}: checkpoint {stored.get(differ)}, config {expected.get(differ)})")
    dest = Path(dest)
    check_destination(dest, directory=True)
    config.architectures = [_causal_lm_class(config)]
    config.dtype = torch.float32  # what the tensors are, whatever a pretrained config.json said
    try:
        dest.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(dest)
    except OSError as exc:
        raise CheckpointError(f"--to {dest}: cannot write it ({exc.strerror or exc})") from None
    return export_model_dir(step_dir, dest, "model/", max_shard_bytes or MAX_SHARD_BYTES)


def _causal_lm_class(config: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]

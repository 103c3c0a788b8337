"""The transformers config of ``jobs.models.hf:causal_lm``'s ``[model.args]``, checked key by key.

Read by the model (``jobs.models.hf``) and by ``hpc plan`` (``jobs.models.shape``), which needs the config
without building anything: over ``pretrained``'s config.json when it is given, every value checked so that
a wrong one is one line naming the key and where it was set, never a rank's traceback.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc.errors import ConfigError

ENTRY = "jobs.models.hf:causal_lm"


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model.entry={ENTRY!r} needs transformers: pip install hpc-batch[hf]") from None
    return transformers


def last_line(exc: BaseException) -> str:
    """transformers' validation errors span lines; the last one says what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def build_config(model_type: str = "llama", **fields: Any) -> Any:
    """The transformers config of ``model_type`` with ``fields`` (``[model.args]``); one error line naming the key."""
    auto_config = import_transformers().AutoConfig
    try:
        if not isinstance(model_type, str):
            raise ValueError(model_type)
        default = auto_config.for_model(model_type)
    except ValueError:
        raise ConfigError(f"model.args.model_type={model_type!r} is not a transformers model type "
                          "(e.g. llama, mistral, qwen2, qwen3)") from None
    try:
        config = auto_config.for_model(model_type, **fields)
    except Exception as exc:  # the config's own validation (dataclass validators)
        raise ConfigError(f"model.args do not make a {model_type} config: {last_line(exc)}") from None
    # transformers keeps unknown keys as attributes; a key it stored but does not define is a typo
    known, stored = set(default.to_dict()), set(config.to_dict())
    for key in fields:
        if key in stored and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"model.args.{key} is not a setting of {type(config).__name__}{hint}")
    return config


def hf_config(args: dict[str, Any]) -> Any:
    """The transformers config of ``[model.args]``; with ``pretrained = DIR``, DIR/config.json's settings under
    them (its other keys, such as ``architectures``, left out, but for the rotary settings that transformers < 5
    saved, which its configs still take; its ``layer_types`` too when the args give the depth). The values are
    checked (``check_config_values``, ``check_built_config``): one line naming the key and where it is set."""
    fields = dict(args)
    pretrained = fields.pop("pretrained", None)
    given = set(fields)
    if pretrained is not None:
        stored = stored_config(pretrained)
        known = build_config(fields.get("model_type", stored.get("model_type", "llama"))).to_dict()
        if "num_hidden_layers" in fields:  # the stored per-layer attention types follow the stored depth
            stored.pop("layer_types", None)
        fields = {**{key: value for key, value in stored.items() if key in known or key in LEGACY_KEYS}, **fields}

    def named(key: str) -> str:
        return (f"model.args.{key}" if key in given or pretrained is None
                else f"model.args.pretrained={str(pretrained)!r}: config.json's {key}")

    check_config_values(fields, named)
    try:
        config = build_config(**fields)
    except ConfigError as exc:
        if pretrained is None or not exc.message.startswith("model.args do not make"):
            raise
        raise ConfigError(f"model.args.pretrained={str(pretrained)!r}: its config.json and {exc.message}") from None
    check_built_config(config, named)
    return config


LEGACY_KEYS = ("rope_theta", "rope_scaling")  # what transformers < 5 saved and its configs still take (rope_parameters)
MAX_LAYERS = 2048  # far past the deepest published LMs (Llama 3.1 405B: 126); every layer is built before launch
POSITIVE = {"rms_norm_eps": "it keeps the norm's division finite", "layer_norm_eps": "it keeps the norm's division "
            "finite", "rope_theta": "the base of the rotary frequencies"}
SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "max_position_embeddings")  # a count of something: an integer >= 1 (None: derived)


def stored_config(pretrained: object) -> dict[str, Any]:
    """DIR/config.json as a dict, its ``model_type`` a string; one line naming the file otherwise."""
    path = Path(str(pretrained)) / "config.json"
    where = f"model.args.pretrained={str(pretrained)!r}"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{where}: cannot read {path} ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]})") from None
    if not isinstance(stored, dict):
        raise ConfigError(f"{where}: {path} holds a JSON {type(stored).__name__}, not an object of config settings")
    if not isinstance(stored.get("model_type", "llama"), str):
        raise ConfigError(f"{where}: {path}'s model_type is {_short(stored['model_type'])}, not a model type name "
                          "(e.g. llama, mistral, qwen2, qwen3)")
    return stored


def check_config_values(fields: dict[str, Any], named: Callable[[str], str]) -> None:
    """The counts of ``SIZES`` integers >= 1 (the layers at most ``MAX_LAYERS``), every number finite, the norms'
    epsilons and the rotary base above zero; ``named(key)`` says where a key was set."""
    for key, value in fields.items():
        if key in SIZES and value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"{named(key)}={_short(value)} must be an integer >= 1")
        if key == "num_hidden_layers" and value is not None and value > MAX_LAYERS:
            raise ConfigError(f"{named(key)}={value:,} is more layers than hpc builds (at most {MAX_LAYERS:,}, "
                              "far past any published model's)")
        if key == "rope_parameters" and isinstance(value, dict):
            check_config_values(value, _within(named(key)))
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{named(key)}={value} must be a finite number")
        if key in POSITIVE and (type(value) not in (int, float) or value <= 0):
            raise ConfigError(f"{named(key)}={_short(value)} must be a number above zero ({POSITIVE[key]})")


def _within(outer: str) -> Callable[[str], str]:
    return lambda inner: f"{outer}.{inner}"


def check_built_config(config: Any, named: Callable[[str], str]) -> None:
    """What the config's own validation lets through and a rank would trip on: ``layer_types`` not one name a
    layer (jobs.models.hf picks each layer's mask by it), a ``sliding_window`` that is not a length."""
    layers, types = config.num_hidden_layers, getattr(config, "layer_types", None)
    if types is not None and (not isinstance(types, list) or len(types) != layers
                              or not all(isinstance(kind, str) for kind in types)):
        raise ConfigError(f"{named('layer_types')}={_short(types)} must list one attention type a layer "
                          f"({layers} of them, as num_hidden_layers says)")
    window = getattr(config, "sliding_window", None)
    if window is not None and (type(window) is not int or window < 1):
        raise ConfigError(f"{named('sliding_window')}={_short(window)} must be a number of tokens >= 1, or null")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"

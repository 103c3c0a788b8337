"""torchtitan as a peer: its Llama 3 model, its per-block compile and its loss, in the expert's loop.

``python -m jobs.bench.titan_llama [--compile] [--steps N] [--spec TOML]`` builds torchtitan's
``Transformer`` (torchtitan 0.2.2, pinned: the release for the GPU machine's torch 2.11) in the spec's shape
(dim, layers, heads, KV heads; torchtitan derives the SwiGLU width from ``multiple_of``, and the bench's
5632 is what it derives for 2048), the way torchtitan's trainer does on one GPU: built on the meta device,
``to_empty`` on the GPU, ``init_weights`` under no_grad; ``--compile`` applies torchtitan's ``apply_compile``
(each TransformerBlock, fullgraph) and compiles its ``cross_entropy_loss`` as its trainer does. Then
``jobs.bench.plain_llama.train_steps``: bf16 autocast (torchtitan's ``maybe_enable_amp`` on one GPU), fused
AdamW, foreach clipping, the same random tokens, timing and JSON line as the plain loop's.

torchtitan's trainer itself needs a tokenizer, a data set and network access; what it runs per step is this
model, this compile and this loss. Its package imports ``datasets`` (for its C4 loader) on the model's import
path: where ``datasets`` is absent (the GPU machine) a placeholder module stands in for it, and using it
raises. ``make bench-gpu-deps`` puts torchtitan and its small dependencies in ``.bench-site/``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from jobs.bench.plain_llama import bench_settings, loop_arguments, train_steps

TORCHTITAN_VERSION = "0.2.2"


class _Unavailable(types.ModuleType):
    """Stands in for ``datasets``: torchtitan's C4 loader imports it, this bench never loads a data set."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"datasets.{name}: the Hugging Face datasets package is not installed here")
        return type(name, (), {"__init__": unavailable})


def import_torchtitan() -> types.SimpleNamespace:
    if importlib.util.find_spec("datasets") is None:
        for name in ("datasets", "datasets.distributed"):
            module = _Unavailable(name)
            module.__path__ = []
            sys.modules[name] = module
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer
    return types.SimpleNamespace(Transformer=Transformer, TransformerModelArgs=TransformerModelArgs,
                                 apply_compile=apply_compile, Compile=Compile, cross_entropy_loss=cross_entropy_loss)


def titan_args(titan: types.SimpleNamespace, settings: dict):
    """torchtitan's model arguments for the spec's transformers Llama; refuses a shape it would build otherwise."""
    args = settings["args"]
    model_args = titan.TransformerModelArgs(
        dim=args["hidden_size"], n_layers=args["num_hidden_layers"], n_heads=args["num_attention_heads"],
        n_kv_heads=args.get("num_key_value_heads"), vocab_size=args["vocab_size"], max_seq_len=settings["seq_len"],
        rope_theta=args.get("rope_theta", 10000.0))
    width = int(2 * 4 * model_args.dim / 3)
    width = model_args.multiple_of * -(-width // model_args.multiple_of)
    if width != args["intermediate_size"]:
        raise SystemExit(f"torchtitan derives an MLP width of {width} for dim {model_args.dim}, the spec has "
                         f"{args['intermediate_size']}")
    return model_args


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    args = loop_arguments("python -m jobs.bench.titan_llama").parse_args(argv)
    settings = bench_settings(Path(args.spec))
    titan = import_torchtitan()
    with torch.device("meta"):
        model = titan.Transformer(titan_args(titan, settings))
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cuda"))
    model.train()
    loss_fn = titan.cross_entropy_loss
    if args.compile:
        titan.apply_compile(model, titan.Compile(enable=True))
        loss_fn = torch.compile(loss_fn)
    tokens = settings["batch"] * settings["seq_len"]
    result = train_steps(model, model, lambda logits, targets: loss_fn(logits, targets) / tokens, settings,
                         args.steps, args.warmup, args.profile, args.profile_dir)
    import torchtitan
    print(json.dumps({"loop": "torchtitan" + (" compiled" if args.compile else " eager"),
                      "torchtitan": getattr(torchtitan, "__version__", TORCHTITAN_VERSION), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

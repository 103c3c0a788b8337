"""A Hugging Face transformers causal LM through ``model.entry = "jobs.hf:causal_lm"``.

Without processes: the adapter computes exactly what the transformers model computes
(forward, loss, the pipeline parts composed), under the Hugging Face parameter names;
its TP plan names real modules and the TP divisors are checked; bad arguments are one
line naming the key. With one rank: a checkpoint of the adapter exports with
``hpc ckpt export --format hf`` to a directory ``from_pretrained`` loads with no missing
or unexpected keys and the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc.config import spec_from_dict
from hpc.errors import ConfigError, LayoutError
from tests.ranks import run_ranks

pytest.importorskip("transformers")

ENTRY = "jobs.hf:causal_lm"
TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
# Llama look-alikes the adapter runs unchanged (mistral with a sliding window shorter than the batch)
OTHERS = {"qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 4}}
SEQ = 16


def _ids(seed: int = 3, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _both(model_type: str = "llama", seed: int = 0, **extra):
    """The adapter and the transformers model built on the same seed (so with the same weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from jobs.hf import causal_lm

    args = {**TINY, "model_type": model_type, **extra}
    torch.manual_seed(seed)
    adapter = causal_lm(**args)
    torch.manual_seed(seed)
    args.pop("model_type")
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **args),
                                                 attn_implementation="sdpa", dtype=torch.float32)
    return adapter, reference


def _spec(**model_args):
    return spec_from_dict({"model": {"entry": ENTRY, "args": {**TINY, **model_args}, "seq_len": SEQ},
                           "data": {"name": "licenses"}})


@pytest.mark.parametrize("model_type", ["llama", *OTHERS])
def test_the_adapter_is_the_transformers_model(model_type) -> None:
    adapter, reference = _both(model_type, **OTHERS.get(model_type, {}))
    assert list(adapter.state_dict()) == list(reference.state_dict())  # the Hugging Face names
    assert "model.layers.3.self_attn.q_proj.weight" in adapter.state_dict()
    for (name, ours), theirs in zip(adapter.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    ids = _ids()
    logits = adapter(ids)
    assert logits.shape == (2, SEQ, 256)
    torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=0, atol=1e-6)
    # the loss: next-token cross-entropy on already-shifted targets, as transformers' labels= shifts them
    loss = adapter.loss(logits[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=1e-6)


def test_the_pipeline_parts_composed_are_the_forward_and_pass_one_tensor() -> None:
    adapter, _ = _both()
    first, blocks, last = adapter.pipeline_parts()
    assert first is adapter.model.embed_tokens and len(blocks) == 4
    assert [block.layer for block in blocks] == list(adapter.model.layers)
    ids = _ids()
    hidden = first(ids)
    for block in blocks:  # one hidden-state tensor from block to block, as between pipeline stages
        hidden = block(hidden.detach().clone().requires_grad_())
        assert isinstance(hidden, torch.Tensor) and hidden.shape == (2, SEQ, 32)
    torch.testing.assert_close(last(hidden), adapter(ids), rtol=0, atol=0)
    held = {id(p) for part in (first, *blocks, last) for p in part.parameters()}
    assert held == {id(p) for p in adapter.parameters()}  # every parameter sits in exactly one part


def test_the_plan_names_real_modules_and_the_tp_checks_name_the_keys() -> None:
    from jobs.protocol import check_pipeline, check_tp, plan_targets

    adapter, _ = _both()
    plan = adapter.tp_plan
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    targets = {name: style for _, style, _, name in plan_targets(adapter, plan)}
    assert len(targets) == 2 + 4 * 7  # embedding, head, and q, k, v, o, gate, up, down of each layer
    assert targets["model.layers.2.mlp.down_proj"] == "rowwise"
    spec = _spec()
    check_tp(adapter, spec, 2)
    check_pipeline(adapter, 4, "parallel.pp")
    with pytest.raises(LayoutError, match=r"^model.args.num_key_value_heads=2 is not divisible by parallel.tp=4$"):
        check_tp(adapter, spec, 4)
    with pytest.raises(LayoutError, match="cannot be cut into"):
        check_pipeline(adapter, 3, "parallel.pp")


def test_tied_embeddings_stay_whole_under_tp_and_refuse_pipeline_cuts() -> None:
    adapter, reference = _both(tie_word_embeddings=True)
    assert adapter.lm_head.weight is adapter.model.embed_tokens.weight
    torch.testing.assert_close(adapter(_ids()), reference(input_ids=_ids()).logits, rtol=0, atol=1e-6)
    assert adapter.tp_plan["lm_head"] == adapter.tp_plan["model.embed_tokens"] == "replicate"
    with pytest.raises(LayoutError) as error:
        adapter.pipeline_parts()
    assert str(error.value).startswith("model.args.tie_word_embeddings=true") and "\n" not in str(error.value)


def test_the_model_builds_on_the_meta_device_for_the_pre_launch_check() -> None:
    from jobs.hf import causal_lm

    with torch.device("meta"):
        adapter = causal_lm(**TINY)
    assert all(p.is_meta for p in adapter.parameters())
    assert len(adapter.pipeline_parts()[1]) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"model_type": "nosuch"}, "model.args.model_type='nosuch' is not a transformers model type"),
        ({"num_hiden_layers": 2}, "model.args.num_hiden_layers is not a setting of LlamaConfig "
                                  "(did you mean num_hidden_layers?)"),
        ({"hidden_size": 30}, "model.args do not make a llama config: ValueError: The hidden size (30) is not a "
                              "multiple of the number of attention heads (4)."),
        ({"model_type": "gpt2", "vocab_size": 256, "n_layer": 1, "n_embd": 16, "n_head": 2},
         "model.args.model_type='gpt2': GPT2LMHeadModel has no model.embed_tokens"),
        ({"model_type": "granite", "embedding_multiplier": 2.0},
         "model.args.model_type='granite': GraniteForCausalLM's forward is not embed_tokens -> layers"),
    ],
)
def test_bad_model_args_are_one_line_naming_the_key(args, message) -> None:
    from jobs.hf import causal_lm

    small = {key: value for key, value in TINY.items() if key != "model_type"}
    with pytest.raises(ConfigError) as error:
        causal_lm(**(args if "n_layer" in args else {**small, **args}))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def _save_adapter(world, step_dir_root: str, spec_data: dict):
    """One rank: the adapter with perturbed weights, saved as a training checkpoint would save it."""
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer
    from jobs.checkpointing import model_pieces
    from jobs.protocol import build_model

    spec = spec_from_dict(spec_data)
    model = build_model(spec)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    saver = Checkpointer(step_dir_root, dist.group.WORLD)
    saver.save(7, model_pieces(model), attrs={"job_spec": json.dumps(spec_data)})
    saver.finalize()
    return model(_ids()).detach().numpy()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_hf_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, capsys, tied) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from hpc.cli.main import main
    from hpc.config import spec_to_dict

    spec_data = spec_to_dict(_spec(tie_word_embeddings=tied))
    (expected,) = run_ranks(1, _save_adapter, str(tmp_path / "ckpt"), spec_data)
    step_dir, out = tmp_path / "ckpt" / "step-00000007", tmp_path / "hf"
    assert main(["ckpt", "export", str(step_dir), "--to", str(out), "--format", "hf"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors"}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    loaded.eval()
    with torch.no_grad():
        np.testing.assert_allclose(loaded(input_ids=_ids()).logits.numpy(), expected, rtol=0, atol=1e-5)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LlamaForCausalLM"


def _save_gpt(world, root: str):
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, Piece

    spec_data = {"model": {"kind": "gpt"}}
    saver = Checkpointer(root, dist.group.WORLD)
    saver.save(1, [Piece.whole("model/w", torch.ones(2))], attrs={"job_spec": json.dumps(spec_data)})
    saver.finalize()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "hf"], "its model.kind='gpt' is not model.entry='jobs.hf:causal_lm': --format hf exports"),
        (["--format", "hf", "--only", "model/"], "--only applies to --format safetensors and pt"),
        (["--format", "pt"], "--format pt writes a file ending in .pt"),
        ([], "the file name must end in .safetensors or .pt (or give --format hf"),
    ],
)
def test_export_errors_are_one_line(tmp_path, capsys, args, message) -> None:
    from hpc.cli.main import main

    run_ranks(1, _save_gpt, str(tmp_path / "ckpt"))
    code = main(["ckpt", "export", str(tmp_path / "ckpt" / "step-00000001"), "--to", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("hpc: error: "), err
    assert message in err
    assert not Path(tmp_path / "out").exists()

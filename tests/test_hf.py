"""A Hugging Face transformers causal LM through ``model.entry = "jobs.models.hf:causal_lm"``.

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

from hpc.config import load_spec, spec_from_dict
from hpc.errors import ConfigError, LayoutError
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks
from tests.test_3d import CLIP, LR, _metrics, assemble, pieces_as_numpy
from tests.test_checkpoint_3d import _losses

pytest.importorskip("transformers")

ENTRY = "jobs.models.hf:causal_lm"
TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
# Llama look-alikes the adapter runs unchanged (mistral with a sliding window shorter than the batch)
# (qwen3's head_dim defaults to 128, four times hidden_size here: rounding differences between layouts then grow
# past 1e-5 in the gradient norm of a spiking step, so give it the usual hidden_size / heads)
OTHERS = {"qwen2": {}, "qwen3": {"head_dim": 8}, "mistral": {"sliding_window": 4}}
SEQ = 16
# Parameters: tests/numerics.py. Adam divides each gradient by its running RMS, so where a gradient is
# near zero the rounding of another summation order becomes part of a step: on this model 2 or 3 of
# its 70,000 parameters end 1.3 to 2.6 thousandths of a step apart; a wrong shard or a missing
# reduction moves most elements of a tensor by whole steps.


def _ids(seed: int = 3, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _both(model_type: str = "llama", seed: int = 0, **extra):
    """The adapter and the transformers model built on the same seed (so with the same weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from jobs.models.hf import causal_lm

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


def test_under_bf16_autocast_the_loss_is_transformers_float32_loss() -> None:
    """Autocast's bf16 logits: the loss and its softmax in float32, as transformers' own ``labels=`` loss."""
    adapter, reference = _both()
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = adapter(ids)
        expected = reference(input_ids=ids, labels=ids).loss
    assert logits.dtype == torch.bfloat16
    loss = adapter.loss(logits[:, :-1], ids[:, 1:])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


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



@pytest.mark.parametrize("rope", [None, {"rope_type": "dynamic", "factor": 2.0}], ids=["default", "dynamic"])
def test_the_rotary_tables_are_made_once_for_every_block_unless_they_change_with_the_length(rope) -> None:
    """As the transformers model makes (cos, sin) once per forward for all its layers; a dynamic rope type's
    frequencies depend on the lengths it has seen, so each block asks as before. Either way the logits are the
    transformers model's."""
    extra = {} if rope is None else {"rope_parameters": {"rope_theta": 10000.0, **rope}}
    adapter, reference = _both(**extra)
    calls = []
    adapter.model.rotary_emb.register_forward_hook(lambda *args: calls.append(1))
    ids = _ids()
    for _ in range(2):
        torch.testing.assert_close(adapter(ids), reference(input_ids=ids).logits, rtol=0, atol=1e-6)
    assert len(calls) == (1 if rope is None else 2 * TINY["num_hidden_layers"])
    adapter(_ids(batch=1)[:, :SEQ // 2])  # another length: made anew
    assert len(calls) == (2 if rope is None else 3 * TINY["num_hidden_layers"])


@pytest.mark.parametrize("model_type,window,masked", [("llama", None, False), ("mistral", SEQ + 1, False),
                                                      ("mistral", 4, True)], ids=["full", "long-window", "window"])
def test_sdpa_masks_causally_itself_where_transformers_would_in_eager_even_when_compiling(
        monkeypatch, model_type, window, masked) -> None:
    """Under torch.compile transformers 5.17 (the GPU machine's) never skips the causal mask (its
    ``_ignore_causal_mask_sdpa`` answers False while tracing), and a mask tensor keeps SDPA off flash attention.
    Emulated here: the blocks still hand SDPA no mask and ``is_causal`` where transformers would in eager mode,
    a mask only where a sliding window is shorter than the sequence; the logits stay the transformers model's."""
    import transformers.masking_utils

    adapter, reference = _both(model_type, **({"sliding_window": window} if window else {}))
    ids = _ids()
    expected = reference(input_ids=ids).logits
    monkeypatch.setattr(transformers.masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    torch.testing.assert_close(adapter(ids), expected, rtol=0, atol=1e-6)
    assert calls == [(not masked, not masked)] * TINY["num_hidden_layers"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_compiled_block_runs_the_attention_kernel_it_runs_uncompiled() -> None:
    """What the emulation above stands for, on the GPU with its transformers: a block compiled as
    ``train.compile`` compiles it runs the SDPA kernel it runs uncompiled (no mask: flash or cuDNN, as this torch
    picks), not the masked memory-efficient one, and computes what it computes uncompiled."""
    from torch.profiler import ProfilerActivity, profile

    adapter, _ = _both(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    block = adapter.cuda().pipeline_parts()[1][0]
    hidden = torch.randn(2, SEQ, 256, device="cuda")

    def kernels_and_output() -> tuple[set[str], torch.Tensor]:
        with torch.autocast("cuda", dtype=torch.bfloat16), profile(activities=[ProfilerActivity.CPU]) as trace:
            output = block(hidden)
        return {event.name for event in trace.events() if event.name.startswith("aten::_scaled_dot_product_")}, output

    eager, expected = kernels_and_output()
    block.compile()
    kernels_and_output()  # compiles
    compiled, got = kernels_and_output()
    assert eager and compiled == eager and not any("efficient" in name for name in compiled), (eager, compiled)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_the_plan_names_real_modules_and_the_tp_checks_name_the_keys() -> None:
    from jobs.models.protocol import check_pipeline, check_tp, plan_targets

    adapter, reference = _both()
    plan = adapter.tp_plan
    assert plan == reference._tp_plan  # transformers' own (5.24's splits the embedding too, 5.17's keeps it whole)
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan.get("model.embed_tokens", "embedding_rowwise") == "embedding_rowwise"
    targets = {name: style for _, style, _, name in plan_targets(adapter, plan)}
    assert len(targets) == ("model.embed_tokens" in plan) + 1 + 4 * 7  # the head, q, k, v, o, gate, up, down a layer
    assert targets["model.layers.2.mlp.down_proj"] == "rowwise"
    spec = _spec()
    check_tp(adapter, spec, 2)
    check_pipeline(adapter, 4, "parallel.pp")
    with pytest.raises(LayoutError, match=r"^model.args.num_key_value_heads=2 is not divisible by parallel.tp=4$"):
        check_tp(adapter, spec, 4)
    with pytest.raises(LayoutError, match="cannot be cut into"):
        check_pipeline(adapter, 3, "parallel.pp")


def test_tied_embeddings_split_alike_under_tp_and_sit_on_both_ends_of_a_pipeline() -> None:
    from jobs.models.protocol import check_tp, tied_across_stages
    from jobs.train.parallelize import keep_stages

    adapter, reference = _both(tie_word_embeddings=True)
    assert adapter.lm_head.weight is adapter.model.embed_tokens.weight
    torch.testing.assert_close(adapter(_ids()), reference(input_ids=_ids()).logits, rtol=0, atol=1e-6)
    # both split over the vocabulary, alike (parallelize_tp then ties the shards as the whole weights were)
    assert adapter.tp_plan["lm_head"] == "colwise_gather_output"
    assert adapter.tp_plan["model.embed_tokens"] == "embedding_rowwise"
    assert tied_across_stages(adapter) == ["model.embed_tokens.weight"]
    assert len(keep_stages(adapter, 1, 0, 1, False, True)) == 1  # one stage (recomputed blocks): the weight stays one
    held = {}
    for rank in range(4):  # pp = 4: the first and the last stage each hold a copy, the middle ones none
        share, _ = _both(tie_word_embeddings=True)
        keep_stages(share, 4, rank, 1, False, False)
        held[rank] = {name for name, _ in share.named_parameters()}
        if rank in (0, 3):
            assert share.lm_head.weight is share.model.embed_tokens.weight  # one parameter on the rank
    assert [rank for rank in held if "model.embed_tokens.weight" in held[rank]] == [0, 3]
    assert "model.layers.0.self_attn.q_proj.weight" in held[0] and "model.norm.weight" in held[3]
    spec = spec_from_dict({"model": {"entry": ENTRY, "args": {**TINY, "tie_word_embeddings": True}, "seq_len": SEQ,
                                     "tp_plan": {"lm_head": "replicate"}}, "data": {"name": "licenses"}})
    with pytest.raises(LayoutError, match=r"model.embed_tokens \(split on dim 0\), lm_head \(whole\) share one "
                                          r"weight \(tied embeddings\): split them alike"):
        check_tp(adapter, spec, 2)


def test_the_model_builds_on_the_meta_device_for_the_pre_launch_check() -> None:
    from jobs.models.hf import causal_lm

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
    from jobs.models.hf import causal_lm

    small = {key: value for key, value in TINY.items() if key != "model_type"}
    with pytest.raises(ConfigError) as error:
        causal_lm(**(args if "n_layer" in args else {**small, **args}))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def _save_adapter(world, step_dir_root: str, spec_data: dict):
    """One rank: the adapter with perturbed weights, saved as a training checkpoint would save it."""
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer
    from jobs.models.protocol import build_model
    from jobs.train.checkpointing import model_pieces

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
        (["--format", "hf"], "its model.kind='gpt' is not model.entry='jobs.models.hf:causal_lm': --format hf exports"),
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


# --- through the trainer: every layout trains like one process; resume across layouts; export ---

LLAMA_EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "llama.toml"


def llama_spec(run_dir: str, name: str, layout, schedule: str = "1f1b", microbatches: int = 1, virtual: int = 1,
               steps: int = 10, every: int = 0, resume: str = "never", model_type: str = "llama", tied: bool = False):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {"entry": ENTRY, "args": {**TINY, **OTHERS.get(model_type, {}), "model_type": model_type,
                                           "tie_word_embeddings": tied},
                  "seq_len": SEQ},
        "data": {"name": "licenses", "batch_size": 8},
        # constant learning rate: 10 steps are the first half of 20
        "train": {"steps": steps, "lr": LR, "optimizer": "adam", "grad_clip": CLIP, "log_every": 100},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "microbatches": microbatches,
                     "virtual_stages": virtual},
        "checkpoint": {"every_steps": every, "keep": 5, "resume": resume},
    })


def _train_llama(world, run_dir: str, cases):
    """Each case: (name, layout, llama_spec options); this rank's parameters after it, as pieces."""
    from jobs.train.loop import train

    results = []
    for name, layout, options in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank)
        _, model = train(llama_spec(run_dir, name, layout, **options), world, mesh)
        results.append(pieces_as_numpy(model, mesh))
    return results


def _model_tensors(step_dir: Path) -> dict[str, np.ndarray]:
    from hpc.checkpoint import open_checkpoint, read_tensor

    index = open_checkpoint(step_dir)
    return {name: read_tensor(index, name).numpy() for name in index.tensors if name.startswith("model/")}


def _step_dir(run_dir: Path, name: str, step: int) -> Path:
    return run_dir / name / "checkpoints" / f"step-{step:08d}"


# (name, (dp, tp, pp), llama_spec options); the (1, 2, 2) run saves at step 10 for the resume and export tests
FOUR_RANKS = [("tp2-pp2", (1, 2, 2), {"microbatches": 2, "every": 10}),
              ("qwen2-tp2-pp2", (1, 2, 2), {"microbatches": 2, "model_type": "qwen2"})]
TWO_RANKS = [("dp2", (2, 1, 1), {}), ("tp2", (1, 2, 1), {}), ("pp2", (1, 1, 2), {"microbatches": 2}),
             ("pp2-interleaved", (1, 1, 2), {"schedule": "interleaved", "microbatches": 2, "virtual": 2}),
             ("tied-tp2", (1, 2, 1), {"tied": True}),
             ("qwen3-tp2", (1, 2, 1), {"model_type": "qwen3"})]  # per-head q/k norms: replicated_with_grad_allreduce
SAVED = ("tp2-pp2", 10)  # resumed under (2, 1, 1): restored (0 steps), then trained to step 20
RESUMED = [("restored", (2, 1, 1), {}), ("resumed", (2, 1, 1), {"steps": 20})]
SINGLE = [("single", (1, 1, 1), {"steps": 20, "every": 10}), ("qwen2-single", (1, 1, 1), {"model_type": "qwen2"}),
          ("tied-single", (1, 1, 1), {"tied": True}), ("qwen3-single", (1, 1, 1), {"model_type": "qwen3"})]
# each single-process run, its model's options, and the runs that must train like it
REFERENCES = [("single", {}, TWO_RANKS[:4] + FOUR_RANKS[:1]), ("qwen2-single", {"model_type": "qwen2"}, FOUR_RANKS[1:]),
              ("tied-single", {"tied": True}, TWO_RANKS[4:5]), ("qwen3-single", {"model_type": "qwen3"}, TWO_RANKS[5:])]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every run of the slow tests: (run_dir, {name: assembled parameters})."""
    run_dir = tmp_path_factory.mktemp("llama")
    saved = str(_step_dir(run_dir, *SAVED))
    resumed = [(name, layout, {**options, "resume": saved}) for name, layout, options in RESUMED]
    runs = {}
    for ranks, cases in ((1, SINGLE), (4, FOUR_RANKS), (2, TWO_RANKS + resumed)):
        per_rank = run_ranks(ranks, _train_llama, str(run_dir), cases, timeout=300)
        runs |= {name: assemble([results[number] for results in per_rank]) for number, (name, *_) in enumerate(cases)}
    return run_dir, runs


@pytest.mark.slow
def test_every_layout_trains_like_one_process(trained) -> None:
    from jobs.models.protocol import build_model

    run_dir, runs = trained
    for reference, options, cases in REFERENCES:
        records = [json.loads(line) for line in (run_dir / reference / "metrics.jsonl").open()][:10]
        losses, norms = [r["loss"] for r in records], [r["grad_norm"] for r in records]
        assert losses[-1] < losses[0] - 0.5  # it learns
        assert max(norms) > CLIP  # clipping is active, so its global norm across TP and PP ranks matters
        expected = (_model_tensors(_step_dir(run_dir, reference, 10)) if reference == "single"
                    else runs[reference])
        initial = build_model(llama_spec("unused", "initial", (1, 1, 1), **options))
        for name, *_ in cases:
            assert _metrics(run_dir, name) == (pytest.approx(losses, rel=LOSS_RTOL),
                                               pytest.approx(norms, rel=LOSS_RTOL)), name
            assert_trained_close(runs[name], expected, optimizer="adam", lr=LR, steps=10, name=name)
            for key, value in expected.items():
                untrained = initial.state_dict()[key.removeprefix("model/")].numpy()
                assert not np.array_equal(value, untrained), f"{key} did not train"


@pytest.mark.slow
def test_a_checkpoint_saved_under_1_2_2_resumes_under_2_1_1(trained) -> None:
    run_dir, runs = trained
    saved = _model_tensors(_step_dir(run_dir, *SAVED))
    assert runs["restored"].keys() == saved.keys()
    for key, value in saved.items():  # restored under another layout: every element as saved
        assert np.array_equal(runs["restored"][key], value), key
    resumed, reference = _losses(run_dir, "resumed"), _losses(run_dir, "single")
    assert list(resumed) == list(range(11, 21))
    assert list(resumed.values()) == pytest.approx([reference[step] for step in resumed], rel=1e-5)
    expected = _model_tensors(_step_dir(run_dir, "single", 20))
    assert_trained_close(runs["resumed"], expected, optimizer="adam", lr=LR, steps=20, name="resumed")


@pytest.mark.slow
def test_the_hf_export_of_a_tp_pp_checkpoint_gives_the_trained_models_logits(trained, tmp_path) -> None:
    from transformers import LlamaForCausalLM

    from hpc.cli.main import main
    from jobs.models.hf import causal_lm

    run_dir, runs = trained
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(_step_dir(run_dir, *SAVED)), "--to", str(out), "--format", "hf"]) == 0
    loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    model = causal_lm(**TINY)  # the trained model: the (1, 2, 2) run's parameters, assembled
    model.load_state_dict({key.removeprefix("model/"): torch.from_numpy(value)
                           for key, value in runs["tp2-pp2"].items()})
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=_ids()).logits, model.eval()(_ids()), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "parallel.tp=4", "--set", "parallel.pp=1"],
         "model.args.num_key_value_heads=2 is not divisible by parallel.tp=4"),
        (["--set", "model.args.model_type=nosuch"], "model.args.model_type='nosuch' is not a transformers model type"),
        (["--set", "model.args.num_hidden_layers=3"], "the model's 3 blocks cannot be cut into parallel.pp"),
        (["--set", "model.args.tie_word_embeddings=true", "--set", "model.tp_plan.lm_head=replicate"],
         "share one weight (tied embeddings): split them alike"),
    ],
)
def test_a_layout_the_llama_cannot_take_is_one_line_before_launch(capsys, args, message) -> None:
    from hpc.cli.main import main

    code = main(["run", "-n", "4", "--launcher", "local", "--dry-run", *args, str(LLAMA_EXAMPLE)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("hpc: error: "), err
    assert message in err


def test_the_llama_example_passes_the_checks_as_tp2_pp2(capsys) -> None:
    from hpc.cli.main import main
    from jobs.train.layout import check_layout

    shape = check_layout(load_spec(LLAMA_EXAMPLE), 4)
    assert (shape.dp, shape.tp, shape.pp) == (1, 2, 2)
    assert main(["run", "-n", "4", "--launcher", "local", "--dry-run", str(LLAMA_EXAMPLE)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4

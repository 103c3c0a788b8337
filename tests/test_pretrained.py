"""Pretrained weights: ``[model.args] pretrained = DIR`` for ``jobs.models.hf:causal_lm``
(``jobs/models/pretrained.py``).

Tiny Llama, Qwen2 and Mistral models with random (perturbed) weights are written by transformers'
``save_pretrained``, as one file and sharded with an index, stored in bf16, fp16 and fp32. Without
processes: the adapter built on the host from each directory is ``from_pretrained``'s model, tensor for
tensor and logit for logit; a directory that is corrupt or does not fit the config is one line naming the
tensor and the file, and ``hpc run`` stops there (exit 2, no run directory). Through the trainer: under
(1,1,1), (2,1,1), (1,2,1), (1,1,2) and (1,2,2) the first step's loss is ``from_pretrained``'s loss on the
same batch (within 1e-5), and every layout trains like one process; each rank of (1,2,2) reads exactly its
own tensors' slices from the files (``safe_open`` wrapped and every read recorded); a checkpoint of the
fine-tuned (1,2,2) run exports with ``--format hf`` (sharded by ``--max-shard-size``) to a directory
``from_pretrained`` loads with the trained logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar
from unittest import mock

import numpy as np
import pytest
import torch

from hpc.config import spec_from_dict
from hpc.errors import ConfigError
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks
from tests.test_3d import CLIP, LR, assemble, pieces_as_numpy

pytest.importorskip("transformers")

ENTRY = "jobs.models.hf:causal_lm"
SHAPE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
SEQ, STEPS, SHARD = 16, 4, "24KB"  # a shard of 24 KB: the tiny models' 0.3 MB in 12-14 files
# name -> (model type, its config, stored dtype, sharded); the trainer runs each under every layout
MODELS = {
    "llama": ("llama", {}, torch.bfloat16, True),
    "qwen2": ("qwen2", {}, torch.float32, False),  # Q, K and V biases
    "mistral": ("mistral", {"sliding_window": 4}, torch.float16, True),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, torch.bfloat16, False),  # no lm_head.weight stored
}


def save_model(root: Path, name: str, sharded: bool | None = None, dtype: torch.dtype | None = None) -> Path:
    """MODELS[name] with perturbed random weights (the norms too), saved by ``save_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra, stored_dtype, stored_sharded = MODELS[name]
    sharded = stored_sharded if sharded is None else sharded
    dtype = stored_dtype if dtype is None else dtype
    config = AutoConfig.for_model(model_type, **SHAPE, **extra)
    torch.manual_seed(len(name))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = root / f"{name}-{str(dtype).removeprefix('torch.')}-{'sharded' if sharded else 'single'}"
    model.to(dtype).save_pretrained(path, **({"max_shard_size": SHARD} if sharded else {}))
    return path


def reference(path: Path):
    """``from_pretrained``'s model, computing in float32 like the trainer (its default would be the stored dtype)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return {name: save_model(root, name) for name in MODELS}


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama-tied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_host_build_is_from_pretrained(tmp_path, name, sharded, dtype) -> None:
    from jobs.models.hf import causal_lm

    path = save_model(tmp_path, name, sharded, dtype)
    assert (path / "model.safetensors.index.json").exists() == sharded
    before = torch.manual_seed(11).get_state()
    adapter = causal_lm(pretrained=str(path))
    assert torch.equal(torch.get_rng_state(), before)  # the random init it overwrote drew nothing visible
    model = reference(path)
    ours, theirs = adapter.state_dict(), model.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert value.dtype == torch.float32 and torch.equal(ours[key], value), key  # widened exactly
    with torch.no_grad():
        torch.testing.assert_close(adapter(_ids()), model(input_ids=_ids()).logits, rtol=0, atol=1e-6)
    assert (adapter.lm_head.weight is adapter.model.embed_tokens.weight) == (name == "llama-tied")


def test_model_args_override_the_stored_config_and_are_checked(saved) -> None:
    from jobs.models.hf import causal_lm

    adapter = causal_lm(pretrained=str(saved["llama"]), rms_norm_eps=1e-3)
    assert adapter.config.rms_norm_eps == 1e-3 and adapter.config.hidden_size == 32
    with pytest.raises(ConfigError, match=r"^model.args.num_hiden_layers is not a setting of LlamaConfig"):
        causal_lm(pretrained=str(saved["llama"]), num_hiden_layers=2)


# --- a directory that does not fit: one line naming the tensor and the file ---


def _rewrite(path: Path, edit) -> None:
    """Rewrite one safetensors file with ``edit(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _file_of(directory: Path, name: str) -> Path:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    return directory / weight_map[name]


UP = "model.layers.3.mlp.up_proj.weight"
BROKEN = {  # what is done to a copy of the sharded llama, and the line that says so
    "missing": (lambda d: _rewrite(_file_of(d, UP), lambda t: t.pop(UP)), f"{UP} is missing from model-000"),
    "not-indexed": (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: v for k, v in json.loads((d / "model.safetensors.index.json").read_text())
                        ["weight_map"].items() if k != UP}})), f"{UP} is missing from model.safetensors.index.json"),
    "shape": (lambda d: _rewrite(_file_of(d, UP), lambda t: t.update({UP: t[UP][:48]})),
              f"{UP} has shape (48, 32) in model-000"),
    "integer": (lambda d: _rewrite(_file_of(d, UP), lambda t: t.update({UP: t[UP].to(torch.int32)})),
                f"{UP} is I32 in model-000"),
    "header": (lambda d: _file_of(d, UP).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"),
               ".safetensors is not a safetensors file (JSONDecodeError"),
    "truncated": (lambda d: _file_of(d, UP).write_bytes(_file_of(d, UP).read_bytes()[:-100]),
                  "is not a safetensors file (ValueError: model.layers."),
    "index": (lambda d: (d / "model.safetensors.index.json").write_text("{"),
              "model.safetensors.index.json is not an index of safetensors files (JSONDecodeError"),
    "shard-gone": (lambda d: _file_of(d, UP).unlink(), ", named by model.safetensors.index.json, is not a file"),
    "no-weights": (lambda d: [f.unlink() for f in d.glob("model*")], "it holds neither model.safetensors nor"),
    "config": (lambda d: (d / "config.json").write_text("{"), "cannot read"),
}


def _broken_copy(saved: dict[str, Path], tmp_path: Path, how: str) -> Path:
    import shutil

    copy = tmp_path / "broken"
    shutil.copytree(saved["llama"], copy)
    BROKEN[how][0](copy)
    return copy


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_directory_that_does_not_fit_is_one_line_naming_the_tensor_and_the_file(saved, tmp_path, how) -> None:
    from jobs.models.hf import causal_lm

    copy = _broken_copy(saved, tmp_path, how)
    for device in ("meta", "cpu"):  # the pre-launch check's build, and a host build
        with pytest.raises(ConfigError) as error, torch.device(device):
            causal_lm(pretrained=str(copy))
        message = str(error.value)
        assert message.startswith(f"model.args.pretrained={str(copy)!r}: ") and "\n" not in message, message
        assert BROKEN[how][1] in message, message


@pytest.mark.parametrize(("how", "override"), [("missing", None), ("header", None), (None, "intermediate_size=48")])
def test_hpc_run_stops_before_any_rank_starts(saved, tmp_path, capsys, how, override) -> None:
    from hpc.cli.main import main

    directory = _broken_copy(saved, tmp_path, how) if how else saved["llama"]
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nname = "broken"\nrun_dir = "{tmp_path / "runs"}"\n[model]\nentry = "{ENTRY}"\n'
                   f'seq_len = {SEQ}\n[model.args]\npretrained = "{directory}"\n[data]\nname = "licenses"\n'
                   "batch_size = 8\n[parallel]\ntp = 2\npp = 2\nmicrobatches = 2\n")
    overrides = ["--set", f"model.args.{override}"] if override else []
    code = main(["run", "-n", "4", "--launcher", "local", *overrides, str(job)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("hpc: error: model.args.pretrained="), err
    if how:
        assert BROKEN[how][1] in err, err
    else:  # the first tensor the override changes, in the model's order
        assert re.search(r": model.layers.0.mlp.gate_proj.weight has shape \(64, 32\) in model-\d{5}-of-\d{5}"
                         r"\.safetensors, the config makes \(48, 32\)$", err), err
    assert not (tmp_path / "runs").exists()  # nothing started


# --- through the trainer ---


def pretrained_spec(run_dir: str, name: str, directory: str, layout, every: int = 0):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {"entry": ENTRY, "args": {"pretrained": directory}, "seq_len": SEQ},
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": CLIP, "log_every": 100},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "microbatches": 2 if pp > 1 else 1},
        "checkpoint": {"every_steps": every, "keep": 1, "resume": "never"},
    })


class RecordedReads:
    """``safe_open`` wrapped: every ``get_slice(name)[index]`` and ``get_tensor(name)`` of this process recorded
    as (file, name, ((start, stop) per dimension)), ``None`` for a whole tensor read by ``get_tensor``."""

    reads: ClassVar[list] = []

    def __init__(self, path, framework, device="cpu") -> None:
        from safetensors import safe_open

        self.file, self.opened = Path(path).name, safe_open(path, framework=framework, device=device)

    def __enter__(self):
        self.opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)

    def get_tensor(self, name):
        self.reads.append((self.file, name, None))
        return self.opened.get_tensor(name)

    def get_slice(self, name):
        stored, file, reads = self.opened.get_slice(name), self.file, self.reads

        class Slice:
            def __getitem__(self, index):
                shape = stored.get_shape()
                reads.append((file, name, tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))))
                return stored[index]

        return Slice()


def _train(world, run_dir: str, cases):
    """Each case: (name, directory, layout, checkpoint every); this rank's (parameters as pieces, reads)."""
    from jobs.train.loop import train

    results = []
    for name, directory, layout, every in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank)
        RecordedReads.reads = []
        with mock.patch("jobs.models.pretrained.safe_open", RecordedReads):
            _, model = train(pretrained_spec(run_dir, name, directory, layout, every), world, mesh)
        results.append((pieces_as_numpy(model, mesh), list(RecordedReads.reads)))
    return results


LAYOUTS = {"dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}


@pytest.fixture(scope="module")
def trained(saved, tmp_path_factory):
    """Every model under every layout: (run_dir, {run name: assembled parameters}, {run name: reads per rank})."""
    run_dir = tmp_path_factory.mktemp("runs")
    single = [(name, str(path), (1, 1, 1), 0) for name, path in saved.items()]
    two = [(f"{name}-{layout}", str(path), shape, 0) for name, path in saved.items()
           for layout, shape in LAYOUTS.items()]  # llama-tied at pp2: both stages read the tied tensor
    four = [(f"{name}-tp2-pp2", str(saved[name]), (1, 2, 2), STEPS if name == "llama" else 0)
            for name in ("llama", "qwen2", "mistral")]
    runs, reads = {}, {}
    for ranks, cases in ((1, single), (2, two), (4, four)):
        per_rank = run_ranks(ranks, _train, str(run_dir), cases, timeout=600)
        for number, (name, *_) in enumerate(cases):
            runs[name] = assemble([results[number][0] for results in per_rank])
            reads[name] = [results[number][1] for results in per_rank]
    return run_dir, runs, reads


def _losses(run_dir: Path, name: str) -> list[float]:
    records = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


def _first_batch(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step 0, as ``Workload.host_batch`` draws it (one replica)."""
    from jobs.data.datasets import global_batch_indices
    from jobs.data.protocol import build_data
    from jobs.train.workloads import fetch

    spec = pretrained_spec("unused", "batch", str(directory), (1, 1, 1))
    train = build_data(spec).train
    sampler = getattr(train, "batch_indices", None)
    indices = (sampler(0, 8, spec.job.seed) if sampler is not None
               else global_batch_indices(len(train), 8, spec.job.seed, 0))
    return fetch(train, indices)


@pytest.mark.slow
def test_every_layout_starts_at_from_pretrained_s_loss_and_trains_like_one_process(saved, trained) -> None:
    run_dir, runs, _ = trained
    for name, path in saved.items():
        inputs, targets = _first_batch(path)
        with torch.no_grad():
            logits = reference(path)(input_ids=inputs).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)).item()
        losses = _losses(run_dir, name)
        assert losses[0] == pytest.approx(expected, rel=LOSS_RTOL, abs=1e-5), name
        assert losses[-1] < losses[0]  # it trains
        cases = [f"{name}-{layout}" for layout in (*LAYOUTS, "tp2-pp2") if f"{name}-{layout}" in runs]
        assert len(cases) == (3 if name == "llama-tied" else 4), cases
        for case in cases:
            assert _losses(run_dir, case) == pytest.approx(losses, rel=LOSS_RTOL), case
            assert_trained_close(runs[case], runs[name], optimizer="adam", lr=LR, steps=STEPS, name=case)


def _train_on_the_gpu(world, run_dir: str, directory: str):
    """tp=2 with both ranks sharing the GPU; whether every parameter of the trained share is on it."""
    from jobs.train.loop import train

    mesh = build_mesh(MeshShape(1, 2, 1), world.rank, world.device)
    _, model = train(pretrained_spec(run_dir, "gpu-tp2", directory, (1, 2, 1)), world, mesh)
    return all(param.is_cuda for param in model.parameters())


@pytest.mark.cuda
def test_pretrained_weights_load_into_each_ranks_gpu_share(saved, tmp_path) -> None:
    """Each rank's TP slices read from the files straight into its GPU tensors: the first loss is
    ``from_pretrained``'s (on the CPU), and it trains."""
    path = saved["llama"]
    assert all(run_ranks(2, _train_on_the_gpu, str(tmp_path), str(path), timeout=300, device="cuda"))
    inputs, targets = _first_batch(path)
    with torch.no_grad():
        logits = reference(path)(input_ids=inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)).item()
    losses = _losses(tmp_path, "gpu-tp2")
    assert losses[0] == pytest.approx(expected, rel=1e-4)  # float32 on the GPU against the CPU
    assert losses[-1] < losses[0]


def _plan_splits_the_embedding() -> bool:
    """Whether transformers' own Llama TP plan splits the embedding by rows (5.24's does; 5.17's, the GPU
    machine's, keeps it whole on every TP rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                             num_attention_heads=2))
    return "model.embed_tokens" in model._tp_plan


def _expected_reads(file_of: dict[str, str], tp_rank: int, pp_rank: int) -> set:
    """What rank (tp_rank, pp_rank) of (1,2,2) must read of the 4-layer model: its stage's tensors, each the
    slice of its TP shard (Q, K, V, gate, up, the embedding where the plan splits it, and the head by rows; O
    and down by columns)."""
    shapes = {"q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 32),
              "gate_proj": (64, 32), "up_proj": (64, 32), "down_proj": (32, 64)}
    rows = lambda n: (tp_rank * n // 2, (tp_rank + 1) * n // 2)  # noqa: E731
    expected = set()
    for layer in (2 * pp_rank, 2 * pp_rank + 1):
        for module, (out, inp) in shapes.items():
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            split = ((0, out), rows(inp)) if module in ("o_proj", "down_proj") else (rows(out), (0, inp))
            expected.add((f"model.layers.{layer}.{part}.{module}.weight", split))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected.add((f"model.layers.{layer}.{norm}.weight", ((0, 32),)))
    if pp_rank == 0:
        expected.add(("model.embed_tokens.weight", (rows(256) if _plan_splits_the_embedding() else (0, 256), (0, 32))))
    else:
        expected |= {("model.norm.weight", ((0, 32),)), ("lm_head.weight", (rows(256), (0, 32)))}
    return {(file_of[name], name, index) for name, index in expected}


@pytest.mark.slow
def test_a_rank_of_1_2_2_reads_only_its_own_tensors_and_slices(saved, trained) -> None:
    _, _, reads = trained
    weight_map = json.loads((saved["llama"] / "model.safetensors.index.json").read_text())["weight_map"]
    per_rank = reads["llama-tp2-pp2"]
    for rank, recorded in enumerate(per_rank):
        coords = MeshShape(1, 2, 2).coords(rank)
        expected = _expected_reads(weight_map, coords["tp"], coords["pp"])
        assert len(recorded) == len(set(recorded)) == len(expected) and set(recorded) == expected, rank
    everything = {(file, name) for recorded in per_rank for file, name, _ in recorded}
    assert everything == set((file, name) for name, file in weight_map.items())  # each tensor by some rank
    qwen2 = {name for recorded in reads["qwen2-tp2-pp2"] for _, name, index in recorded if name.endswith("bias")}
    assert len(qwen2) == 12  # Q, K and V biases of 4 layers, read in slices too
    assert all(index is not None for recorded in reads["qwen2-tp2-pp2"] for _, _, index in recorded)


@pytest.mark.slow
def test_the_fine_tuned_checkpoint_exports_sharded_and_reloads_with_the_trained_logits(saved, trained, tmp_path,
                                                                                     capsys) -> None:
    from transformers import AutoModelForCausalLM

    from hpc.cli.main import main
    from jobs.models.hf import causal_lm

    run_dir, runs, _ = trained
    step_dir = run_dir / "llama-tp2-pp2" / "checkpoints" / f"step-{STEPS:08d}"
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(step_dir), "--to", str(out), "--format", "hf", "--max-shard-size", "40K"]) == 0
    assert capsys.readouterr().out.strip().endswith(" shards and their index)")
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert files[1].startswith("model-00001-of-") and len(files) > 4
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.dtype == torch.float32  # the trained masters, whatever the pretrained files stored
    trained_model = causal_lm(pretrained=str(saved["llama"]))
    trained_model.load_state_dict({key.removeprefix("model/"): torch.from_numpy(value)
                                   for key, value in runs["llama-tp2-pp2"].items()})
    with torch.no_grad():
        expected = trained_model.eval()(_ids())
        assert not torch.allclose(expected, reference(saved["llama"])(input_ids=_ids()).logits, atol=1e-3)
        torch.testing.assert_close(loaded.eval()(input_ids=_ids()).logits, expected, rtol=0, atol=1e-5)
    # the default size: one file, and the shards of the export before are gone (from_pretrained reads one layout)
    assert main(["ckpt", "export", str(step_dir), "--to", str(out), "--format", "hf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=_ids()).logits, expected, rtol=0, atol=1e-5)
    head = reloaded.lm_head.weight.detach().numpy()
    np.testing.assert_array_equal(head, runs["llama-tp2-pp2"]["model/lm_head.weight"])  # float32, bit for bit


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "out.safetensors", "--max-shard-size", "1G"], "--max-shard-size applies to --format hf"),
        (["--to", "out", "--format", "hf", "--max-shard-size", "lots"], "--max-shard-size: 'lots' is not a size"),
    ],
)
def test_max_shard_size_errors_are_one_line(tmp_path, capsys, args, message) -> None:
    from hpc.cli.main import main
    from tests.test_hf import _save_gpt

    run_ranks(1, _save_gpt, str(tmp_path / "ckpt"))
    code = main(["ckpt", "export", str(tmp_path / "ckpt" / "step-00000001"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err

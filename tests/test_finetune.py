"""Fine-tuning: loss on chosen tokens only (targets marked -100), frozen parameters, and weights from
another run's checkpoint with the schedule counted from the fine-tune's own first step.

The masked loss is the mean over the counted targets of the whole global batch, whatever splits the batch
(DP shards and pipeline microbatches hold different numbers of counted targets); frozen parameters stay as
they were under every layout while the rest trains as one process would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks
from tests.test_3d import LR, TINY_GPT, assemble, pieces_as_numpy

STEPS, SEQ = 4, 16
MASKED_DATA = "tests.test_finetune:masked_licenses"


class PromptAnswerWindows:
    """The licenses' byte windows as prompt/answer pairs: the first ``prompt_length(i)`` targets of sample
    ``i`` are the prompt (-100, not counted), so every sample, shard and microbatch counts another number."""

    def __init__(self, windows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    @staticmethod
    def prompt_length(index: int) -> int:
        return int(index * 7919 % (SEQ - 1))  # 0 .. SEQ-2: every sample keeps an answer

    def __getitem__(self, index: int):
        inputs, targets = self.windows[index]
        targets = targets.clone()
        targets[: self.prompt_length(index)] = -100
        return inputs, targets

    def batch_indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        return self.windows.batch_indices(step, batch_size, seed)


def masked_licenses(seq_len: int = SEQ):
    """A data entry returning masked targets (``data.entry``)."""
    from jobs.data.datasets import DataSplits, licenses

    splits = licenses(seq_len)
    return DataSplits(PromptAnswerWindows(splits.train), PromptAnswerWindows(splits.held_out))


def finetune_spec(run_dir: str, name: str, layout, microbatches: int = 1, masked: bool = True, **sections):
    dp, tp, pp = layout
    data = {"entry": MASKED_DATA, "args": {"seq_len": SEQ}} if masked else {"name": "licenses"}
    table = {
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {**TINY_GPT, "seq_len": SEQ},
        "data": {**data, "batch_size": 8},
        "train": {"steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": 0.5, "log_every": 100},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "microbatches": microbatches},
    }
    for section, values in sections.items():
        table[section] = {**table.get(section, {}), **values}
    return spec_from_dict(table)


def _train(world, run_dir: str, cases):
    """Each case trained; its pieces, and its held-out loss in <run>/held_out.json."""
    from jobs.train.loop import train

    results = []
    for name, layout, microbatches, sections in cases:
        spec = finetune_spec(run_dir, name, layout, microbatches, **sections)
        mesh = build_mesh(MeshShape(*layout), world.rank, world.device if spec.parallel.device == "cuda" else "cpu")
        result, model = train(spec, world, mesh)
        results.append(pieces_as_numpy(model, mesh))
        if world.rank == 0:
            (spec.run_path / "held_out.json").write_text(json.dumps(result.evaluation["held_out_loss"]))
    return results


def _records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]


def _losses(run_dir: Path, name: str) -> list[float]:
    """The training losses, then the held-out loss."""
    held_out = json.loads((run_dir / name / "held_out.json").read_text())
    return [record["loss"] for record in _records(run_dir, name)] + [held_out]


def _first_batch_losses() -> tuple[float, float]:
    """One process, by hand: step 0's global batch through the initial GPT, the mean over counted targets
    (F.cross_entropy's ignore_index) and over every target."""
    import torch
    import torch.nn.functional as F

    from jobs.models.gpt import build_gpt
    from jobs.train.workloads import fetch

    spec = finetune_spec("unused", "by-hand", (1, 1, 1))
    train = masked_licenses().train
    inputs, targets = fetch(train, train.batch_indices(0, 8, 5))
    model = build_gpt(spec.model, 5)
    with torch.no_grad():
        logits = model(inputs).flatten(0, 1)
    _, unmasked = fetch(train.windows, train.batch_indices(0, 8, 5))
    assert (targets == -100).any() and (targets != -100).any()
    return (F.cross_entropy(logits, targets.flatten()).item(),
            F.cross_entropy(logits, unmasked.flatten()).item())


@pytest.fixture(scope="module")
def masked_single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("masked-single")
    (pieces,) = run_ranks(1, _train, str(run_dir), [("single", (1, 1, 1), 1, {})], timeout=120)[0]
    return _losses(run_dir, "single"), assemble([pieces])


def test_the_masked_loss_is_the_global_mean_over_counted_targets(masked_single) -> None:
    losses, _ = masked_single
    masked, unmasked = _first_batch_losses()
    assert losses[0] == pytest.approx(masked, rel=LOSS_RTOL)
    assert abs(masked - unmasked) > 1e-3  # the mask changes what is averaged


MASKED_LAYOUTS = [  # (name, (dp, tp, pp), microbatches, spec sections)
    ("mb4", (1, 1, 1), 4, {}),
    ("dp2", (2, 1, 1), 1, {}),
    ("tp2", (1, 2, 1), 1, {}),
    ("pp2", (1, 1, 2), 2, {}),
]


@pytest.mark.parametrize("case", MASKED_LAYOUTS, ids=[case[0] for case in MASKED_LAYOUTS])
def test_every_layout_trains_the_masked_loss_like_one_process(masked_single, tmp_path, case) -> None:
    ref_losses, ref_params = masked_single
    name, layout, *_ = case
    (results,) = zip(*run_ranks(int(np.prod(layout)), _train, str(tmp_path), [case], timeout=180), strict=True)
    assert _losses(tmp_path, name) == pytest.approx(ref_losses, rel=LOSS_RTOL), name
    assert_trained_close(assemble(results), ref_params, optimizer="adam", lr=LR, steps=STEPS, name=name)


def test_a_microbatch_without_a_counted_target_adds_nothing() -> None:
    import torch
    import torch.nn.functional as F

    from jobs.train.workloads import token_weighted

    logits = torch.randn(2, 3, 5, requires_grad=True)
    ignored = torch.full((2, 3), -100)
    loss = token_weighted(lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), 0.5)(logits, ignored)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    counted = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    logits.grad = None
    weighted = token_weighted(lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()), 0.25)(logits, counted)
    expected = F.cross_entropy(logits.flatten(0, 1), counted.flatten(), reduction="sum") * 0.25
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-6)


FROZEN = ["embedding.*", "blocks.0.attention.*"]
FREEZE_LAYOUTS = [  # (name, (dp, tp, pp), microbatches, spec sections)
    ("dp2-zero3", (2, 1, 1), 1, {"parallel": {"zero": 3}, "checkpoint": {"every_steps": STEPS}}),
    ("tp2", (1, 2, 1), 1, {}),
    ("pp2", (1, 1, 2), 2, {}),
]


def _frozen_cases(cases, freeze=FROZEN):
    return [(name, layout, m, {**sections, "train": {"freeze": freeze}, "data": {"name": "licenses"}})
            for name, layout, m, sections in cases]


def _initial() -> dict[str, np.ndarray]:
    from jobs.models.gpt import build_gpt

    model = build_gpt(finetune_spec("unused", "initial", (1, 1, 1)).model, seed=5)
    return {f"model/{name}": value.detach().numpy() for name, value in model.state_dict().items()}


def _is_frozen(key: str, freeze) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(key.removeprefix("model/"), pattern) for pattern in freeze)


@pytest.fixture(scope="module")
def frozen_single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("frozen-single")
    cases = _frozen_cases([("single", (1, 1, 1), 1, {})]) + _frozen_cases(
        [("single-stage", (1, 1, 1), 1, {})], ["embedding.*", "blocks.[01].*"])
    pieces, stage = run_ranks(1, _train, str(run_dir), cases, timeout=120)[0]
    return {"single": (_losses(run_dir, "single"), assemble([pieces])),
            "single-stage": (_losses(run_dir, "single-stage"), assemble([stage]))}


def _check_frozen(results, reference, freeze, name) -> None:
    params, initial = assemble(results), _initial()
    for key, value in params.items():
        if _is_frozen(key, freeze):
            assert np.array_equal(value, initial[key]), f"{name}: {key} is frozen, yet it moved"
        else:
            assert not np.array_equal(reference[key], initial[key]), f"{key} did not train"
    assert any(_is_frozen(key, freeze) for key in params)
    assert_trained_close(params, reference, optimizer="adam", lr=LR, steps=STEPS, name=name)


@pytest.mark.parametrize("case", FREEZE_LAYOUTS, ids=[case[0] for case in FREEZE_LAYOUTS])
def test_frozen_parameters_stay_and_the_rest_trains_like_one_process(frozen_single, tmp_path, case) -> None:
    ref_losses, ref_params = frozen_single["single"]
    (case,) = _frozen_cases([case])
    name, layout, *_ = case
    (results,) = zip(*run_ranks(int(np.prod(layout)), _train, str(tmp_path), [case], timeout=180), strict=True)
    assert _losses(tmp_path, name) == pytest.approx(ref_losses, rel=LOSS_RTOL), name
    _check_frozen(results, ref_params, FROZEN, name)
    if (tmp_path / name / "checkpoints").is_dir():  # saved as trained, frozen tensors included (ZeRO-3: whole)
        from hpc.checkpoint.discovery import find_latest
        from hpc.checkpoint.format import read_index
        from hpc.checkpoint.load import read_tensor

        index = read_index(find_latest(tmp_path / name / "checkpoints"))
        for key, value in assemble(results).items():
            np.testing.assert_array_equal(read_tensor(index, key).numpy(), value, err_msg=key)


def test_a_pipeline_stage_with_every_parameter_frozen_still_passes_gradients_on(frozen_single, tmp_path) -> None:
    """Stage 0 of pp=2 holds the embedding and blocks 0-1, all frozen: it steps nothing, under ZeRO-1 too."""
    freeze = ["embedding.*", "blocks.[01].*"]
    ref_losses, ref_params = frozen_single["single-stage"]
    cases = _frozen_cases([("dp2-pp2-zero1", (2, 1, 2), 2, {"parallel": {"zero": 1}})], freeze)
    (results,) = zip(*run_ranks(4, _train, str(tmp_path), cases, timeout=180), strict=True)
    assert _losses(tmp_path, "dp2-pp2-zero1") == pytest.approx(ref_losses, rel=LOSS_RTOL)
    _check_frozen(results, ref_params, freeze, "dp2-pp2-zero1")


def _freeze_error(world, run_dir: str, freeze):
    from hpc.errors import ConfigError

    try:
        _train(world, run_dir, _frozen_cases([("bad", (1, 1, 2), 2, {})], freeze))
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("freeze", "message"), [
    (["embedding.*", "head.linear.weight", "nope.*"],
     "train.freeze: 'nope.*' matches no parameter name of the model (fnmatch over the single-device model's names, "
     "'*' crossing dots; they read like 'embedding.tokens.weight', 'blocks.2.ln_attention.weight')"),
    (["*"], "train.freeze=['*'] leaves no parameter of the model to train"),
])
def test_a_freeze_pattern_that_matches_nothing_is_one_error_on_every_rank(tmp_path, freeze, message) -> None:
    """'head.linear.weight' matches on the last stage only and 'embedding.*' on the first: both count."""
    assert run_ranks(2, _freeze_error, str(tmp_path), freeze, timeout=120) == [message, message]


def _save_source(world, run_dir: str):
    """Run A: trains STEPS steps with embedding.tokens frozen, saving after the last."""
    from jobs.train.loop import train

    spec = finetune_spec(run_dir, "source", (1, 1, 1), masked=False, checkpoint={"every_steps": STEPS},
                         train={"freeze": ["embedding.tokens.*"]})
    train(spec, world, build_mesh(MeshShape(1, 1, 1), world.rank))


def _start_from(world, run_dir: str, layout, source: str):
    """The fine-tune's model and optimizer right after ``resume()``: its start step, its pieces, its optimizer state."""
    from hpc.observe.probe import Probe
    from hpc.run_session import RunSession, spec_options
    from jobs.train.checkpointing import LoopState, resume
    from jobs.train.loop import build_data_parallel_optimizer
    from jobs.train.workloads import Workload

    spec = finetune_spec(run_dir, "finetune", layout, masked=False, checkpoint={"init_from": source})
    mesh = build_mesh(MeshShape(*layout), world.rank)
    workload = Workload(spec, mesh)
    optimizer = build_data_parallel_optimizer(spec, workload.model, mesh, Probe())
    try:
        state = LoopState(workload.model, optimizer, mesh, spec.parallel.ep, world.rank)
        start, _ = resume(spec, RunSession(world, spec.run_path, **spec_options(spec)), state)
    finally:
        optimizer.close()
    return start, pieces_as_numpy(workload.model, mesh), len(optimizer.state)


def _finetune(world, run_dir: str, source: str, steps: int):
    from jobs.train.loop import train

    checkpoint = {"init_from": source, "every_steps": 3}
    spec = finetune_spec(run_dir, "finetune", (1, 2, 1), masked=False, checkpoint=checkpoint,
                         train={"steps": steps, "warmup_steps": 4, "lr_schedule": "cosine"})
    result, _ = train(spec, world, build_mesh(MeshShape(1, 2, 1), world.rank))
    return result.start_step


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("source")
    run_ranks(1, _save_source, str(run_dir), timeout=120)
    return run_dir / "source" / "checkpoints"


def test_init_from_takes_the_weights_only_and_starts_at_step_zero(source_checkpoint, tmp_path) -> None:
    from hpc.checkpoint.discovery import find_latest
    from hpc.checkpoint.format import read_index
    from hpc.checkpoint.load import read_tensor

    step_dir = find_latest(source_checkpoint)
    index = read_index(step_dir)
    assert index.step == STEPS and "model/embedding.tokens.weight" in index.tensors  # frozen, still saved
    assert not any(name.startswith("optim/embedding.tokens.") for name in index.tensors)  # and never stepped
    results = run_ranks(2, _start_from, str(tmp_path), (1, 2, 1), str(source_checkpoint), timeout=120)
    assert [start for start, _, _ in results] == [0, 0]
    assert [held for _, _, held in results] == [0, 0]  # fresh optimizer state
    params = assemble([pieces for _, pieces, _ in results])
    for name, value in params.items():
        np.testing.assert_array_equal(value, read_tensor(index, name).numpy(), err_msg=name)
    assert not np.array_equal(params["model/head.linear.weight"], _initial()["model/head.linear.weight"])


def test_the_schedule_counts_from_the_finetunes_first_step_and_a_requeue_continues_it(source_checkpoint,
                                                                                     tmp_path) -> None:
    from jobs.train.optim import learning_rate

    assert run_ranks(2, _finetune, str(tmp_path), str(source_checkpoint), 3, timeout=120) == [0, 0]
    records = _records(tmp_path, "finetune")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["lr"] for r in records] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4])  # the warm-up from its start
    # requeued with more steps: its own checkpoint (step 3) comes first, and the schedule goes on from there
    assert run_ranks(2, _finetune, str(tmp_path), str(source_checkpoint), 5, timeout=120) == [3, 3]
    records = _records(tmp_path, "finetune")
    assert [r["step"] for r in records][-2:] == [4, 5]
    assert records[-1]["lr"] == pytest.approx(learning_rate(LR, 4, 5, 4, "cosine"))


def _init_error(world, run_dir: str, source: str, model):
    from hpc.checkpoint.format import CheckpointError
    from jobs.train.loop import train

    spec = finetune_spec(run_dir, "bad", (1, 1, 2), 2, masked=False, checkpoint={"init_from": source}, model=model)
    try:
        train(spec, world, build_mesh(MeshShape(1, 1, 2), world.rank))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_init_from_a_missing_or_mismatched_checkpoint_is_one_error_on_every_rank(source_checkpoint, tmp_path) -> None:
    missing = str(tmp_path / "nowhere")
    assert run_ranks(2, _init_error, str(tmp_path), missing, {}, timeout=120) == [
        f"checkpoint.init_from={missing}: no complete checkpoint there"] * 2
    errors = run_ranks(2, _init_error, str(tmp_path), str(source_checkpoint), {"d_model": 64}, timeout=120)
    assert errors[0] == errors[1] and errors[0].startswith(f"checkpoint.init_from={source_checkpoint}: ")
    assert errors[0].endswith("embedding.tokens.weight is float32[256, 32] in "
                              f"{source_checkpoint / f'step-{STEPS:08d}'}, float32[256, 64] in this model "
                              "(the [model] settings must match its run's)")


@pytest.mark.parametrize(("checkpoint", "message"), [
    ({"init_from": "auto"}, "checkpoint.init_from must be a checkpoint path"),
    ({"init_from": "/runs/a/checkpoints", "resume": "/runs/b/checkpoints"},
     "checkpoint.resume must be 'auto' or 'never' with init_from set"),
])
def test_init_from_settings_that_contradict_are_one_line(checkpoint, message) -> None:
    from hpc.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        spec_from_dict({"checkpoint": checkpoint})


GPU_RTOL = 1e-4  # float32 on the GPU against the CPU: other summation orders (tests/test_cuda.py)


@pytest.mark.cuda
def test_on_the_gpu_the_masked_loss_and_frozen_parameters_train_like_one_cpu_process(masked_single, frozen_single,
                                                                                    tmp_path) -> None:
    """Two ranks sharing the GPU (dp=2 over Gloo): the masked mean over the global batch's counted targets, and
    frozen parameters that stay put, as the single CPU process trains them."""
    gpu = {"parallel": {"device": "cuda", "backend": "gloo"}}
    cases = [("gpu-masked-dp2", (2, 1, 1), 1, gpu), *_frozen_cases([("gpu-frozen-dp2", (2, 1, 1), 1, gpu)])]
    masked, frozen = zip(*run_ranks(2, _train, str(tmp_path), cases, timeout=300, device="cuda"), strict=True)
    losses, params = masked_single
    assert _losses(tmp_path, "gpu-masked-dp2") == pytest.approx(losses, rel=GPU_RTOL)
    assert_trained_close(assemble(masked), params, optimizer="adam", lr=LR, steps=STEPS, name="gpu-masked-dp2")
    losses, params = frozen_single["single"]
    assert _losses(tmp_path, "gpu-frozen-dp2") == pytest.approx(losses, rel=GPU_RTOL)
    _check_frozen(frozen, params, FROZEN, "gpu-frozen-dp2")

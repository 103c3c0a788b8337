"""The GPT under DP x TP x PP must train exactly like one process on the whole batch.

Every layout runs the real training loop (``jobs.train.loop.train``) for 10 steps of Adam
with gradient clipping active, fp32 and no compression, from the same seed. Losses
and gradient norms are read back from rank 0's metrics file; each rank returns its
parameters as pieces of the single-device tensors (what a checkpoint would write),
which are assembled and compared with the single-process run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from hpc.config import load_spec, spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.conftest import BOTH_BACKENDS
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks

STEPS, LR, CLIP = 10, 3e-3, 0.5
TINY_GPT = {"kind": "gpt", "n_layers": 4, "n_heads": 2, "d_model": 32, "seq_len": 16}
GPT_EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "gpt.toml"
MLP_EXAMPLE = GPT_EXAMPLE.with_name("mlp.toml")


def gpt_spec(run_dir: str, name: str, layout, schedule: str = "1f1b", microbatches: int = 1, virtual: int = 1,
             zero: int = 0, **train):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": TINY_GPT,
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": CLIP, "log_every": 100, **train},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "microbatches": microbatches,
                     "virtual_stages": virtual, "zero": zero},
    })


def pieces_as_numpy(model, mesh) -> list[tuple[str, tuple, tuple, np.ndarray]]:
    """This rank's parameters as (name, global shape, offsets, values): torch tensors cannot outlive a rank."""
    from jobs.train.checkpointing import model_pieces

    return [(p.name, p.global_shape, p.offsets, p.tensor.cpu().numpy().copy())
            for p in model_pieces(model, mesh.index("tp"), mesh.size("tp"))]


def assemble(per_rank) -> dict[str, np.ndarray]:
    """The single-device tensors from every rank's pieces; each element must come from some rank."""
    whole: dict[str, np.ndarray] = {}
    for pieces in per_rank:
        for name, global_shape, offsets, values in pieces:
            target = whole.setdefault(name, np.full(global_shape, np.nan, dtype=values.dtype))
            target[tuple(slice(o, o + n) for o, n in zip(offsets, values.shape, strict=True))] = values
    for name, values in whole.items():
        assert not np.isnan(values).any(), f"no rank holds part of {name}"
    return whole


def _train_cases(world, run_dir: str, cases, train_options=None):
    import torch

    from jobs.train.loop import train

    results = []
    for name, layout, schedule, microbatches, virtual in cases:
        # a process trains once: torch.compile's graphs of one case (traced without ZeRO-3's module hooks, which
        # Dynamo does not guard on) must not serve the next
        torch._dynamo.reset()
        spec = gpt_spec(run_dir, name, layout, schedule, microbatches, virtual, **(train_options or {}).get(name, {}))
        mesh = build_mesh(MeshShape(*layout), world.rank)
        _, model = train(spec, world, mesh)
        results.append(pieces_as_numpy(model, mesh))
    return results


def _metrics(run_dir: Path, name: str) -> tuple[list[float], list[float]]:
    records = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    (pieces,) = run_ranks(1, _train_cases, str(run_dir), [("single", (1, 1, 1), "1f1b", 1, 1)], timeout=120)[0]
    losses, norms = _metrics(run_dir, "single")
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert max(norms) > CLIP  # clipping is active, so its global norm matters
    return losses, norms, assemble([pieces])


def _initial_weights() -> dict[str, np.ndarray]:
    from jobs.models.gpt import build_gpt

    model = build_gpt(spec_from_dict({"model": TINY_GPT}).model, seed=5)
    return {f"model/{name}": value.detach().numpy() for name, value in model.state_dict().items()}


def _check_matches(single_process, run_dir: Path, cases, results) -> None:
    ref_losses, ref_norms, ref_params = single_process
    initial = _initial_weights()
    for number, (name, *_) in enumerate(cases):
        losses, norms = _metrics(run_dir, name)
        assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), name
        assert norms == pytest.approx(ref_norms, rel=LOSS_RTOL), name
        params = assemble([per_rank[number] for per_rank in results])
        # Adam: tests/numerics.py (a last-bit gradient difference may move a few elements by part of a step)
        assert_trained_close(params, ref_params, optimizer="adam", lr=LR, steps=STEPS, name=name)
        for key, expected in ref_params.items():
            assert not np.array_equal(expected, initial[key]), f"{key} did not train"


TWO_RANKS = [  # (name, (dp, tp, pp), schedule, microbatches, virtual stages)
    ("tp2", (1, 2, 1), "1f1b", 1, 1),
    ("pp2-gpipe", (1, 1, 2), "gpipe", 2, 1),
    ("pp2-1f1b", (1, 1, 2), "1f1b", 4, 1),
    ("pp2-interleaved", (1, 1, 2), "interleaved", 2, 2),
]
FOUR_RANKS = [
    ("dp2-tp2", (2, 2, 1), "1f1b", 1, 1),
    ("dp2-pp2-gpipe", (2, 1, 2), "gpipe", 2, 1),
    ("dp2-pp2-1f1b", (2, 1, 2), "1f1b", 2, 1),
    ("tp2-pp2-gpipe", (1, 2, 2), "gpipe", 4, 1),
    ("tp2-pp2-1f1b", (1, 2, 2), "1f1b", 2, 1),
]


@pytest.mark.parametrize("cases", [TWO_RANKS, FOUR_RANKS], ids=["2-ranks", "4-ranks"])
def test_every_layout_trains_like_one_process(single_process, tmp_path, cases) -> None:
    world_size = math.prod(cases[0][1])
    results = run_ranks(world_size, _train_cases, str(tmp_path), cases, timeout=300)
    _check_matches(single_process, tmp_path, cases, results)


def _check_close_in_bf16(single_process, run_dir: Path, name: str, pieces) -> None:
    """A bf16-autocast run against the float32 single process: losses within bf16's rounding, and the
    parameters' drift small beside the update itself."""
    ref_losses, _, ref_params = single_process
    bf16_losses, _ = _metrics(run_dir, name)
    assert bf16_losses == pytest.approx(ref_losses, rel=2e-2), name
    assert bf16_losses != pytest.approx(ref_losses, rel=1e-4), name  # bfloat16 did run: 8 bits of mantissa show
    params, initial = assemble(pieces), _initial_weights()
    # Adam turns small gradients' rounding into whole steps, so compare the updates as a whole
    drift = math.sqrt(sum(np.sum((params[k] - v) ** 2) for k, v in ref_params.items()))
    update = math.sqrt(sum(np.sum((v - initial[k]) ** 2) for k, v in ref_params.items()))
    print(f"{name}: bf16 drift {drift:.4g} against an update of {update:.4g}")
    assert drift < 0.1 * update, name


def test_recomputed_blocks_train_exactly_and_bf16_autocast_closely(single_process, tmp_path) -> None:
    cases = [("recompute", (1, 1, 2), "gpipe", 2, 1), ("bf16", (1, 2, 1), "1f1b", 1, 1)]
    options = {"recompute": {"activation_checkpointing": True}, "bf16": {"bf16_autocast": True}}
    results = run_ranks(2, _train_cases, str(tmp_path), cases, options, timeout=300)
    _check_matches(single_process, tmp_path, cases[:1], results)
    _check_close_in_bf16(single_process, tmp_path, "bf16", [per_rank[1] for per_rank in results])


def test_selectively_recomputed_blocks_train_exactly_under_pp_tp_and_compiled_zero3(single_process,
                                                                                   tmp_path) -> None:
    """``train.recompute = "selective"``: the blocks' products kept, their elementwise ops and (under TP) their
    all-reduces redone in backward, compiled with the checkpoint inside under ZeRO-3's gathers: the same training
    as one process."""
    cases = [("selective-pp2", (1, 1, 2), "gpipe", 2, 1), ("selective-tp2", (1, 2, 1), "1f1b", 1, 1),
             ("selective-compiled-dp2-zero3", (2, 1, 1), "1f1b", 1, 1)]
    options = {name: {"activation_checkpointing": True, "recompute": "selective"} for name, *_ in cases}
    options["selective-compiled-dp2-zero3"].update(compile=True, zero=3)
    results = run_ranks(2, _train_cases, str(tmp_path), cases, options, timeout=300)
    _check_matches(single_process, tmp_path, cases, results)


def test_compiled_blocks_train_like_one_process_under_tp_pp_recompute_zero3_and_bf16(single_process,
                                                                                    tmp_path) -> None:
    """``train.compile``: each block a torch.compile graph, inside a pipeline stage with its blocks recomputed,
    under ZeRO-3's gathers and releases, and under TP with bf16 autocast: the same training as one eager
    process (float32 within its rounding, bf16 within bf16's)."""
    cases = [("compiled-pp2-recompute", (1, 1, 2), "1f1b", 2, 1), ("compiled-dp2-zero3", (2, 1, 1), "1f1b", 1, 1),
             ("compiled-tp2-bf16", (1, 2, 1), "1f1b", 1, 1)]
    options = {"compiled-pp2-recompute": {"compile": True, "activation_checkpointing": True},
               "compiled-dp2-zero3": {"compile": True, "zero": 3},
               "compiled-tp2-bf16": {"compile": True, "bf16_autocast": True}}
    results = run_ranks(2, _train_cases, str(tmp_path), cases, options, timeout=600)
    _check_matches(single_process, tmp_path, cases[:2], results)
    _check_close_in_bf16(single_process, tmp_path, "compiled-tp2-bf16", [per_rank[2] for per_rank in results])


def test_the_fused_head_loss_trains_like_one_process_under_tp_pp_and_zero3(single_process, tmp_path) -> None:
    """``train.fused_head_loss``: the head's product and the loss made together on the last stage, the weight a
    vocabulary slice under TP, gathered by ZeRO-3's hooks around the loss's call: the same training as the
    unfused single process."""
    cases = [("fused-tp2-pp2", (1, 2, 2), "1f1b", 2, 1), ("fused-dp2-tp2-zero3", (2, 2, 1), "1f1b", 1, 1),
             ("fused-dp4-zero3", (4, 1, 1), "1f1b", 1, 1)]
    options = {"fused-tp2-pp2": {"fused_head_loss": True},
               "fused-dp2-tp2-zero3": {"fused_head_loss": True, "zero": 3},
               "fused-dp4-zero3": {"fused_head_loss": True, "zero": 3}}  # whole: its gradients made in forward
    results = run_ranks(4, _train_cases, str(tmp_path), cases, options, timeout=300)
    _check_matches(single_process, tmp_path, cases, results)


def test_the_learning_rate_scales_with_the_global_batch() -> None:
    from jobs.train.loop import base_learning_rate

    train = spec_from_dict({"train": {"lr": 0.1, "lr_reference_batch": 32}}).train
    assert base_learning_rate(train, 128) == pytest.approx(0.4)
    assert base_learning_rate(train, 16) == pytest.approx(0.05)
    assert base_learning_rate(spec_from_dict({"train": {"lr": 0.1}}).train, 128) == 0.1


def _clip_once(world, layout, max_norm: float):
    """One step's gradients under ``layout`` (dp = 1), clipped; returns the norm and the clipped gradients."""
    from jobs.train.layout import uses_pipeline
    from jobs.train.loop import clip_gradients, forward_backward
    from jobs.train.workloads import Workload
    from parallel.schedule import build_schedule
    from parallel.transport import TorchTransport

    spec = gpt_spec("unused", "clip", layout, "1f1b", microbatches=2)
    mesh = build_mesh(MeshShape(*layout), world.rank)
    workload = Workload(spec, mesh)
    actions = build_schedule("1f1b", layout[2], 2)[mesh.index("pp")] if uses_pipeline(spec.parallel) else None
    inputs, targets = workload.batch(0)
    forward_backward(workload, actions, TorchTransport(mesh.group("pp")), inputs, targets, microbatches=2)
    model = workload.model
    norm = float(clip_gradients(model, mesh, max_norm))
    grads = dict(model.named_parameters())
    return norm, [(name, shape, offsets, grads[name.removeprefix("model/")].grad.numpy().copy())
                  for name, shape, offsets, _ in pieces_as_numpy(model, mesh)]


def test_clipping_across_tp_and_pp_equals_torch_on_the_single_device_model() -> None:
    import torch

    from jobs.data.datasets import byte_windows, load_licenses, window_starts
    from jobs.models.gpt import build_gpt, lm_loss

    results = run_ranks(4, _clip_once, (1, 2, 2), 0.1, timeout=120)
    spec = gpt_spec("unused", "clip", (1, 1, 1))
    model = build_gpt(spec.model, spec.job.seed)
    corpus = load_licenses()
    inputs, targets = byte_windows(corpus.train, window_starts(len(corpus.train), 8, 16, seed=5, step=0), 16)
    lm_loss(model(inputs), targets).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item()
    assert expected_norm > 0.1
    for norm, _ in results:
        assert norm == pytest.approx(expected_norm, rel=1e-5)
    grads = assemble([pieces for _, pieces in results])
    for name, param in model.named_parameters():
        np.testing.assert_allclose(grads[f"model/{name}"], param.grad.numpy(), rtol=1e-4, atol=1e-8, err_msg=name)


@pytest.mark.parametrize(
    ("example", "args", "message"),
    [
        (GPT_EXAMPLE, ["-n", "6", "--set", "parallel.tp=3"], "model.n_heads=4 is not divisible by parallel.tp=3"),
        (GPT_EXAMPLE, ["-n", "4", "--set", "parallel.tp=1", "--set", "parallel.pp=4", "--set",
                       "parallel.schedule=interleaved", "--set", "parallel.virtual_stages=2"],
         "model.n_layers=4 is not divisible by parallel.pp * virtual stages = 4*2 = 8"),
        (GPT_EXAMPLE, ["-n", "4", "--set", "parallel.microbatches=3"],
         "data.batch_size=32 is not divisible by dp * parallel.microbatches = 1*3 = 3"),
        (GPT_EXAMPLE, ["-n", "4", "--set", "parallel.virtual_stages=2"],
         "virtual_stages=2 needs schedule='interleaved'"),
        (GPT_EXAMPLE, ["-n", "4", "--set", "parallel.schedule=interleaved", "--set", "parallel.microbatches=2",
                       "--set", "parallel.tp=1", "--set", "parallel.pp=4"], "microbatches to be a multiple"),
        (MLP_EXAMPLE, ["-n", "4", "--set", "parallel.tp=2"], "model.kind='mlp' has no tp_plan and no pipeline_parts"),
        (GPT_EXAMPLE, ["-n", "4", "--set", "data.name=digits"], "model.kind='gpt' trains on data.name='licenses'"),
        (GPT_EXAMPLE.with_name("gpt_moe.toml"), ["-n", "2"], "parallel.ep=4 does not divide dp=2"),
    ],
)
def test_a_layout_that_does_not_fit_is_one_error_line_before_launch(capsys, example, args, message) -> None:
    from hpc.cli.main import main

    code = main(["run", "--launcher", "local", "--dry-run", *args, str(example)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.match(r"hpc: error: ", err) and message in err


def test_the_gpt_example_passes_the_checks_and_runs_3d_on_four_ranks(capsys) -> None:
    from hpc.cli.main import main
    from jobs.train.layout import check_layout

    spec = load_spec(GPT_EXAMPLE)
    shape = check_layout(spec, 4)
    assert shape.tp * shape.pp > 1 and shape.pp > 1, shape
    assert main(["run", "-n", "4", "--launcher", "local", "--dry-run", str(GPT_EXAMPLE)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_the_gpt_summary_reports_tokens_per_second_and_the_held_out_loss() -> None:
    from types import SimpleNamespace

    from hpc.cli.rank import summary_line
    from jobs.train.loop import TrainResult

    result = TrainResult(steps=120, final_loss=2.5157, evaluation={"held_out_loss": 2.7032}, throughput=6121.4,
                         unit="tokens", wall_s=40.1)
    world = SimpleNamespace(size=4, backend="gloo", info=SimpleNamespace(launcher=SimpleNamespace(value="openmpi")))
    line = summary_line(result, world, MeshShape(1, 2, 2), "runs/gpt-licenses/metrics.jsonl")
    assert line == ("summary: 120 steps in 40.1 s | final loss 2.5157 | held-out loss 2.7032 | 6,121 tokens/s | "
                    "4 ranks (dp=1 tp=2 pp=2) gloo via openmpi | metrics runs/gpt-licenses/metrics.jsonl")
    resumed = summary_line(dataclasses.replace(result, start_step=100), world, MeshShape(1, 2, 2), "m.jsonl")
    assert resumed.startswith("summary: steps 101-120 (resumed) in 40.1 s | ")


@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_adamw_takes_the_clip_factor_into_its_step_as_torch_clips(fused: bool) -> None:
    """The clip leaves the gradients to a fused AdamW's step (``grad_scale``) instead of a pass of its own;
    the step then lands where torch's clip_grad_norm_ and the same AdamW land, within rounding (one
    division by the factor's reciprocal against a multiplication: an ulp of a gradient, which Adam's first
    step, lr * g / (|g| + eps), passes on as at most an ulp of the update)."""
    import torch

    from parallel.clip import clip_grad_norm_, scaled_step

    lr = 0.01
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    for net in (model, reference):
        net(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    raw = [p.grad.clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    expected = torch.optim.AdamW(reference.parameters(), lr=lr, fused=fused)

    norm = clip_grad_norm_(list(model.parameters()), 0.5, counted=list(model.parameters()), optimizer=optimizer)
    assert float(norm) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)), rel=1e-6)
    assert float(norm) > 0.5  # the factor clips
    left_whole = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), raw, strict=True))
    assert left_whole == fused and hasattr(optimizer, "grad_scale") == fused
    with scaled_step(optimizer):
        optimizer.step()
    expected.step()
    assert not hasattr(optimizer, "grad_scale")  # a later step does not divide again
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=2**-22, atol=0)
        torch.testing.assert_close(ours, theirs, rtol=2**-22, atol=lr * 2**-20)


def _compiled_graphs(world, run_dir: str) -> list[tuple[int, int]]:
    """(graphs, operations in them) torch.compile made while training on dp 2, without ZeRO and under ZeRO-3."""
    import torch
    from torch._dynamo.utils import counters

    from jobs.train.loop import train

    made = []
    for zero in (0, 3):
        torch._dynamo.reset()
        counters.clear()
        spec = gpt_spec(run_dir, f"graphs-zero{zero}", (2, 1, 1), zero=zero, compile=True)
        train(spec, world, build_mesh(MeshShape(2, 1, 1), world.rank))
        made.append((counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]))
    return made


@BOTH_BACKENDS
def test_zero3_leaves_the_compiled_blocks_graphs_whole(tmp_path, backend) -> None:
    """ZeRO-3 gathers a compiled block's parameters around its graph: the same graphs, capturing the same
    operations, as without ZeRO (its hooks on the modules inside broke each block's graph at every one). Under
    NCCL's rules the gather is the backend's own all-gather, issued inline, which the compiler would trace."""
    for without, zero3 in run_ranks(2, _compiled_graphs, str(tmp_path), timeout=300, backend=backend):
        assert zero3 == without

"""Tied embeddings under pipeline parallelism (parallel/tied.py): a transformers model with
``tie_word_embeddings = true`` (a tied Llama, a tied Qwen2) under pp > 1.

The first and the last stage each hold a copy of ``model.embed_tokens.weight`` (the head's weight), their
gradients summed over the embedding group before clipping. Every layout (TP's vocabulary-parallel head,
interleaved 1F1B, ZeRO 1-3, a frozen embedding, the masked loss) trains like one process
(tests/numerics.py), the two copies are bitwise equal after every step, the checkpoint holds the tensor once,
resumes from pp = 2 under pp = 1 and back, and exports to a directory ``from_pretrained`` loads with the
trained logits. Without processes: the embedding group's ranks, and ZeRO giving the copies to DP rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks
from tests.test_3d import CLIP, LR, assemble, pieces_as_numpy
from tests.test_hf import ENTRY, SEQ, TINY, _ids

pytest.importorskip("transformers")

TIED = "model/model.embed_tokens.weight"
FREEZE = ["model.embed_tokens.*"]
MASKED = {"entry": "tests.test_finetune:masked_licenses", "args": {"seq_len": SEQ}}


def tied_spec(run_dir: str, name: str, layout, model_type: str = "llama", steps: int = 10, microbatches: int = 1,
              schedule: str = "1f1b", virtual: int = 1, zero: int = 0, freeze=(), masked: bool = False,
              every: int = 0, resume: str = "never", device: str = "cpu", fused: bool = False):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {"entry": ENTRY, "args": {**TINY, "model_type": model_type, "tie_word_embeddings": True},
                  "seq_len": SEQ},
        "data": {**(MASKED if masked else {"name": "licenses"}), "batch_size": 8},
        "train": {"steps": steps, "lr": LR, "optimizer": "adam", "grad_clip": CLIP, "log_every": 100,
                  "freeze": list(freeze), "fused_head_loss": fused},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "microbatches": microbatches,
                     "virtual_stages": virtual, "zero": zero,
                     **({"device": device, "backend": "gloo"} if device != "cpu" else {})},
        "checkpoint": {"every_steps": every, "keep": 5, "resume": resume},
    })


def _copies_equal(runner) -> bool | None:
    """Whether this rank's copy of each tied weight is bitwise the other stage's (collective over the embedding
    group); None where the rank holds none (a middle stage, pp = 1, ZeRO-3's other DP ranks)."""
    import torch.distributed as dist

    group, model = runner.workload.embedding_group, runner.workload.model
    if group is None:
        return None
    held = [p for p in group.parameters(model) if runner.optimizer.holds_parameter(p)]
    equal = []
    for param in held:
        both = [torch.empty_like(param, device="cpu"), torch.empty_like(param, device="cpu")]
        dist.all_gather(both, param.detach().cpu(), group=group.group)  # on the host: Gloo, a shared GPU
        equal.append(torch.equal(both[0], both[1]))
    return all(equal) if held else None


def _train_tied(world, run_dir: str, cases):
    """Each case: (name, layout, tied_spec options); this rank's parameters after it, as pieces, and whether the
    tied copies were bitwise equal after each step."""
    from jobs.train import loop

    run = loop.StepRunner.run
    checks: list[bool | None] = []

    def checked(self, step):
        report = run(self, step)
        checks.append(_copies_equal(self))
        return report

    loop.StepRunner.run = checked
    results = []
    for name, layout, options in cases:
        torch._dynamo.reset()
        mesh = build_mesh(MeshShape(*layout), world.rank)
        checks.clear()
        _, model = loop.train(tied_spec(run_dir, name, layout, **options), world, mesh)
        results.append((pieces_as_numpy(model, mesh), list(checks)))
    return results


def _metrics(run_dir: Path, name: str) -> tuple[list[float], list[float]]:
    records = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _step_dir(run_dir: Path, name: str, step: int) -> Path:
    return run_dir / name / "checkpoints" / f"step-{step:08d}"


def _run(ranks: int, run_dir: Path, cases,
         device: str = "cpu") -> dict[str, tuple[dict[str, np.ndarray], list[list[bool | None]]]]:
    """{name: (assembled parameters, each rank's per-step copy checks)}."""
    per_rank = run_ranks(ranks, _train_tied, str(run_dir), cases, timeout=600, device=device)
    return {name: (assemble([results[number][0] for results in per_rank]),
                   [results[number][1] for results in per_rank])
            for number, (name, *_) in enumerate(cases)}


# each single process, the options the layouts share with it, the layouts (name, (dp, tp, pp), options)
SINGLES = [("single", {"steps": 20, "every": 10}), ("qwen2-single", {"model_type": "qwen2"}),
           ("frozen-single", {"freeze": FREEZE}), ("masked-single", {"masked": True})]
TWO_RANKS = [("pp2", (1, 1, 2), {"microbatches": 2, "every": 10}),
             ("pp2-interleaved", (1, 1, 2), {"schedule": "interleaved", "microbatches": 2, "virtual": 2}),
             ("frozen-pp2", (1, 1, 2), {"microbatches": 2, "freeze": FREEZE}),
             ("masked-pp2", (1, 1, 2), {"microbatches": 2, "masked": True})]
FOUR_RANKS = [("tp2-pp2", (1, 2, 2), {"microbatches": 2, "every": 10}),
              ("qwen2-tp2-pp2", (1, 2, 2), {"microbatches": 2, "model_type": "qwen2"}),
              *[(f"dp2-pp2-zero{z}", (2, 1, 2), {"microbatches": 2, "zero": z}) for z in (1, 2, 3)],
              ("fused-tp2-pp2", (1, 2, 2), {"microbatches": 2, "fused": True})]  # the head's loss fused, on pp 1
REFERENCES = {"single": ["pp2", "pp2-interleaved", "tp2-pp2", "dp2-pp2-zero1", "dp2-pp2-zero2", "dp2-pp2-zero3",
                         "fused-tp2-pp2"],
              "qwen2-single": ["qwen2-tp2-pp2"], "frozen-single": ["frozen-pp2"], "masked-single": ["masked-pp2"]}
# a checkpoint of pp = 2 resumed under pp = 1, and one of pp = 1 under pp = 2, both to step 20
RESUMES = [("pp2-to-pp1", (1, 1, 1), {"steps": 20, "resume": ("pp2", 10)}),
           ("pp1-to-pp2", (1, 1, 2), {"steps": 20, "microbatches": 2, "resume": ("single", 10)})]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tied")
    singles = [(name, (1, 1, 1), options) for name, options in SINGLES]
    runs = _run(1, run_dir, singles) | _run(4, run_dir, FOUR_RANKS) | _run(2, run_dir, TWO_RANKS)
    for name, layout, options in RESUMES:
        resumed = {**options, "resume": str(_step_dir(run_dir, *options["resume"]))}
        runs |= _run(layout[2], run_dir, [(name, layout, resumed)])
    return run_dir, runs


@pytest.mark.slow
def test_tied_models_train_under_every_layout_like_one_process(trained) -> None:
    from jobs.models.protocol import build_model

    run_dir, runs = trained
    for reference, cases in REFERENCES.items():
        losses, norms = (values[:10] for values in _metrics(run_dir, reference))
        assert losses[-1] < losses[0] - 0.1 and max(norms) > CLIP  # it learns; clipping's global norm matters
        expected = runs[reference][0]
        if reference == "single":  # its parameters at step 10, as the layouts' (it trained to 20)
            expected = _model_tensors(_step_dir(run_dir, "single", 10))
        options = dict(SINGLES)[reference]
        initial = build_model(tied_spec("unused", "initial", (1, 1, 1), **{k: v for k, v in options.items()
                                                                         if k in ("model_type", "masked")}))
        for name in cases:
            assert _metrics(run_dir, name) == (pytest.approx(losses, rel=LOSS_RTOL),
                                               pytest.approx(norms, rel=LOSS_RTOL)), name
            assert_trained_close(runs[name][0], expected, optimizer="adam", lr=LR, steps=10, name=name)
            trained_tied = not np.array_equal(runs[name][0][TIED], initial.state_dict()[TIED[6:]].numpy())
            assert trained_tied == (reference != "frozen-single"), name  # frozen: both copies stay put


@pytest.mark.slow
def test_the_two_copies_are_bitwise_equal_after_every_step(trained) -> None:
    _, runs = trained
    for name, layout, _ in TWO_RANKS + FOUR_RANKS:
        checks = runs[name][1]
        assert all(len(rank) == 10 for rank in checks), name
        holders = [rank for rank in checks if rank[0] is not None]  # the ranks holding a copy
        dp, tp, _ = layout
        assert len(holders) == 2 * tp * (1 if "zero3" in name else dp), name  # ZeRO-3: DP rank 0's only
        assert all(all(rank) for rank in holders), name


def _model_tensors(step_dir: Path) -> dict[str, np.ndarray]:
    from hpc.checkpoint import open_checkpoint, read_tensor

    index = open_checkpoint(step_dir)
    return {name: read_tensor(index, name).numpy() for name in index.tensors if name.startswith("model/")}


@pytest.mark.slow
def test_the_checkpoint_holds_the_tensor_once_and_resumes_from_pp2_under_pp1_and_back(trained) -> None:
    from hpc.checkpoint import open_checkpoint

    run_dir, runs = trained
    for name in ("single", "pp2", "tp2-pp2"):
        names = open_checkpoint(_step_dir(run_dir, name, 10)).tensors
        assert TIED in names and "model/lm_head.weight" not in names, name
        assert "optim/model.embed_tokens.weight/exp_avg" in names and not any("lm_head" in n for n in names), name
    reference, _ = _metrics(run_dir, "single")
    expected = _model_tensors(_step_dir(run_dir, "single", 20))
    for name, *_ in RESUMES:
        losses, _ = _metrics(run_dir, name)
        assert losses == pytest.approx(reference[10:], rel=LOSS_RTOL), name
        assert_trained_close(runs[name][0], expected, optimizer="adam", lr=LR, steps=20, name=name)
    assert all(all(rank) for rank in runs["pp1-to-pp2"][1])  # the copies loaded equal, and stayed so


@pytest.mark.slow
def test_the_hf_export_of_a_tied_tp_pp_checkpoint_gives_the_trained_models_logits(trained, tmp_path) -> None:
    from transformers import LlamaForCausalLM

    from hpc.cli.main import main
    from jobs.models.hf import causal_lm

    run_dir, runs = trained
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(_step_dir(run_dir, "tp2-pp2", 10)), "--to", str(out), "--format", "hf"]) == 0
    loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied as it was trained
    model = causal_lm(**TINY, tie_word_embeddings=True)
    missing, unexpected = model.load_state_dict({key.removeprefix("model/"): torch.from_numpy(value)
                                                 for key, value in runs["tp2-pp2"][0].items()}, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # the tied alias: the same tensor
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=_ids()).logits, model.eval()(_ids()), rtol=0, atol=1e-5)


def test_the_embedding_group_pairs_each_pipelines_first_and_last_stage() -> None:
    from parallel.tied import embedding_group_ranks

    shape = MeshShape(dp=2, tp=2, pp=3)  # rank = tp + 2 * (dp + 2 * pp)
    assert embedding_group_ranks(shape) == [(0, 8), (1, 9), (2, 10), (3, 11)]
    for first, last in embedding_group_ranks(shape):
        a, b = shape.coords(first), shape.coords(last)
        assert (a["pp"], b["pp"]) == (0, 2) and (a["dp"], a["tp"]) == (b["dp"], b["tp"])
    assert embedding_group_ranks(MeshShape(dp=4, tp=1, pp=1)) == []


def _owners(world):
    """Who owns each of three parameters at ZeRO stage 1 and per bucket (stage 2), with the smallest given to rank
    0 (``owned_first``) and without."""
    import torch.distributed as dist

    from parallel.zero import ZeroShards

    small, large, mid = torch.zeros(10), torch.zeros(100), torch.zeros(50)
    params = [small, large, mid]
    owners = []
    for buckets in ((), ([small, large], [mid])):
        for pinned in ((), (small,)):
            shards = ZeroShards(params, dist.group.WORLD, buckets, pinned)
            owners.append([shards.owner(p) for p in params])
    return owners


def test_zero_gives_the_tied_copies_to_dp_rank_0_whatever_their_size() -> None:
    """At ZeRO-2 and 3 only the owner keeps the gradient: both stages' copies must be the same DP index's."""
    for owners in run_ranks(2, _owners):
        assert owners == [[1, 0, 1], [0, 1, 0], [1, 0, 1], [0, 1, 0]]  # the rest balanced around it


@pytest.mark.cuda
def test_on_the_gpu_a_tied_llama_under_pp2_trains_like_one_cpu_process(tmp_path) -> None:
    """Two pipeline ranks sharing the GPU (over Gloo): the embedding group's all-reduce of CUDA gradients."""
    gpu_rtol = 1e-4  # float32 on the GPU against the CPU: other summation orders (tests/test_cuda.py)
    single = _run(1, tmp_path, [("single", (1, 1, 1), {})])
    gpu = _run(2, tmp_path, [("gpu-pp2", (1, 1, 2), {"microbatches": 2, "device": "cuda"})], device="cuda")
    assert _metrics(tmp_path, "gpu-pp2")[0] == pytest.approx(_metrics(tmp_path, "single")[0], rel=gpu_rtol)
    assert_trained_close(gpu["gpu-pp2"][0], single["single"][0], optimizer="adam", lr=LR, steps=10, name="gpu-pp2")
    assert all(all(rank) for rank in gpu["gpu-pp2"][1])  # both ranks hold a copy, bitwise equal every step

"""``train.float8``: refused in one line where FP8 cannot run (the CPU, before launch and on every rank); on a GPU
with FP8 the blocks' Linears and the TP shards' products train through torchao's Float8 matmul, close to bf16,
the head left in bf16."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpc.config import spec_from_dict
from hpc.errors import ConfigError
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks

# make test installs torchao here, apart from transformers (which imports it wherever it is installed); the
# ranks' forkserver hands them this path
TORCHAO = Path(__file__).resolve().parents[1] / ".stamps" / "torchao"
if TORCHAO.is_dir() and str(TORCHAO) not in sys.path:
    sys.path.insert(0, str(TORCHAO))

TINY_GPT = {"kind": "gpt", "n_layers": 2, "n_heads": 2, "d_model": 64, "seq_len": 32}  # every Linear a multiple of 16
STEPS = 30


def _spec(run_dir: str, name: str, float8: str, layout=(1, 1, 1), device: str = "auto", compile: bool = False,
          zero: int = 0):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": TINY_GPT,
        "data": {"name": "licenses", "batch_size": 16},
        "train": {"steps": STEPS, "lr": 3e-3, "optimizer": "adamw", "grad_clip": 1.0, "log_every": 100,
                  "bf16_autocast": True, "float8": float8, "compile": compile},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "device": device, "zero": zero},
    })


def test_the_cpu_is_refused_in_one_line_naming_the_key() -> None:
    import torch

    from jobs.train.float8 import float8_refusal
    from jobs.train.layout import check_layout, check_this_machine

    assert float8_refusal("rowwise", torch.device("cpu")) == (
        "train.float8='rowwise': Float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, "
        "Blackwell); this run computes on the CPU (set train.float8='off')")
    with pytest.raises(ConfigError, match=r"^train.float8='tensorwise': .*parallel.device='cpu'"):
        check_layout(_spec("/tmp", "x", "tensorwise", device="cpu"), 1)  # hpc submit's check, torch-free
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="this run computes on the CPU"):
            check_this_machine(_spec("/tmp", "x", "rowwise"))  # hpc run's, for ranks on this machine
    check_this_machine(_spec("/tmp", "x", "off"))


def _emulated_steps(world, tp: int, recipe: str, steps: int = 8, compile: bool = False):
    """The GPT split over ``tp`` ranks, its blocks converted with torchao's emulated Float8 (the casts and scales
    of the GPU's, the product in float32), trained ``steps`` steps of Adam in one process: the losses, and the
    blocks' layers converted (Float8Linear, or a TP layer's Float8 product)."""
    import torch
    from torch import nn

    from jobs.data.datasets import byte_windows, load_licenses, window_starts
    from jobs.models.gpt import build_gpt, lm_loss
    from jobs.train.float8 import apply_float8
    from jobs.train.parallelize import parallelize_tp

    cfg = spec_from_dict({"model": TINY_GPT}).model
    group = build_mesh(MeshShape(dp=1, tp=tp, pp=1), world.rank).group("tp") if tp > 1 else None
    model = build_gpt(cfg, seed=5)
    if group is not None:
        parallelize_tp(model, model.tp_plan, group)
    count = apply_float8(list(model.blocks), recipe, torch.device("cpu"), emulate=True)
    for block in model.blocks if compile else ():  # as the trainer does: converted, then compiled
        # traced by Dynamo and AOTAutograd as under inductor, run without inductor's CPU code for the Float8
        # casts (which gave NaN losses with ATEN_CPU_CAPABILITY=avx2 here: a CPU's kernels, not the tracing)
        block.compile(backend="aot_eager")
    converted = sorted(name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"
                       or getattr(m, "product", None) not in (None, nn.functional.linear))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    corpus, losses = load_licenses(), []
    for step in range(steps):
        inputs, targets = byte_windows(corpus.train, window_starts(len(corpus.train), 8, cfg.seq_len, 5, step),
                                       cfg.seq_len)
        loss = lm_loss(model(inputs), targets, group if group is not None else None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return count, converted, losses


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_emulated_float8_converts_the_blocks_and_trains_alike_whole_and_split_over_tp(recipe: str) -> None:
    """Every Linear of the blocks converted (the head not: it is outside them), the same layers whole and as TP
    shards (where the shards' products go through the Float8 matmul); losses of TP=2 track TP=1's: a row-parallel
    shard scales its half of each row by that half's own maximum, so its casts round differently, by up to half
    an e4m3 step (2^-4 of a value), averaged over the products' sums."""
    pytest.importorskip("torchao")
    ((count, converted, whole),) = run_ranks(1, _emulated_steps, 1, recipe)
    blocks = [f"blocks.{i}.{layer}" for i in range(TINY_GPT["n_layers"])
              for layer in ("attention.proj", "attention.qkv", "mlp.fc", "mlp.proj")]
    assert (count, converted) == (len(blocks), sorted(blocks))
    assert whole[-1] < whole[0] - 0.5  # it learns
    for count, converted, split in run_ranks(2, _emulated_steps, 2, recipe):
        assert (count, converted) == (len(blocks), sorted(blocks))
        assert split == pytest.approx(whole, rel=0.02) and split != whole


def test_emulated_float8_compiled_under_tp_trains_as_compiled_tp1() -> None:
    """train.compile over converted blocks: torchao's Float8 matmul and our TP shards' Float8Product traced into
    each block's graph (Dynamo and AOTAutograd; inductor's kernels are the GPU's business); TP=2 within the same
    bound of TP=1."""
    pytest.importorskip("torchao")
    ((_, _, whole),) = run_ranks(1, _emulated_steps, 1, "rowwise", 4, True, timeout=300)
    for _, _, split in run_ranks(2, _emulated_steps, 2, "rowwise", 4, True, timeout=300):
        assert split == pytest.approx(whole, rel=0.02)


def _train(world, run_dir: str, cases):
    """Each (name, float8, layout[, options]) in turn; per case, the Float8 layers and the names left in bf16."""
    import torch
    from torch import nn

    from jobs.train.loop import train

    done = []
    for name, float8, layout, *options in cases:
        torch._dynamo.reset()  # a compiled case's graphs are its own
        mesh = build_mesh(MeshShape(*layout), world.rank, world.device)
        try:
            _, model = train(_spec(run_dir, name, float8, layout, **(options[0] if options else {})), world, mesh)
        except ConfigError as exc:
            done.append(str(exc))
            continue
        converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"
                     or getattr(m, "product", None) not in (None, nn.functional.linear)]
        kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        done.append((converted, kept, torch.cuda.get_device_capability()))
    return done


def _losses(run_dir: Path, name: str) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / name / "metrics.jsonl").open()]


def test_a_rank_on_the_cpu_stops_with_the_line() -> None:
    (results,) = run_ranks(1, _train, "/tmp/hpc-float8-cpu", [("cpu", "rowwise", (1, 1, 1))])
    assert results[0].startswith("train.float8='rowwise': Float8 matmuls need an NVIDIA GPU")


@pytest.mark.cuda
def test_float8_trains_close_to_bf16_whole_and_split_over_tp(tmp_path) -> None:
    """One process in bf16, then Float8 rowwise and tensorwise, then rowwise under TP=2 and compiled under
    ZeRO-3 over dp=2 (two ranks sharing the GPU over Gloo): the losses of 30 steps track bf16's (e4m3 keeps 3
    mantissa bits, so a product is off by a few percent of its size, and the loss by far less), the head stays an
    nn.Linear."""
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Float8 needs compute capability 8.9")
    pytest.importorskip("torchao")
    (one,) = run_ranks(1, _train, str(tmp_path), [("bf16", "off", (1, 1, 1)), ("rowwise", "rowwise", (1, 1, 1)),
                                                   ("tensorwise", "tensorwise", (1, 1, 1))], timeout=600,
                       device="cuda")
    zero3 = ("compiled-zero3", "rowwise", (2, 1, 1), {"compile": True, "zero": 3})
    split = run_ranks(2, _train, str(tmp_path), [("rowwise-tp2", "rowwise", (1, 2, 1)), zero3], timeout=600,
                      device="cuda")
    bf16 = _losses(tmp_path, "bf16")
    assert bf16[-1] < bf16[0] - 0.5
    names = ("rowwise", "tensorwise", "rowwise-tp2", "compiled-zero3")
    for (converted, kept, _), name in zip([*one[1:], *split[0]], names, strict=True):
        assert len(converted) == 2 * 4, (name, converted)  # each block: qkv, proj, fc, proj
        assert kept == ["head.linear"] or name == "rowwise-tp2", (name, kept)
        losses = _losses(tmp_path, name)
        assert losses[-1] == pytest.approx(bf16[-1], rel=0.03), name
        assert losses != bf16, name  # Float8 did run

"""The trainer on a GPU (marker ``cuda``; skipped where CUDA is absent).

- Every layout, its ranks sharing the one GPU over Gloo (NCCL refuses two ranks on one GPU), trains the
  tiny GPT like one CUDA process: the same losses and gradient norms over 10 steps of Adam with clipping,
  float32. A lossy codec changes what is learned, so its CUDA run is compared with its CPU run instead.
- An NCCL world of one trains the GPT and the Llama with parameters on the GPU, device memory, MFU and times.
- Every example runs on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks

pytestmark = pytest.mark.cuda  # skipped where CUDA is absent (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
STEPS, LR, CLIP = 10, 3e-3, 0.5
TINY_GPT = {"kind": "gpt", "n_layers": 4, "n_heads": 2, "d_model": 32, "seq_len": 16}
TINY_MOE = {**TINY_GPT, "moe_experts": 4, "moe_top_k": 2, "moe_every": 2}
# float32 on the GPU: layouts sum in other orders (split matrix products, the ring), and Adam turns
# last-bit differences of small gradients into update differences (tests/numerics.py); losses stay close.
LOSS_RTOL = 1e-4
CODEC_RTOL = 1e-3  # a lossy codec on the GPU against the same codec on the CPU: rounding at quantization edges


def _spec(run_dir: str, name: str, layout, model=None, compile: bool = False, **parallel):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": model or TINY_GPT,
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": CLIP, "log_every": 100,
                  "compile": compile},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, **parallel},
    })


def _train_cases(world, run_dir: str, cases):
    """Each case in turn on these ranks: (name, layout, device, model, parallel options). Returns, per case,
    whether every parameter ended on the mesh's device, and the rank's peak device memory."""
    from jobs.train.loop import train

    done = []
    for name, layout, device, model, parallel in cases:
        torch._dynamo.reset()  # a compiled case's graphs are its own (Dynamo does not guard on module hooks)
        mesh = build_mesh(MeshShape(*layout), world.rank, world.device if device == "cuda" else "cpu")
        torch.cuda.reset_peak_memory_stats()
        _, trained = train(_spec(run_dir, name, layout, model, **parallel), world, mesh)
        placed = all(p.device.type == mesh.device.type for p in trained.parameters())
        done.append((placed, torch.cuda.max_memory_allocated()))
    return done


def _losses(run_dir: Path, name: str) -> tuple[list[float], list[float]]:
    records = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), name
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _run(n: int, run_dir: Path, cases) -> None:
    results = run_ranks(n, _train_cases, str(run_dir), cases, timeout=600, device="cuda")
    for number, (name, _, device, *_) in enumerate(cases):
        for rank, per_case in enumerate(results):
            placed, peak = per_case[number]
            assert placed, f"{name}: rank {rank} holds parameters off its {device} mesh device"
            if device == "cuda":
                assert peak > 0, f"{name}: rank {rank} allocated no GPU memory"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One CUDA process: the dense GPT and the MoE GPT."""
    run_dir = tmp_path_factory.mktemp("one")
    _run(1, run_dir, [("dense", (1, 1, 1), "cuda", None, {}), ("moe", (1, 1, 1), "cuda", TINY_MOE, {})])
    dense = _losses(run_dir, "dense")
    assert dense[0][-1] < dense[0][0] - 0.5  # it learns
    return {"dense": dense, "moe": _losses(run_dir, "moe")}


def _assert_close(run_dir: Path, name: str, expected, rtol: float) -> None:
    losses, norms = _losses(run_dir, name)
    assert losses == pytest.approx(expected[0], rel=rtol), name
    assert norms == pytest.approx(expected[1], rel=rtol * 10), name


TWO_RANKS = [  # (name, layout, device, model, parallel options): each must equal one CUDA process
    ("dp2", (2, 1, 1), "cuda", None, {}),
    ("tp2", (1, 2, 1), "cuda", None, {}),
    ("pp2-gpipe", (1, 1, 2), "cuda", None, {"schedule": "gpipe", "microbatches": 2}),
    ("pp2-1f1b", (1, 1, 2), "cuda", None, {"schedule": "1f1b", "microbatches": 4}),
    ("pp2-interleaved", (1, 1, 2), "cuda", None, {"schedule": "interleaved", "microbatches": 4,
                                                    "virtual_stages": 2}),
    *[(f"zero{stage}", (2, 1, 1), "cuda", None, {"zero": stage}) for stage in (1, 2, 3)],
    ("ep2", (2, 1, 1), "cuda", TINY_MOE, {"ep": 2}),
]
LOSSY = ["fp16", "bf16", "int8", "topk", "powersgd"]  # each on CUDA and on the CPU
FOUR_RANKS = [
    ("dp2-tp2", (2, 2, 1), "cuda", None, {}),
    ("dp2-pp2", (2, 1, 2), "cuda", None, {"microbatches": 2}),
    ("tp2-pp2", (1, 2, 2), "cuda", None, {"microbatches": 4}),
    ("ep4", (4, 1, 1), "cuda", TINY_MOE, {"ep": 4}),
]


def _assert_timed(run_dir: Path, name: str) -> None:
    """The step's times from CUDA events (hpc/observe/stopwatch.py): communication took time on the device, and
    what the compute stream waited for is part of the step."""
    for r in [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]:
        assert r["comm_s"] > 0 and 0 <= r["wait_s"] <= r["step_time_s"], (name, r)
        assert r["compute_s"] == pytest.approx(r["step_time_s"] - r["wait_s"]), (name, r)


def test_two_ranks_sharing_the_gpu_train_like_one_cuda_process(reference, tmp_path) -> None:
    lossy = [(f"{codec}-{device}", (2, 1, 1), device, None, {"compression": codec})
             for codec in LOSSY for device in ("cuda", "cpu")]
    _run(2, tmp_path, TWO_RANKS + lossy)
    for name, _, _, model, _ in TWO_RANKS:
        _assert_close(tmp_path, name, reference["moe" if model else "dense"], LOSS_RTOL)
        if name != "tp2":  # no DP group, no pipeline: nothing between the steps' computations
            _assert_timed(tmp_path, name)
    for codec in LOSSY:
        _assert_close(tmp_path, f"{codec}-cuda", _losses(tmp_path, f"{codec}-cpu"), CODEC_RTOL)


def test_four_ranks_sharing_the_gpu_train_like_one_cuda_process(reference, tmp_path) -> None:
    _run(4, tmp_path, FOUR_RANKS)
    for name, _, _, model, _ in FOUR_RANKS:
        _assert_close(tmp_path, name, reference["moe" if model else "dense"], LOSS_RTOL)


COMPILED = [  # train.compile: each block one graph of Triton kernels
    ("compiled-tp2", (1, 2, 1), "cuda", None, {"compile": True}),
    ("compiled-ep2", (2, 1, 1), "cuda", TINY_MOE, {"compile": True, "ep": 2}),
]


@pytest.mark.timeout(600)  # inductor compiles every block's Triton kernels first, on both ranks
def test_compiled_blocks_on_the_gpu_train_like_one_eager_cuda_process(reference, tmp_path) -> None:
    """TP's collectives inside compiled blocks (functional collectives: torch 2.11's Dynamo turned the in-place
    all-reduce of a backward into zeros, and TP trained only its last layers), and an MoE dispatch kept eager
    inside them."""
    _run(2, tmp_path, COMPILED)
    for name, _, _, model, _ in COMPILED:
        _assert_close(tmp_path, name, reference["moe" if model else "dense"], LOSS_RTOL)


def _hpc(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, from this checkout (no install needed), without the test's rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "hpc.cli.main", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


SHORT = ["--set", "train.steps=4", "--set", "checkpoint.every_steps=0", "--set", "train.log_every=1"]


@pytest.mark.parametrize("example", ["gpt.toml", "llama.toml"])
def test_an_nccl_world_of_one_trains_on_the_gpu_with_memory_mfu_and_times(example, tmp_path) -> None:
    if example == "llama.toml":
        pytest.importorskip("transformers")
    done = _hpc("run", "-n", "1", "--launcher", "local", str(REPO / "jobs" / "examples" / example), *SHORT,
                "--set", f"job.run_dir={tmp_path}", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
                "--set", "parallel.backend=nccl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cuda:nccl" in done.stdout and "MFU" in done.stdout, done.stdout
    (result_file,) = tmp_path.glob("*/result.json")
    result = json.loads(result_file.read_text())
    assert result["peak_memory_bytes"] > 0 and 0 < result["mfu"] < 1
    records = [json.loads(line) for line in result_file.with_name("metrics.jsonl").open()]
    assert all(r["step_time_s"] > 0 and r["peak_memory_bytes"] > 0 and r["mfu"] > 0 for r in records)


@pytest.mark.parametrize("example", ["mlp.toml", "gpt.toml", "gpt_moe.toml", "llama.toml"])
def test_every_example_spec_runs_with_four_ranks_sharing_the_gpu(example, tmp_path) -> None:
    if example == "llama.toml":
        pytest.importorskip("transformers")
    done = _hpc("run", "-n", "4", "--launcher", "local", str(REPO / "jobs" / "examples" / example), *SHORT,
                "--set", f"job.run_dir={tmp_path}", "--set", "parallel.backend=gloo", "--set", "parallel.device=cuda",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "summary:" in done.stdout and "MFU" in done.stdout, done.stdout


@pytest.mark.parametrize("script", [["ddp_script.py", "--epochs", "1"], ["horovod_digits.py", "--epochs", "1"]])
def test_the_example_scripts_run_on_the_gpu(script, tmp_path) -> None:
    done = _hpc("run", "-n", "1", "--launcher", "local", str(REPO / "jobs" / "examples" / script[0]), *script[1:],
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_nccl_with_more_ranks_than_gpus_is_one_line_before_training(tmp_path) -> None:
    ranks = torch.cuda.device_count() + 1
    done = _hpc("run", "-n", str(ranks), "--launcher", "local", str(REPO / "jobs" / "examples" / "mlp.toml"),
                "--set", f"job.run_dir={tmp_path}", "--set", "parallel.backend=nccl", cwd=tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "NCCL needs a GPU per rank" in said and "parallel.backend='gloo'" in said, said[-3000:]

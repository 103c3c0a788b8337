"""The loop a user would write instead of ours: a transformers Llama trained on one GPU by hand, as an expert writes it.

``python -m jobs.bench.plain_llama [--compile] [--steps N] [--spec TOML]`` builds the model the spec trains
(``jobs/bench/llama_bench.toml`` by default: the same ``[model.args]``, read from that file), float32 weights,
bf16 autocast, SDPA attention, ``use_cache=False`` (no KV cache built in training), torch's fused AdamW,
``clip_grad_norm_(foreach=True)``, on random tokens made on the GPU, and prints one JSON line: the median step
time after the warm-up steps (CUDA events between steps' ends, as our trainer times them), tokens/s, model
TFLOP/s (6N + 12 L s h per token), and the CUDA allocator's peak. ``train_steps`` is the loop itself, shared
with ``jobs.bench.titan_llama`` (torchtitan's model in the same loop); ``jobs.bench.gpu`` runs both beside
``hpc run``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SPEC = Path(__file__).with_name("llama_bench.toml")


def bench_settings(spec_path: Path = SPEC) -> dict:
    """The benchmark spec's model, batch and optimizer settings, so every loop trains the same thing."""
    spec = tomllib.loads(Path(spec_path).read_text())
    model, train = spec["model"], spec["train"]
    return {"args": model["args"], "seq_len": model["seq_len"], "batch": spec["data"]["batch_size"],
            "lr": train["lr"], "weight_decay": train["weight_decay"], "clip": train["grad_clip"]}


def train_steps(model: Any, forward: Callable, loss_fn: Callable, settings: dict, steps: int, warmup: int,
                profile: int = 0, profile_dir: str = "") -> dict:
    """``steps`` steps of bf16-autocast forward, ``loss_fn(logits, targets)``, backward, foreach clipping and fused
    AdamW on random tokens; the median device time between steps' ends after ``warmup`` steps, the loss read
    once at the end (an expert's loop does not synchronize every step). ``profile``: torch.profiler over that
    many steps after the first 3, written to ``profile_dir`` as our trainer writes its own
    (hpc/observe/profile.py)."""
    import torch

    from hpc.observe.profile import StepProfiler

    args, batch, seq = settings["args"], settings["batch"], settings["seq_len"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=settings["weight_decay"], fused=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    profiler = StepProfiler(profile, Path(profile_dir), 0, torch.device("cuda"))
    ends[0].record()
    for step in range(steps):
        ids = torch.randint(0, args["vocab_size"], (batch, seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(ids[:, :-1])
        loss = loss_fn(logits, ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings["clip"], foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends[step + 1].record()
        profiler.step()
    profiler.close()
    final_loss = loss.item()
    torch.cuda.synchronize()
    step_s = statistics.median(ends[i].elapsed_time(ends[i + 1]) / 1e3 for i in range(warmup, steps))
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6.0 * n_params + 12.0 * args["num_hidden_layers"] * seq * args["hidden_size"]
    tokens_per_s = batch * seq / step_s
    return {"step_s": step_s, "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops_per_token / 1e12,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(), "params": n_params, "loss": final_loss,
            "device": torch.cuda.get_device_name()}


def loop_arguments(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--spec", default=str(SPEC), help="the job spec whose model, batch and optimizer to use")
    parser.add_argument("--profile", type=int, default=0, help="torch.profiler over this many steps after the first 3")
    parser.add_argument("--profile-dir", default="profile", help="where --profile writes its trace and ops table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F
    import transformers

    args = loop_arguments("python -m jobs.bench.plain_llama").parse_args(argv)
    settings = bench_settings(Path(args.spec))
    config = transformers.AutoConfig.for_model(**settings["args"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32).cuda()
    forward = torch.compile(model) if args.compile else model

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    result = train_steps(model, lambda ids: forward(input_ids=ids, use_cache=False).logits, loss_fn, settings,
                         args.steps, args.warmup, args.profile, args.profile_dir)
    print(json.dumps({"loop": "plain" + (" compiled" if args.compile else " eager"), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

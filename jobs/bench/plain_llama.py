"""The loop a user would write instead of ours: a transformers Llama trained on one GPU by hand.

``python -m jobs.bench.plain_llama [--fused] [--compile] [--steps N]`` builds the model
``jobs/bench/llama_bench.toml`` trains (the same ``[model.args]``, read from that file),
float32 weights, bf16 autocast, SDPA attention, AdamW with clipping at 1.0, on random
byte tokens made on the GPU, and prints one JSON line: median step time after the warm-up
steps, tokens/s, model TFLOP/s (6N + 12 L s h per token), MFU against the card's dense
bf16 peak, and the CUDA allocator's peak. ``jobs.bench.gpu`` runs it beside ``hpc run``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

SPEC = Path(__file__).with_name("llama_bench.toml")


def bench_settings() -> dict:
    """The benchmark spec's model, batch and optimizer settings, so both loops train the same thing."""
    spec = tomllib.loads(SPEC.read_text())
    model, train = spec["model"], spec["train"]
    return {"args": model["args"], "seq_len": model["seq_len"], "batch": spec["data"]["batch_size"],
            "lr": train["lr"], "weight_decay": train["weight_decay"], "clip": train["grad_clip"]}


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F
    import transformers

    parser = argparse.ArgumentParser(prog="python -m jobs.bench.plain_llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--fused", action="store_true", help="torch's fused AdamW instead of its default (foreach)")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model)")
    args = parser.parse_args(argv)
    settings = bench_settings()
    config = transformers.AutoConfig.for_model(**settings["args"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=settings["weight_decay"],
                                  fused=args.fused or None)
    forward = torch.compile(model) if args.compile else model
    batch, seq = settings["batch"], settings["seq_len"]
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times[args.warmup:])
    params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6.0 * params + 12.0 * config.num_hidden_layers * seq * config.hidden_size
    tokens_per_s = batch * seq / step_s
    print(json.dumps({
        "loop": "plain" + (" compiled" if args.compile else "") + (" fused AdamW" if args.fused else " AdamW"),
        "step_s": step_s, "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops_per_token / 1e12,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(), "params": params, "loss": loss.item(),
        "device": torch.cuda.get_device_name(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

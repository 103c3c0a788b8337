"""What each rank of ``hpc bench KIND`` runs: ``python -m jobs.bench.rank KIND --out OUT ...``.

One entry point for every benchmark, so the CLI only builds command lines. Every rank
measures; rank 0 writes the rows as JSON to OUT, which the launching process prints,
so table and JSON output carry no rank prefixes. Nothing heavy at module level: the
CLI imports :data:`PIPELINE_SIZES` from here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

PIPELINE_SIZES = ("virtual", "layers", "width", "rows", "steps")  # integer options of the pipeline bench
# hpc bench train --target-loss: the integer options and their defaults (the CLI's too)
TIME_TO_LOSS_DEFAULTS = {"max-steps": 400, "eval-every": 10, "width": 256, "layers": 4, "batch": 4}


def rank_command(kind: str, out: str, *options: str) -> tuple[str, ...]:
    """What follows ``python`` for one rank of benchmark ``kind`` that writes its rows to ``out``."""
    return ("-m", "jobs.bench.rank", kind, "--out", out, *options)


def rank_argv(kind: str, options: Sequence[str]) -> Callable[[str, str], tuple[str, ...]]:
    """``launch_for_rows``'s command of every rank of ``kind``, from the file rank 0 writes (and a scratch
    directory)."""
    return lambda out, _scratch: rank_command(kind, out, *options)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True, help="where rank 0 writes the rows")
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.rank")
    kinds = parser.add_subparsers(dest="kind", required=True)
    allreduce = kinds.add_parser("allreduce", parents=[common])
    allreduce.add_argument("--sizes", required=True)
    allreduce.add_argument("--codecs", required=True)
    allreduce.add_argument("--transports", required=True)
    allreduce.add_argument("--iters", type=int, required=True)
    pipeline = kinds.add_parser("pipeline", parents=[common])
    pipeline.add_argument("--microbatches", required=True)
    pipeline.add_argument("--schedules", required=True)
    pipeline.add_argument("--transports", required=True)
    for option in PIPELINE_SIZES:
        pipeline.add_argument(f"--{option}", type=int, required=True)
    checkpoint = kinds.add_parser("checkpoint", parents=[common])
    checkpoint.add_argument("--size", type=int, required=True, help="bytes")
    checkpoint.add_argument("--iters", type=int, required=True)
    checkpoint.add_argument("--dir", required=True, help="this run's own directory for the files")
    checkpoint.add_argument("--device", default="auto", help="where the state lives: auto, cpu, cuda")
    memory = kinds.add_parser("memory", parents=[common])
    memory.add_argument("--zero", required=True, help="comma list of our ZeRO stages")
    memory.add_argument("--impls", required=True, help="comma list: ours, torch-zero, fsdp2")
    memory.add_argument("--steps", type=int, required=True)
    train = kinds.add_parser("train", parents=[common])
    train.add_argument("--transports", required=True)
    train.add_argument("--codecs", required=True)
    train.add_argument("--ddp", required=True, help="comma list, may be empty")
    for option in ("steps", "warmup", "rounds"):
        train.add_argument(f"--{option}", type=int, required=True)
    train.add_argument("--target-loss", type=float, help="time-to-loss mode: train to this held-out loss")
    train.add_argument("--full", action="store_true", help="time to loss: every row trains all --max-steps")
    for option, default in TIME_TO_LOSS_DEFAULTS.items():
        train.add_argument(f"--{option}", type=int, default=default)
    alltoall = kinds.add_parser("alltoall", parents=[common])
    alltoall.add_argument("--sizes", required=True, help="comma list of bytes")
    alltoall.add_argument("--iters", type=int, required=True)
    alltoall.add_argument("--transports", default="torch")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from hpc.runtime.abort import run_as_rank

    args = _parser().parse_args(argv)

    def measure() -> None:
        import torch.distributed as dist

        import hpc

        world = hpc.init("gloo")
        rows = MEASURE[args.kind](args, dist.group.WORLD)
        if world.rank == 0:
            with open(args.out, "w") as handle:
                json.dump(rows, handle)
        hpc.shutdown()

    return run_as_rank(measure)


def _allreduce(args: argparse.Namespace, _group) -> list[dict]:
    from hpc.text import parse_size
    from jobs.bench.allreduce import bench_allreduce

    return bench_allreduce(
        [parse_size(s) for s in args.sizes.split(",")], args.codecs.split(","), args.transports.split(","),
        iters=args.iters,
    )


def _pipeline(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.pipeline import bench_pipeline

    return bench_pipeline(
        group, args.schedules.split(","), [int(m) for m in args.microbatches.split(",")], args.virtual,
        transports=args.transports.split(","), layers=args.layers, width=args.width, rows=args.rows, steps=args.steps,
    )


def _checkpoint(args: argparse.Namespace, group) -> list[dict]:
    from pathlib import Path

    from jobs.bench.checkpoint import bench_checkpoint

    return bench_checkpoint(Path(args.dir), args.size, args.iters, group, args.device)


def _memory(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.memory import bench_memory

    return bench_memory(group, [int(z) for z in args.zero.split(",")], args.impls.split(","), steps=args.steps)


def _train(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.train import GPT_SIZE, bench_train, implementations

    ddp = [h for h in args.ddp.split(",") if h]
    if args.target_loss is not None:
        from jobs.bench.time_to_loss import bench_time_to_loss

        size = {**GPT_SIZE, "d_model": args.width, "n_layers": args.layers}
        runs = implementations(args.transports.split(","), args.codecs.split(","), ddp, group, size)
        return bench_time_to_loss(group, runs, args.target_loss, args.max_steps, args.eval_every, args.batch,
                                  GPT_SIZE["seq_len"], full=args.full)
    return bench_train(group, args.transports.split(","), args.codecs.split(","), ddp,
                       steps=args.steps, warmup=args.warmup, rounds=args.rounds)


def _alltoall(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.alltoall import bench_alltoall

    return bench_alltoall(group, [int(s) for s in args.sizes.split(",")], iters=args.iters,
                          transports=args.transports.split(","))


MEASURE = {"allreduce": _allreduce, "pipeline": _pipeline, "checkpoint": _checkpoint, "memory": _memory,
           "train": _train, "alltoall": _alltoall}

if __name__ == "__main__":
    sys.exit(main())

"""What each rank of ``hpc bench KIND`` runs: ``python -m jobs.bench.rank KIND --out OUT ...``.

One entry point for every benchmark, so the CLI only builds command lines; each benchmark's options are
jobs/bench/options.py's, the same the CLI's subcommand declares. Every rank measures; rank 0 writes the rows
as JSON to OUT, which the launching process prints, so table and JSON output carry no rank prefixes. Nothing
heavy at module level.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jobs.bench import options


def rank_command(kind: str, out: str, *argv: str) -> tuple[str, ...]:
    """What follows ``python`` for one rank of benchmark ``kind`` that writes its rows to ``out``, ``argv`` its
    options."""
    return ("-m", "jobs.bench.rank", kind, "--out", out, *argv)


def rank_argv(kind: str, argv: Sequence[str]) -> Callable[[str, str], tuple[str, ...]]:
    """``launch_for_rows``'s command of every rank of ``kind`` with options ``argv``, from the file rank 0 writes
    (and a scratch directory)."""
    return lambda out, _scratch: rank_command(kind, out, *argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.rank")
    kinds = parser.add_subparsers(dest="kind", required=True)
    for kind in MEASURE:
        bench = kinds.add_parser(kind, parents=[options.parser(kind)])
        bench.add_argument("--out", required=True, help="where rank 0 writes the rows")
        if kind == "checkpoint":
            bench.add_argument("--files", required=True, help="this run's own directory for the files")
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
        [parse_size(s) for s in args.sizes.split(",")], args.codecs.split(","), _transports(args), iters=args.iters,
        scopes=args.scopes.split(","), op=args.op,
    )


def _pipeline(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.pipeline import bench_pipeline

    return bench_pipeline(
        group, args.schedules.split(","), [int(m) for m in args.microbatches.split(",")], args.virtual,
        transports=_transports(args), layers=args.layers, width=args.width, rows=args.rows, steps=args.steps,
    )


def _checkpoint(args: argparse.Namespace, group) -> list[dict]:
    from pathlib import Path

    from hpc.text import parse_size
    from jobs.bench.checkpoint import bench_checkpoint

    return bench_checkpoint(Path(args.files), parse_size(args.size), args.iters, group, args.device)


def _memory(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.memory import bench_memory

    return bench_memory(group, [int(z) for z in args.zero.split(",")], args.impls.split(","), steps=args.steps)


def _train(args: argparse.Namespace, group) -> list[dict]:
    from jobs.bench.train import GPT_SIZE, bench_train, implementations

    ddp, scopes = [h for h in args.ddp.split(",") if h], args.scopes.split(",")
    if args.target_loss is not None:
        from jobs.bench.time_to_loss import bench_time_to_loss

        sizes = options.time_to_loss_sizes(args)
        size = {**GPT_SIZE, "d_model": sizes["width"], "n_layers": sizes["layers"]}
        runs = implementations(_transports(args), args.codecs.split(","), ddp, group, size, scopes)
        return bench_time_to_loss(group, runs, args.target_loss, sizes["max-steps"], sizes["eval-every"],
                                  sizes["batch"], GPT_SIZE["seq_len"], full=args.full)
    return bench_train(group, _transports(args), args.codecs.split(","), ddp,
                       steps=args.steps, warmup=args.warmup, rounds=args.rounds, scopes=scopes)


def _alltoall(args: argparse.Namespace, group) -> list[dict]:
    from hpc.text import parse_size
    from jobs.bench.alltoall import bench_alltoall

    return bench_alltoall(group, [parse_size(s) for s in args.sizes.split(",")], iters=args.iters,
                          transports=_transports(args))


def _transports(args: argparse.Namespace) -> list[str]:
    """The transports asked for; torch alone when none was (the CLI passes its choice for the launcher)."""
    return (args.transports or "torch").split(",")


MEASURE = {"allreduce": _allreduce, "pipeline": _pipeline, "checkpoint": _checkpoint, "memory": _memory,
           "train": _train, "alltoall": _alltoall}

if __name__ == "__main__":
    sys.exit(main())

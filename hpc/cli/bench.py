"""``hpc bench allreduce``: starts ranks like ``hpc run`` and prints their measurements.

The ranks run this module with ``--rank``; rank 0 writes the rows to a file that
the launching process prints, so table and JSON output carry no rank prefixes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure communication (allreduce)")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    allreduce = kinds.add_parser("allreduce", help="our ring with each codec against torch.distributed.all_reduce")
    allreduce.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    allreduce.add_argument("--sizes", default="1K,64K,1M,16M,64M", help="comma list, e.g. 1K,64M (default %(default)s)")
    allreduce.add_argument("--codecs", default="none,fp16,bf16,int8", help="ring codecs (default %(default)s)")
    allreduce.add_argument("--transports", help="ring transports: torch, mpi (default: both under mpirun)")
    allreduce.add_argument("--iters", type=int, default=5, help="timed iterations per row (default 5)")
    allreduce.add_argument("--launcher", choices=("local", "mpirun"), help="default: mpirun when installed")
    allreduce.add_argument("--json", action="store_true", help="one JSON object per row")
    allreduce.set_defaults(handler=cmd_bench)


def _rank_args(args: argparse.Namespace, transports: str) -> list[str]:
    return ["--sizes", args.sizes, "--codecs", args.codecs, "--transports", transports, "--iters", str(args.iters)]


def cmd_bench(args: argparse.Namespace) -> int:
    from hpc import launch
    from hpc.cli.main import launch_ranks
    from hpc.errors import ConfigError
    from parallel.bench import format_table, parse_size
    from parallel.compression import RING_CODECS

    try:
        for size in args.sizes.split(","):
            parse_size(size)
    except ValueError as exc:
        raise ConfigError(f"--sizes: {exc}") from None
    unknown = set(args.codecs.split(",")) - set(RING_CODECS)
    if unknown:
        raise ConfigError(f"--codecs: unknown {', '.join(sorted(unknown))} (valid: {', '.join(RING_CODECS)})")
    launcher = args.launcher or ("mpirun" if launch.has_open_mpi() else "local")
    transports = args.transports or ("torch,mpi" if launcher == "mpirun" else "torch")
    if "mpi" in transports.split(",") and launcher != "mpirun":
        raise ConfigError("--transports mpi needs --launcher mpirun")
    with tempfile.TemporaryDirectory(prefix="hpc-bench-") as scratch:
        out = os.path.join(scratch, "rows.json")
        argv = (sys.executable, "-m", "hpc.cli.bench", "--rank", out, "allreduce", *_rank_args(args, transports))
        launch_ranks(args.nprocs, argv, launcher, hosts=[], bind_to=None, progress="off", dry_run=False)
        with open(out) as handle:
            rows = json.load(handle)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0


def rank_main(argv: Sequence[str] | None = None) -> int:
    from hpc.cli.rank import run_as_rank

    parser = argparse.ArgumentParser(prog="python -m hpc.cli.bench --rank OUT")
    parser.add_argument("--rank", dest="out", required=True)
    parser.add_argument("kind", choices=("allreduce",))
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--codecs", required=True)
    parser.add_argument("--transports", required=True)
    parser.add_argument("--iters", type=int, required=True)
    args = parser.parse_args(argv)

    def measure() -> None:
        import hpc
        from parallel.bench import bench_allreduce, parse_size

        world = hpc.init("gloo")
        rows = bench_allreduce(
            [parse_size(s) for s in args.sizes.split(",")], args.codecs.split(","), args.transports.split(","),
            iters=args.iters,
        )
        if world.rank == 0:
            with open(args.out, "w") as handle:
                json.dump(rows, handle)
        hpc.shutdown()

    return run_as_rank(measure)


if __name__ == "__main__":
    sys.exit(rank_main())

"""``hpc bench allreduce|pipeline|checkpoint|memory|train|alltoall``: starts ranks like ``hpc run``, prints
what they measure.

The benchmarks live in ``jobs.bench``; every rank runs ``python -m jobs.bench.rank KIND``
and rank 0 writes the rows to a file that this process prints, so table and JSON output
carry no rank prefixes. Nothing heavy at module level (``hpc --help`` imports this).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from hpc.config import CODEC_NAMES
from jobs.bench.rank import TIME_TO_LOSS_DEFAULTS

DDP_IMPLS = ("ddp", "ddp-fp16", "ddp-powersgd")  # jobs.bench.train builds them; spelled here to keep torch out


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="measure communication (allreduce), pipeline schedules (pipeline), checkpoints (checkpoint) "
        "ZeRO memory (memory) and whole training steps against DDP (train)"
    )
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    allreduce = kinds.add_parser("allreduce", help="our ring with each codec against torch.distributed.all_reduce")
    allreduce.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    allreduce.add_argument("--sizes", default="1K,64K,1M,16M,64M", help="comma list, e.g. 1K,64M (default %(default)s)")
    allreduce.add_argument("--codecs", default=",".join(CODEC_NAMES),
                           help="gradient codecs (default %(default)s)")
    allreduce.add_argument("--transports", help="ring transports: torch, mpi (default: both under mpirun)")
    allreduce.add_argument("--iters", type=int, default=5, help="timed iterations per row (default 5)")
    _launch_options(allreduce)
    allreduce.add_argument("--plot", metavar="PATH",
                           help="also write a PNG: bus bandwidth against message size, a line per implementation")
    allreduce.set_defaults(handler=cmd_bench)
    pipeline = kinds.add_parser("pipeline", help="bubble and activation memory of gpipe, 1f1b, interleaved 1f1b")
    pipeline.add_argument("--stages", default="2,4", help="pipeline ranks, one launch each (default %(default)s)")
    pipeline.add_argument("--microbatches", default="4,8", help="comma list (default %(default)s)")
    pipeline.add_argument("--schedules", default="gpipe,1f1b,interleaved", help="(default %(default)s)")
    pipeline.add_argument("--virtual", type=int, default=2, help="chunks per rank, interleaved only (default 2)")
    pipeline.add_argument("--layers", type=int, default=64, help="Linear+Tanh blocks in the model (default 64)")
    pipeline.add_argument("--width", type=int, default=1024, help="features per block (default 1024)")
    pipeline.add_argument("--rows", type=int, default=64, help="rows per microbatch (default 64)")
    pipeline.add_argument("--steps", type=int, default=3, help="timed steps per row, after one warm-up (default 3)")
    pipeline.add_argument("--transports", help="message transports: torch, mpi (default: both under mpirun)")
    _launch_options(pipeline)
    pipeline.set_defaults(handler=cmd_bench_pipeline)
    _add_checkpoint_parser(kinds)
    _add_memory_parser(kinds)
    _add_train_parser(kinds)
    _add_alltoall_parser(kinds)
    _add_codecs_parser(kinds)


def _launch_options(bench: argparse.ArgumentParser) -> None:
    """What every benchmark takes: how its ranks start and how its rows print."""
    bench.add_argument("--launcher", choices=("local", "mpirun"), help="default: mpirun when installed")
    bench.add_argument("--json", action="store_true", help="one JSON object per row")


def _add_alltoall_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "alltoall", help="expert parallelism's all-to-all with uneven splits against torch.distributed.all_to_all"
    )
    bench.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    bench.add_argument("--sizes", default="64K,1M,16M", help="bytes each rank sends (default %(default)s)")
    bench.add_argument("--iters", type=int, default=10, help="timed iterations per row (default 10)")
    bench.add_argument("--transports", help="ours over: torch, mpi (default: both under mpirun)")
    _launch_options(bench)
    bench.set_defaults(handler=cmd_bench_alltoall)


def _sizes(text: str) -> list[int]:
    """``--sizes``: a comma list of sizes (1K, 64M, ...) in bytes; one line naming the option when one is not."""
    from hpc.errors import ConfigError
    from hpc.text import parse_size

    try:
        return [parse_size(size) for size in text.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--sizes: {exc}") from None


def cmd_bench_alltoall(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError
    from hpc.runtime import launch
    from jobs.bench.alltoall import format_table

    sizes = _sizes(args.sizes)
    if args.iters < 1 or args.nprocs < 2:
        raise ConfigError("--iters must be at least 1 and -n at least 2")
    launcher = args.launcher or launch.default_launcher()
    options = ["--sizes", ",".join(map(str, sizes)), "--iters", str(args.iters),
               "--transports", _transports(args.transports, launcher)]
    rows = launch.launch_for_rows(args.nprocs, launcher, _bench_rank_argv("alltoall", options))
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0


def _add_codecs_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "codecs", help="one device's encode and decode of each codec against a copy of the same tensor (in process)"
    )
    bench.add_argument("--sizes", default="64M,256M", help="bytes of float32 input (default %(default)s)")
    bench.add_argument("--codecs", default="fp16,bf16,int8,topk,powersgd", help="(default %(default)s)")
    bench.add_argument("--iters", type=int, default=20, help="timed runs per op; the median (default 20)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto is cuda where a GPU is visible (default %(default)s)")
    bench.add_argument("--json", action="store_true", help="one JSON object per row")
    bench.set_defaults(handler=cmd_bench_codecs)


def cmd_bench_codecs(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError
    from jobs.bench.codecs import CODECS, bench_codecs, format_table

    sizes = _sizes(args.sizes)
    unknown = set(args.codecs.split(",")) - set(CODECS)
    if unknown or args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"--codecs takes {', '.join(CODECS)} (unknown: {', '.join(sorted(unknown)) or 'none'}); "
                          "--iters must be at least 1, --warmup at least 0")
    rows = bench_codecs(sizes, args.codecs.split(","), args.iters, args.warmup,
                        None if args.device == "auto" else args.device)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0


def _add_checkpoint_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "checkpoint", help="HDF5 (sync, async) against torch.save, DCP, the raw disk and a memory copy"
    )
    bench.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2)")
    bench.add_argument("--size", default="256M", help="bytes of training state, e.g. 64M, 1G (default %(default)s)")
    bench.add_argument("--iters", type=int, default=3, help="timed rounds; each row is the median (default 3)")
    bench.add_argument("--dir", default="runs/bench-checkpoint", help="where to write (default %(default)s)")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where the state lives: auto is cuda where a GPU is visible (default %(default)s)")
    _launch_options(bench)
    bench.set_defaults(handler=cmd_bench_checkpoint)


def _add_memory_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "memory", help="per-rank bytes and step time of ZeRO 0-3 against ZeroRedundancyOptimizer (and FSDP2)"
    )
    bench.add_argument("-n", "--nprocs", default="2,4",
                       help="data-parallel ranks, one launch each (default %(default)s)")
    bench.add_argument("--zero", default="0,1,2,3", help="our ZeRO stages (default %(default)s)")
    bench.add_argument("--impls", default="ours,torch-zero,fsdp2", help="(default %(default)s)")
    bench.add_argument("--steps", type=int, default=3, help="timed steps per row, after one warm-up (default 3)")
    _launch_options(bench)
    bench.set_defaults(handler=cmd_bench_memory)


def _add_train_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "train", help="training steps of our data-parallel optimizer against torch DDP (and its comm hooks)"
    )
    bench.add_argument("-n", "--nprocs", type=int, default=2, help="data-parallel ranks (default 2)")
    bench.add_argument("--transports", help="ring transports: torch, mpi (default: both under mpirun)")
    bench.add_argument("--codecs", default="none", help="our gradient codecs (default %(default)s)")
    bench.add_argument("--ddp", default="ddp", help=f"comma list of {', '.join(DDP_IMPLS)} (default %(default)s)")
    bench.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    bench.add_argument("--rounds", type=int, default=3, help="interleaved rounds; steps/s is the median (default 3)")
    loss = bench.add_argument_group("time to loss (on the license texts; every implementation trains to a target)")
    loss.add_argument("--target-loss", type=float, help="train each implementation to this held-out loss")
    helps = {"max-steps": "give up after this many steps", "eval-every": "steps between held-out losses",
             "width": "GPT width", "layers": "GPT blocks", "batch": "sequences per rank per step"}
    for option, default in TIME_TO_LOSS_DEFAULTS.items():
        loss.add_argument(f"--{option}", type=int, default=default, help=f"{helps[option]} (default {default})")
    loss.add_argument("--full", action="store_true",
                      help="train every row all --max-steps (not to the target), so final losses compare")
    loss.add_argument("--plot", metavar="PATH", help="also write a PNG: held-out loss against wall time")
    _launch_options(bench)
    bench.set_defaults(handler=cmd_bench_train)


def _rank_args(args: argparse.Namespace, transports: str) -> list[str]:
    return ["--sizes", args.sizes, "--codecs", args.codecs, "--transports", transports, "--iters", str(args.iters)]


def _rank_command(kind: str, out: str, *options: str) -> tuple[str, ...]:
    return ("-m", "jobs.bench.rank", kind, "--out", out, *options)


def _bench_rank_argv(kind: str, options: Sequence[str]):
    return lambda out, _scratch: _rank_command(kind, out, *options)


def cmd_bench(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError
    from hpc.observe.plots import bandwidth_figure, check_png_path, save_png
    from hpc.runtime import launch
    from hpc.text import parse_size
    from jobs.bench.allreduce import format_table

    try:
        for size in args.sizes.split(","):
            parse_size(size)
    except ValueError as exc:
        raise ConfigError(f"--sizes: {exc}") from None
    _check_codecs(args.codecs)
    launcher = args.launcher or launch.default_launcher()
    transports = _transports(args.transports, launcher)
    plot = check_png_path(args.plot) if args.plot else None
    rows = launch.launch_for_rows(args.nprocs, launcher, _bench_rank_argv("allreduce", _rank_args(args, transports)))
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    if plot:
        save_png(bandwidth_figure(rows), plot)
        print(f"wrote {plot}", file=sys.stderr if args.json else sys.stdout)  # --json: stdout stays JSON lines
    return 0


def _check_codecs(text: str) -> None:
    from hpc.errors import ConfigError

    unknown = set(text.split(",")) - set(CODEC_NAMES)
    if unknown:
        raise ConfigError(f"--codecs: unknown {', '.join(sorted(unknown))} (valid: {', '.join(CODEC_NAMES)})")


def _transports(asked: str | None, launcher: str) -> str:
    from hpc.errors import ConfigError

    transports = asked or ("torch,mpi" if launcher == "mpirun" else "torch")
    unknown = set(transports.split(",")) - {"torch", "mpi"}
    if unknown:
        raise ConfigError(f"--transports: unknown {', '.join(sorted(unknown))} (valid: torch, mpi)")
    if "mpi" in transports.split(",") and launcher != "mpirun":
        raise ConfigError("--transports mpi needs --launcher mpirun")
    return transports


def _positive_ints(option: str, text: str) -> list[int]:
    from hpc.errors import ConfigError

    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option}: expected a comma list of integers, got {text!r}") from None
    if min(values) < 1:
        raise ConfigError(f"{option}: values must be >= 1, got {text!r}")
    return values


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    """Every (stages, schedule, microbatches) is checked against the model before any launch."""
    from hpc.runtime import launch
    from jobs.bench.rank import PIPELINE_SIZES
    from parallel.schedule import build_schedule, stage_bounds

    stages, microbatches = _positive_ints("--stages", args.stages), _positive_ints("--microbatches", args.microbatches)
    for option in PIPELINE_SIZES:
        _positive_ints(f"--{option}", str(getattr(args, option)))
    schedules = args.schedules.split(",")
    for p in stages:
        for name in schedules:
            v = args.virtual if name == "interleaved" else 1
            stage_bounds(args.layers, p, v)
            for m in microbatches:
                build_schedule(name, p, m, v)
    launcher = args.launcher or launch.default_launcher()
    options = ["--microbatches", args.microbatches, "--schedules", args.schedules,
               "--transports", _transports(args.transports, launcher),
               *(arg for option in PIPELINE_SIZES for arg in (f"--{option}", str(getattr(args, option))))]
    rows = [row for p in stages for row in launch.launch_for_rows(p, launcher, _bench_rank_argv("pipeline", options))]
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        from jobs.bench.pipeline import format_table

        print(format_table(rows))
    return 0


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError
    from hpc.runtime import launch
    from hpc.text import parse_size
    from jobs.bench.checkpoint import format_table

    try:
        nbytes = parse_size(args.size)
    except ValueError as exc:
        raise ConfigError(f"--size: {exc}") from None
    if args.iters < 1 or args.nprocs < 1:
        raise ConfigError("--iters and -n must be at least 1")
    launcher = args.launcher or launch.default_launcher()
    os.makedirs(args.dir, exist_ok=True)

    def rank_argv(out: str, scratch: str) -> tuple[str, ...]:
        files = os.path.abspath(os.path.join(scratch, "files"))
        return _rank_command("checkpoint", out, "--size", str(nbytes), "--iters", str(args.iters), "--dir", files,
                             "--device", args.device)

    rows = launch.launch_for_rows(args.nprocs, launcher, rank_argv, parent=args.dir)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError
    from hpc.runtime import launch
    from jobs.bench.memory import format_table

    ranks = _positive_ints("-n", args.nprocs)
    if not set(args.zero.split(",")) <= {"0", "1", "2", "3"} or args.steps < 1:
        raise ConfigError(f"--zero takes stages 0, 1, 2, 3 (got {args.zero!r}); --steps must be at least 1")
    unknown = set(args.impls.split(",")) - {"ours", "torch-zero", "fsdp2"}
    if unknown:
        raise ConfigError(f"--impls: unknown {', '.join(sorted(unknown))} (valid: ours, torch-zero, fsdp2)")
    launcher = args.launcher or launch.default_launcher()
    options = ["--zero", args.zero, "--impls", args.impls, "--steps", str(args.steps)]
    rows = [row for n in ranks for row in launch.launch_for_rows(n, launcher, _bench_rank_argv("memory", options))]
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError
    from hpc.observe.plots import check_png_path, save_png
    from hpc.runtime import launch

    _check_codecs(args.codecs)
    hooks = [h for h in args.ddp.split(",") if h]
    if set(hooks) - set(DDP_IMPLS):
        raise ConfigError(f"--ddp: unknown {', '.join(sorted(set(hooks) - set(DDP_IMPLS)))} "
                          f"(valid: {', '.join(DDP_IMPLS)})")
    if args.nprocs < 2 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise ConfigError("-n must be at least 2, --steps and --rounds at least 1, --warmup at least 0")
    launcher = args.launcher or launch.default_launcher()
    options = ["--transports", _transports(args.transports, launcher), "--codecs", args.codecs,
               "--ddp", ",".join(hooks), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(args.rounds), *_time_to_loss_options(args)]
    plot = check_png_path(args.plot) if args.plot else None
    rows = launch.launch_for_rows(args.nprocs, launcher, _bench_rank_argv("train", options))
    if args.target_loss is None:
        from jobs.bench.train import format_table
    else:
        from jobs.bench.time_to_loss import format_table, loss_curves_figure

        if plot:
            save_png(loss_curves_figure(rows), plot)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0


def _time_to_loss_options(args: argparse.Namespace) -> list[str]:
    from hpc.errors import ConfigError

    if args.target_loss is None:
        if args.plot or args.full:
            raise ConfigError(f"{'--plot' if args.plot else '--full'} is for time to loss: it needs --target-loss")
        return []
    sizes = {"max-steps": args.max_steps, "eval-every": args.eval_every, "width": args.width,
             "layers": args.layers, "batch": args.batch}
    small = [f"--{name}" for name, value in sizes.items() if value < 1]
    if args.target_loss <= 0 or small:
        raise ConfigError(f"{', '.join(small) or '--target-loss'} must be positive")
    full = ["--full"] if args.full else []
    return ["--target-loss", str(args.target_loss), *full, *(f"--{name}={value}" for name, value in sizes.items())]

"""``hpc bench allreduce|pipeline|checkpoint|memory|train|alltoall|codecs``: starts ranks like ``hpc run``, prints
what they measure.

The benchmarks live in ``jobs.bench``, each one's own options in jobs/bench/options.py: every subcommand is built
from them, with how its ranks start and how its rows print added here, and their values go on to every rank
(``python -m jobs.bench.rank KIND``, which parses them with the same declarations). Rank 0 writes the rows to a
file that this process prints, so table and JSON output carry no rank prefixes. ``codecs`` runs in this process.
Nothing heavy at module level (``hpc --help`` imports this).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hpc.errors import ConfigError
from jobs.bench import options
from jobs.bench.options import DDP_IMPLS, PIPELINE_SIZES, SCOPES

HELPS = {
    "allreduce": "our ring with each codec against torch.distributed.all_reduce",
    "pipeline": "bubble and activation memory of gpipe, 1f1b, interleaved 1f1b",
    "checkpoint": "HDF5 (sync, async) against torch.save, DCP, the raw disk and a memory copy",
    "memory": "per-rank bytes and step time of ZeRO 0-3 against ZeroRedundancyOptimizer (and FSDP2)",
    "train": "training steps of our data-parallel optimizer against torch DDP (and its comm hooks)",
    "alltoall": "expert parallelism's all-to-all with uneven splits against torch.distributed.all_to_all",
    "codecs": "one device's encode and decode of each codec against a copy of the same tensor (in process)",
}
RANKS = {"allreduce": (4, "ranks"), "checkpoint": (2, "ranks"), "train": (2, "data-parallel ranks"),
         "alltoall": (4, "ranks")}  # -n: its default and what it counts
PLOTS = {"allreduce": "also write a PNG: bus bandwidth against message size, a line per implementation",
         "train": "time to loss: also write a PNG: held-out loss against wall time"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="measure communication (allreduce), pipeline schedules (pipeline), checkpoints (checkpoint) "
        "ZeRO memory (memory) and whole training steps against DDP (train)"
    )
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    handlers = {"allreduce": cmd_bench, "pipeline": cmd_bench_pipeline, "checkpoint": cmd_bench_checkpoint,
                "memory": cmd_bench_memory, "train": cmd_bench_train, "alltoall": cmd_bench_alltoall,
                "codecs": cmd_bench_codecs}
    for kind, what in HELPS.items():
        parser = kinds.add_parser(kind, help=what, parents=[options.parser(kind)])
        _launch_options(kind, parser)
        parser.set_defaults(handler=handlers[kind])


def _launch_options(kind: str, parser: argparse.ArgumentParser) -> None:
    """What a benchmark takes besides its own options: its ranks and how they start, where it writes, how its rows
    print."""
    if kind == "pipeline":
        parser.add_argument("--stages", default="2,4", help="pipeline ranks, one launch each (default %(default)s)")
    elif kind == "memory":
        parser.add_argument("-n", "--nprocs", default="2,4",
                            help="data-parallel ranks, one launch each (default %(default)s)")
    elif kind in RANKS:
        default, what = RANKS[kind]
        parser.add_argument("-n", "--nprocs", type=int, default=default, help=f"{what} (default {default})")
    if kind == "checkpoint":
        parser.add_argument("--dir", default="runs/bench-checkpoint", help="where to write (default %(default)s)")
    if kind in PLOTS:
        parser.add_argument("--plot", metavar="PATH", help=PLOTS[kind])
    if kind != "codecs":
        parser.add_argument("--launcher", choices=("local", "mpirun"), help="default: mpirun when installed")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")


def _launch(kind: str, args: argparse.Namespace, launcher: str, ranks: int, *extra: str) -> list[dict]:
    """The rows of ``kind`` measured on ``ranks`` ranks, each given the benchmark's options as ``args`` has them."""
    from hpc.runtime import launch
    from jobs.bench.rank import rank_argv

    return launch.launch_for_rows(ranks, launcher, rank_argv(kind, [*options.as_argv(kind, args), *extra]))


def _print_rows(args: argparse.Namespace, rows: list[dict], format_table) -> None:
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))


def _launcher(args: argparse.Namespace) -> str:
    """--launcher, by default mpirun where installed; --transports checked against it, both where none was given."""
    from hpc.runtime import launch

    launcher = args.launcher or launch.default_launcher()
    if "transports" in args:
        args.transports = _transports(args.transports, launcher)
    return launcher


def _sizes(text: str, least: int = 1, why: str = "") -> list[int]:
    """``--sizes``: a comma list of sizes (1K, 64M, ...) in bytes, each at least ``least`` (``why``: what the
    benchmark needs of it); one line naming the option and the size when one is not."""
    from hpc.text import parse_size

    sizes = []
    for size in text.split(","):
        try:
            sizes.append(parse_size(size))
        except ValueError as exc:
            raise ConfigError(f"--sizes: {exc}") from None
        if sizes[-1] < least:
            raise ConfigError(f"--sizes {size}: the least is {least} bytes ({why})")
    return sizes


def _check_least(*checks: tuple[str, int, int]) -> None:
    """Each (option, value, least): one line naming the first option under its least value."""
    for option, value, least in checks:
        if value < least:
            raise ConfigError(f"{option} must be at least {least} (got {value})")


def _check_names(option: str, names: Sequence[str], valid: Sequence[str]) -> None:
    """One line naming ``option``'s names that are not ``valid``."""
    unknown = set(names) - set(valid)
    if unknown:
        raise ConfigError(f"{option}: unknown {', '.join(sorted(unknown))} (valid: {', '.join(valid)})")


def cmd_bench(args: argparse.Namespace) -> int:
    from hpc.config import CODEC_NAMES
    from hpc.observe.plots import bandwidth_figure, check_png_path, save_png
    from jobs.bench.allreduce import format_table, least_bytes

    _check_least(("-n", args.nprocs, 1), ("--iters", args.iters, 1))
    _sizes(args.sizes, *least_bytes(args.op, args.nprocs))
    _check_names("--codecs", args.codecs.split(","), CODEC_NAMES)
    _check_names("--scopes", args.scopes.split(","), SCOPES)
    launcher = _launcher(args)
    plot = check_png_path(args.plot) if args.plot else None
    rows = _launch("allreduce", args, launcher, args.nprocs)
    _print_rows(args, rows, format_table)
    if plot:
        save_png(bandwidth_figure(rows), plot)
        print(f"wrote {plot}", file=sys.stderr if args.json else sys.stdout)  # --json: stdout stays JSON lines
    return 0


def cmd_bench_alltoall(args: argparse.Namespace) -> int:
    from jobs.bench.alltoall import format_table

    _sizes(args.sizes)
    _check_least(("-n", args.nprocs, 2), ("--iters", args.iters, 1))
    _print_rows(args, _launch("alltoall", args, _launcher(args), args.nprocs), format_table)
    return 0


def cmd_bench_codecs(args: argparse.Namespace) -> int:
    from jobs.bench.codecs import CODECS, bench_codecs, format_table, least_bytes

    codecs = args.codecs.split(",")
    _check_names("--codecs", codecs, CODECS)
    sizes = _sizes(args.sizes, *least_bytes(codecs))
    _check_least(("--iters", args.iters, 1), ("--warmup", args.warmup, 0))
    rows = bench_codecs(sizes, codecs, args.iters, args.warmup, options.resolve_device(args.device))
    _print_rows(args, rows, format_table)
    return 0


def _transports(asked: str | None, launcher: str) -> str:
    transports = asked or ("torch,mpi" if launcher == "mpirun" else "torch")
    unknown = set(transports.split(",")) - {"torch", "mpi"}
    if unknown:
        raise ConfigError(f"--transports: unknown {', '.join(sorted(unknown))} (valid: torch, mpi)")
    if "mpi" in transports.split(",") and launcher != "mpirun":
        raise ConfigError("--transports mpi needs --launcher mpirun")
    return transports


def _positive_ints(option: str, text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option}: expected a comma list of integers, got {text!r}") from None
    if min(values) < 1:
        raise ConfigError(f"{option}: values must be >= 1, got {text!r}")
    return values


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    """Every (stages, schedule, microbatches) is checked against the model before any launch."""
    from jobs.bench.pipeline import format_table
    from parallel.schedule import build_schedule, stage_bounds

    stages, microbatches = _positive_ints("--stages", args.stages), _positive_ints("--microbatches", args.microbatches)
    for option in PIPELINE_SIZES:
        _positive_ints(f"--{option}", str(getattr(args, option)))
    for p in stages:
        for name in args.schedules.split(","):
            v = args.virtual if name == "interleaved" else 1
            stage_bounds(args.layers, p, v)
            for m in microbatches:
                build_schedule(name, p, m, v)
    launcher = _launcher(args)
    _print_rows(args, [row for p in stages for row in _launch("pipeline", args, launcher, p)], format_table)
    return 0


def cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    from hpc.runtime import launch
    from hpc.text import parse_size
    from jobs.bench.checkpoint import format_table
    from jobs.bench.rank import rank_command

    try:
        parse_size(args.size)
    except ValueError as exc:
        raise ConfigError(f"--size: {exc}") from None
    _check_least(("-n", args.nprocs, 1), ("--iters", args.iters, 1))
    launcher = _launcher(args)
    if launcher == "local":  # under mpirun the ranks may run on other hosts, whose GPUs this one cannot see
        options.resolve_device(args.device)

    def rank_argv(out: str, scratch: str) -> tuple[str, ...]:  # each run's files in its own scratch directory
        files = os.path.abspath(os.path.join(scratch, "files"))
        return rank_command("checkpoint", out, *options.as_argv("checkpoint", args), "--files", files)

    made = _make_dirs(Path(args.dir))
    try:
        rows = launch.launch_for_rows(args.nprocs, launcher, rank_argv, parent=args.dir)
    finally:  # each run deletes its files: the directories made for them go too
        _remove_made(made)
    _print_rows(args, rows, format_table)
    return 0


def _make_dirs(directory: Path) -> list[Path]:
    """``--dir`` and its missing parents, those made returned, outermost first; one line naming --dir when one
    cannot be made (nothing made left behind)."""
    from hpc.config import show_path

    made: list[Path] = []
    for path in [*reversed(directory.parents), directory]:
        if path.is_dir():
            continue
        try:
            path.mkdir()
        except OSError as exc:
            _remove_made(made)
            what = "it" if path == directory else show_path(path)
            reason = f"{what} is not a directory" if isinstance(exc, FileExistsError) else \
                f"cannot create {what}: {exc.strerror}"
            raise ConfigError(f"--dir {show_path(directory)}: {reason}") from None
        made.append(path)
    return made


def _remove_made(made: Sequence[Path]) -> None:
    """The directories ``_make_dirs`` made, innermost first, while they are empty."""
    for directory in reversed(made):
        try:
            directory.rmdir()
        except OSError:
            return


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from jobs.bench.memory import format_table

    ranks = _positive_ints("-n", args.nprocs)
    _check_names("--zero", args.zero.split(","), ("0", "1", "2", "3"))
    _check_least(("--steps", args.steps, 1))
    _check_names("--impls", args.impls.split(","), ("ours", "torch-zero", "fsdp2"))
    launcher = _launcher(args)
    _print_rows(args, [row for n in ranks for row in _launch("memory", args, launcher, n)], format_table)
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from hpc.config import CODEC_NAMES
    from hpc.observe.plots import check_png_path, save_png

    _check_names("--codecs", args.codecs.split(","), CODEC_NAMES)
    _check_names("--scopes", args.scopes.split(","), SCOPES)
    hooks = [h for h in args.ddp.split(",") if h]
    _check_names("--ddp", hooks, DDP_IMPLS)
    _check_least(("-n", args.nprocs, 2), ("--steps", args.steps, 1), ("--rounds", args.rounds, 1),
                 ("--warmup", args.warmup, 0))
    launcher, args.ddp = _launcher(args), ",".join(hooks)
    _check_time_to_loss(args)
    plot = check_png_path(args.plot) if args.plot else None
    rows = _launch("train", args, launcher, args.nprocs)
    if args.target_loss is None:
        from jobs.bench.train import format_table
    else:
        from jobs.bench.time_to_loss import format_table, loss_curves_figure

        if plot:
            save_png(loss_curves_figure(rows), plot)
    _print_rows(args, rows, format_table)
    return 0


def _check_time_to_loss(args: argparse.Namespace) -> None:
    """Its options refused without --target-loss (they would be ignored), and with it checked as the GPT needs."""
    if args.target_loss is None:
        given = {"plot": args.plot, "full": args.full or None, **options.time_to_loss_given(args)}
        needless = [option for option, value in given.items() if value is not None]
        if needless:
            raise ConfigError(f"--{needless[0]} is for time to loss: it needs --target-loss")
        return
    from jobs.bench.train import GPT_SIZE

    if not args.target_loss > 0:
        raise ConfigError(f"--target-loss must be positive (got {args.target_loss})")
    sizes = options.time_to_loss_sizes(args)
    _check_least(*((f"--{option}", value, 1) for option, value in sizes.items()))
    if sizes["width"] % GPT_SIZE["n_heads"]:
        raise ConfigError(f"--width must be a multiple of the GPT's {GPT_SIZE['n_heads']} heads (got {sizes['width']})")

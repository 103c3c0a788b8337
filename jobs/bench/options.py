"""Each benchmark's own options, declared once: ``hpc bench KIND`` builds its subcommand from them (adding how the
ranks start and how the rows print) and passes their values on to ``python -m jobs.bench.rank KIND``, whose parser
is built from the same declarations (jobs/bench/rank.py); ``hpc bench codecs`` runs in process. Standard library
only: ``hpc --help`` imports it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hpc.config import CODEC_NAMES
from hpc.errors import ConfigError

PIPELINE_SIZES = ("virtual", "layers", "width", "rows", "steps")  # integer options of the pipeline bench
# hpc bench train --target-loss: the integer options and their defaults
TIME_TO_LOSS_DEFAULTS = {"max-steps": 400, "eval-every": 10, "width": 256, "layers": 4, "batch": 4}
TIME_TO_LOSS_HELP = {"max-steps": "give up after this many steps", "eval-every": "steps between held-out losses",
                     "width": "GPT width", "layers": "GPT blocks", "batch": "sequences per rank per step"}
DDP_IMPLS = ("ddp", "ddp-fp16", "ddp-powersgd")  # jobs.bench.train builds them; spelled here to keep torch out
DEVICES = ("auto", "cpu", "cuda")  # where a benchmark's tensors live; auto: cuda where a GPU is visible
SCOPES = ("flat", "inter-node")  # where our codecs run
TRANSPORTS = "(default: both under mpirun)"


def _allreduce(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1K,64K,1M,16M,64M", help="comma list, e.g. 1K,64M (default %(default)s)")
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES), help="gradient codecs (default %(default)s)")
    parser.add_argument("--transports", help=f"ring transports: torch, mpi {TRANSPORTS}")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per row (default 5)")
    parser.add_argument("--op", choices=("allreduce", "reduce-scatter"), default="allreduce",
                        help="the exchange: the all-reduce, or ZeRO-2/3's reduce-scatter (default %(default)s)")
    _scopes(parser)


def _scopes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scopes", default="flat", help=f"where our codecs run: {', '.join(SCOPES)} (cut by the "
                                                         "nodes the launcher names) (default %(default)s)")


def _pipeline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--microbatches", default="4,8", help="comma list (default %(default)s)")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved", help="(default %(default)s)")
    sizes = {"virtual": (2, "chunks per rank, interleaved only"), "layers": (64, "Linear+Tanh blocks in the model"),
             "width": (1024, "features per block"), "rows": (64, "rows per microbatch"),
             "steps": (3, "timed steps per row, after one warm-up")}
    for option in PIPELINE_SIZES:
        default, what = sizes[option]
        parser.add_argument(f"--{option}", type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument("--transports", help=f"message transports: torch, mpi {TRANSPORTS}")


def _checkpoint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="256M", help="bytes of training state, e.g. 64M, 1G (default %(default)s)")
    parser.add_argument("--iters", type=int, default=3, help="timed rounds; each row is the median (default 3)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the state lives: auto is cuda where a GPU is visible (default %(default)s)")


def _memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zero", default="0,1,2,3", help="our ZeRO stages (default %(default)s)")
    parser.add_argument("--impls", default="ours,torch-zero,fsdp2", help="(default %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row, after one warm-up (default 3)")


def _train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", help=f"ring transports: torch, mpi {TRANSPORTS}")
    parser.add_argument("--codecs", default="none", help="our gradient codecs (default %(default)s)")
    _scopes(parser)
    parser.add_argument("--ddp", default="ddp", help=f"comma list of {', '.join(DDP_IMPLS)} (default %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; steps/s is the median (default 3)")
    loss = parser.add_argument_group("time to loss (on the license texts; every implementation trains to a target)")
    loss.add_argument("--target-loss", type=float, help="train each implementation to this held-out loss")
    for option, default in TIME_TO_LOSS_DEFAULTS.items():  # no default here: given without --target-loss is refused
        loss.add_argument(f"--{option}", type=int, help=f"{TIME_TO_LOSS_HELP[option]} (default {default})")
    loss.add_argument("--full", action="store_true",
                      help="train every row all --max-steps (not to the target), so final losses compare")


def _alltoall(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="64K,1M,16M", help="bytes each rank sends (default %(default)s)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per row (default 10)")
    parser.add_argument("--transports", help=f"ours over: torch, mpi {TRANSPORTS}")


def _codecs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="64M,256M", help="bytes of float32 input (default %(default)s)")
    parser.add_argument("--codecs", default="fp16,bf16,int8,topk,powersgd", help="(default %(default)s)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per op; the median (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto is cuda where a GPU is visible (default %(default)s)")


OPTIONS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "allreduce": _allreduce, "pipeline": _pipeline, "checkpoint": _checkpoint, "memory": _memory, "train": _train,
    "alltoall": _alltoall, "codecs": _codecs,
}


def parser(kind: str) -> argparse.ArgumentParser:
    """``kind``'s own options alone: the parent of its ``hpc bench`` subcommand and of its ranks' parser."""
    options = argparse.ArgumentParser(add_help=False)
    OPTIONS[kind](options)
    return options


def time_to_loss_given(args: argparse.Namespace) -> dict[str, int | None]:
    """The time to loss integer options as given: None for each one left out."""
    return {option: getattr(args, option.replace("-", "_")) for option in TIME_TO_LOSS_DEFAULTS}


def time_to_loss_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The time to loss integer options as given, each one left out at its default."""
    return {option: TIME_TO_LOSS_DEFAULTS[option] if value is None else value
            for option, value in time_to_loss_given(args).items()}


def resolve_device(asked: str) -> str:
    """``--device``: ``auto`` is ``cuda`` where torch sees a GPU, else ``cpu``; ``cuda`` without one is one line."""
    import torch

    if asked == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU here")
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return asked


def as_argv(kind: str, args: argparse.Namespace) -> list[str]:
    """``args``' values of ``kind``'s own options as the command line its ranks parse back: a flag that is set
    alone, an option left unset not at all."""
    argv: list[str] = []
    for action in parser(kind)._actions:
        value = getattr(args, action.dest)
        if value is None or value is False:
            continue
        argv += [action.option_strings[-1]] if value is True else [action.option_strings[-1], str(value)]
    return argv

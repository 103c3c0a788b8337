"""The local test cluster (``cluster``) and the network-namespace testbed it and the benchmarks run on (``netns``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence

from hpc.errors import HpcError


def run_command(parser: argparse.ArgumentParser, handlers: Mapping[str, Callable[[argparse.Namespace], int | None]],
                argv: Sequence[str] | None) -> int:
    """The ``python -m slurm.testbed.X COMMAND`` entry: the handler's status, or 1 with one line on an HpcError."""
    args = parser.parse_args(argv)
    try:
        return handlers[args.command](args) or 0
    except HpcError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1

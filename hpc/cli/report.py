"""``hpc report RUN_DIR``: plots and a self-contained HTML page for a run.

Nothing heavy at module level (``hpc --help`` imports this): matplotlib is imported by the plotting.
"""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser("report", help="plot a run (loss, throughput, time per rank) into PNGs and one "
                                                "self-contained HTML page")
    report.add_argument("run_dir", help="the run directory, <job.run_dir>/<job.name>, holding metrics.jsonl")
    report.add_argument("--out", metavar="DIR", help="where to write (default RUN_DIR/report)")
    report.set_defaults(handler=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from hpc.observe.report import write_report

    for path in write_report(args.run_dir, args.out):
        print(f"wrote {path}")
    return 0

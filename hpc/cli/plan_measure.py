"""``hpc plan --calibrate`` and ``--validate``: this machine measured (jobs/bench/calibrate.py,
jobs/bench/plan_check.py: they start ranks and import torch) and fitted or set against the planner
(parallel/calibrate.py); what they print and write.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from hpc.errors import ConfigError, HpcError
from hpc.text import format_table

VALIDATION_HEADER = ["layout", "ranks", "predicted", "measured", "ratio", "pred. memory", "measured", "ratio"]


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this node ``--repeats`` times and write a cluster file of each constant's median (one round of a
    busy 2-core VM moves a rate or a latency by 10-50%)."""
    from pathlib import Path

    from hpc.rundir import replace_text
    from jobs.bench.calibrate import calibrate
    from parallel.cluster import CALIBRATED_HEADER, cluster_toml

    if args.nprocs < 2:
        raise ConfigError(f"--calibrate needs -n of at least 2 ranks (a ring), got {args.nprocs}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    check_output(args.out, "--out", make_folder=True)
    if os.path.lexists(args.out) and _first_line(args.out) != CALIBRATED_HEADER:
        raise ConfigError(f"--out {args.out}: the file exists and is not a cluster file hpc plan --calibrate wrote "
                          "(it replaces only those): give another --out, or move the file away")
    cluster, measured = calibrate(args.nprocs, args.launcher, args.repeats)
    replace_text(Path(args.out), cluster_toml(cluster))
    print(calibration_text(cluster, measured, args.nprocs, args.out))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Run each layout, then print (and with --record keep) predicted against measured."""
    import sys

    from jobs.bench.plan_check import select, validate
    from parallel.cluster import load_cluster

    if not args.spec or args.cluster is None:
        raise ConfigError("hpc plan --validate needs a job spec and --cluster (hpc plan --calibrate writes one)")
    if args.steps <= args.warmup:
        raise ConfigError(f"--steps must exceed --warmup, got {args.steps} and {args.warmup}")
    cluster = load_cluster(args.cluster)
    labels = args.layouts.split(",") if args.layouts else (["dp=2", "dp=2 fp16"] if args.testbed else None)
    try:
        cases = select(labels)
    except KeyError as error:
        raise ConfigError(f"--layouts: {error.args[0]}") from None
    nodes = [case.label for case in cases if case.ranks_per_host > 1]
    if nodes and not args.testbed:
        raise ConfigError(f"--layouts: {nodes[0]!r} runs nodes of several ranks, which only the namespace testbed "
                          "has: add --testbed RATE (root)")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    if args.testbed:
        from slurm.testbed.netns import rate_bits

        try:
            rate_bits(args.testbed)
        except HpcError as error:
            raise ConfigError(f"--testbed: {error}") from None
    if args.record:
        check_output(args.record, "--record", make_folder=False)
    cluster, rows, load = validate(args.spec, cases, cluster, list(args.overrides), args.steps, args.warmup,
                                   args.repeats, args.launcher, args.testbed)
    record = {"command": "hpc plan " + " ".join(sys.argv[2:]), "spec": args.spec, "cluster": asdict(cluster),
              "load_1min": load, "cpus": os.cpu_count(), "rows": rows}
    if args.record:
        with open(args.record, "w") as handle:
            handle.write(json.dumps(record, indent=1) + "\n")
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{validation_table(rows)}\nload average (1 min) during the runs: "
              f"{min(load):.1f} to {max(load):.1f} on {os.cpu_count()} CPUs")
    return 0


def check_output(path: str, flag: str, make_folder: bool) -> None:
    """``path`` a file this user can write, its folder made first where ``make_folder``: checked before the minutes
    of measuring, so that a bad path loses none of them."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: a directory (give a file name)")
    if make_folder:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"{flag} {path}: cannot make the directory {folder}: {error.strerror}") from None
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: cannot write it (permission denied)")


def _first_line(path: str) -> str:
    """The file's first line, or "" where it cannot be read as text."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        return ""


def validation_table(rows: list[dict]) -> str:
    return format_table(VALIDATION_HEADER, [
        [r["label"], str(r["nprocs"]), f"{r['predicted_step_s'] * 1e3:.0f} ms", f"{r['step_s'] * 1e3:.0f} ms",
         f"{r['step_ratio']:.2f}", f"{r['predicted_peak_bytes'] / 2**20:.0f} MiB",
         f"{r['peak_bytes'] / 2**20:.0f} MiB", f"{r['memory_ratio']:.2f}"] for r in rows])


def calibration_text(cluster, measured: dict[str, list[float]], nprocs: int, out: str) -> str:
    """Each constant --calibrate wrote, the median of the rounds, with every round's value in brackets."""
    def spread(name: str, scale: float, unit: str) -> str:
        return f"{getattr(cluster, name) * scale:.4g} {unit} ({', '.join(f'{v * scale:.4g}' for v in measured[name])})"

    return (f"median of {len(measured['intra_gbps'])} rounds (each round's in brackets): alpha "
            f"{spread('intra_alpha_us', 1, 'us')}, beta {spread('intra_gbps', 1, 'GB/s')} (ring over {nprocs} ranks); "
            f"one core {spread('peak_tflops_fp32', 1e3, 'GFLOP/s')} and {spread('layer_overhead_us', 1, 'us')} fixed "
            f"per GPT block forward+backward; {cluster.cores_per_node} threads {spread('thread_speedup', 1, 'x one')}; "
            f"copy {spread('memory_gbps', 1, 'GB/s')}; AdamW {spread('tensor_overhead_us', 1, 'us')} per tensor and "
            f"{spread('optimizer_traffic', 1, 'x')} the fused traffic; int8 {spread('int8_encode_ns', 1, 'ns')} an "
            f"encode, {spread('int8_hop_ns', 1, 'ns')} a hop per element; "
            f"step {spread('step_overhead_ms', 1, 'ms')} fixed; rank base {cluster.rank_base_mib:.0f} MiB\n"
            f"wrote {out}")

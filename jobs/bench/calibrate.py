"""``hpc plan --calibrate``'s measurements of this node, in rounds: our ring's ``hpc bench allreduce`` rows, a GPT
block on one core and on every core's threads, a copy's bandwidth, the optimizer's cost per tensor and per parameter,
the int8 codec's per element (all jobs/bench/compute.py's) and one rank of a tiny GPT for a step's fixed cost and a
rank's base memory; each round fitted into a cluster (parallel/calibrate.py), and the rounds' medians kept.
"""

from __future__ import annotations

import os
from pathlib import Path

from jobs.bench.plan_check import RING_SIZES, Case, run_case
from parallel.calibrate import cpu_node, median_cluster, predict, with_floor
from parallel.cluster import Cluster

# One rank of a GPT too small to cost anything itself: its step is the step's fixed cost.
FLOOR = ("model.n_layers=1", "model.d_model=8", "model.n_heads=1", "model.seq_len=8", "data.batch_size=1",
         "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1")
GPT_SPEC = Path(__file__).resolve().parents[1] / "examples" / "gpt.toml"


def calibrate(nprocs: int, launcher: str | None, repeats: int) -> tuple[Cluster, dict[str, list[float]]]:
    """This node measured ``repeats`` times: (the cluster of each constant's median, every round's values)."""
    return median_cluster([measure_round(nprocs, launcher) for _ in range(repeats)])


def measure_round(nprocs: int, launcher: str | None) -> Cluster:
    """One measurement of this node as a cluster of ``nprocs`` CPU ranks sharing its memory."""
    from hpc.runtime import launch
    from jobs.bench.compute import (
        measure_copy_gbps,
        measure_int8_s,
        measure_layers,
        measure_optimizer_s,
        measure_tensor_overhead,
    )
    from jobs.bench.rank import rank_argv

    options = ["--sizes", RING_SIZES, "--codecs", "none", "--transports", "torch", "--iters", "5"]
    rows = launch.launch_for_rows(nprocs, launcher or launch.default_launcher(), rank_argv("allreduce", options))
    cores = os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30) / nprocs
    cluster = cpu_node(f"{os.uname().nodename} ({cores} cores, CPU ranks)", cores, memory_gib, rows,
                       measure_copy_gbps(), measure_layers(threads=sorted({1, cores})), measure_tensor_overhead(),
                       measure_optimizer_s(), measure_int8_s())
    return _floor(cluster, launcher)


def _floor(cluster: Cluster, launcher: str | None) -> Cluster:
    """A step's fixed cost and a rank's base memory, from one rank training a GPT too small to cost anything
    itself: its median step less what the planner already charges, and its peak resident set."""
    from hpc.config import load_spec
    from jobs.models.shape import spec_model

    row = run_case(str(GPT_SPEC), Case("floor", 1, FLOOR), [], steps=24, warmup=4, launcher=launcher)
    spec = load_spec(str(GPT_SPEC), list(FLOOR))
    return with_floor(cluster, row["step_s"], row["peak_bytes"], predict(spec, spec_model(spec), 1, cluster))

"""A cluster as the planner sees it (``hpc plan --cluster``): devices per node, their peak FLOP/s and memory,
and the alpha-beta cost of the intra-node and inter-node links. Standard library only.

A cluster file is TOML with one ``[cluster]`` table; it is read with the job spec's machinery
(``hpc.config.table_from_dict``), so a bad value is one line naming ``cluster.<key>``. Built-in files live in
``parallel/clusters/`` and are found by name (``--cluster a100-superpod``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from hpc.config import _field, read_toml, show_path, table_from_dict
from hpc.errors import ConfigError

BUILTIN = Path(__file__).resolve().parent / "clusters"
Dtype = Literal["fp32", "tf32", "bf16", "fp16"]


@dataclass(frozen=True)
class Cluster:
    """Devices, their rates and their links; the alpha-beta model: a message of n bytes takes alpha + n / beta."""

    name: str = _field("cluster", "what the cluster is called in the plan's output")
    source: str = _field("", "where the figures come from (a paper, a data sheet, hpc plan --calibrate)")
    devices_per_node: int = _field(8, "GPUs (or CPU ranks) per node", min=1)
    memory_gib: float = _field(80.0, "memory per device, GiB", gt=0)
    usable_memory: float = _field(0.9, "the share of memory_gib a rank may fill (allocator, workspace, CUDA context "
                                        "take the rest)", gt=0, max=1)
    peak_tflops_fp32: float = _field(19.5, "peak dense teraFLOP/s per device, fp32", gt=0)
    peak_tflops_tf32: float = _field(156.0, "peak dense teraFLOP/s per device, tf32 tensor cores", gt=0)
    peak_tflops_bf16: float = _field(312.0, "peak dense teraFLOP/s per device, bf16", gt=0)
    peak_tflops_fp16: float = _field(312.0, "peak dense teraFLOP/s per device, fp16", gt=0)
    matmul_efficiency: float = _field(0.7, "the share of peak that a transformer's large matrix products sustain",
                                      gt=0, max=1)
    memory_gbps: float = _field(2039.0, "device memory bandwidth, GB/s (what elementwise work is bound by)", gt=0)
    intra_alpha_us: float = _field(5.0, "intra-node link: latency of one message, microseconds", min=0)
    intra_gbps: float = _field(230.0, "intra-node link: bandwidth per device and direction, GB/s", gt=0)
    inter_alpha_us: float = _field(10.0, "inter-node link: latency of one message, microseconds", min=0)
    inter_gbps: float = _field(25.0, "inter-node link: bandwidth per device and direction, GB/s", gt=0)
    eager_kept: float = _field(1.0, "eager PyTorch (no train.compile): activations kept for backward over the fused "
                                    "count (autocast's copies, unfused intermediates); 1 where calibrated with it",
                               gt=0)
    eager_traffic: float = _field(1.0, "eager PyTorch: elementwise bytes moved over the fused kernels'", gt=0)
    # CPU terms (docs/PLANNER.md, "CPU ranks"): zero on GPU clusters, where they vanish behind the kernels.
    cores_per_node: int = _field(0, "CPU cores the ranks of a node share (0: every device computes on its own); a rank "
                                    "computes at cores/ranks times the one-core rate", min=0)
    thread_speedup: float = _field(0.0, "how many one-core rates the node computes at with every core busy (one rank "
                                        "on cores_per_node threads; the cores share caches and memory bandwidth); "
                                        "0: cores_per_node, linear", min=0)
    layer_overhead_us: float = _field(0.0, "fixed time of one layer's forward and backward on one rank, whatever its "
                                           "size (interpreter, dispatcher, autograd)", min=0)
    tensor_overhead_us: float = _field(0.0, "the optimizer step's fixed time per parameter tensor", min=0)
    step_overhead_ms: float = _field(0.0, "fixed time of a training step outside the layers (data, loss, clipping, "
                                          "bookkeeping)", min=0)
    optimizer_traffic: float = _field(1.0, "the optimizer step's bytes moved over the fused minimum (2 x its bytes per "
                                           "parameter): torch's per-tensor loop on CPU passes over memory once per op",
                                      gt=0)
    int8_encode_ns: float = _field(0.0, "the int8 codec's encode of one gradient element with its error feedback (the "
                                        "encode, a decode, the residual's update), one core, nanoseconds; 0: it runs "
                                        "beside the link, as on a GPU", min=0)
    int8_hop_ns: float = _field(0.0, "a ring hop's decode (or decode and add) of one received int8 element, one core, "
                                     "nanoseconds", min=0)
    rank_base_mib: float = _field(0.0, "memory a rank holds before its model (interpreter, libraries, the backend); "
                                       "CPU ranks' peak resident set counts it", min=0)

    def peak_flops(self, dtype: Dtype) -> float:
        """Peak dense FLOP/s of one device in ``dtype``."""
        return getattr(self, f"peak_tflops_{dtype}") * 1e12

    def core_share(self, ranks: int) -> float:
        """How many one-core rates a rank's kernels run at when ``ranks`` ranks of a node run at once; 1 on GPUs.
        A node whose cores all compute, on one rank's threads or on several ranks, runs at ``thread_speedup``
        one-core rates (the cores share caches, memory bandwidth and the host's time), split evenly among its
        ranks: time-sharing below one core each."""
        if not self.cores_per_node:
            return 1.0
        return (self.thread_speedup or self.cores_per_node) / min(ranks, self.devices_per_node)

    def interpreter_share(self, ranks: int) -> float:
        """The share of a core a rank's single-threaded work (interpreter, dispatcher, per-tensor loops) gets:
        cores / ranks up to one core, since threads do not speed it up; 1 on GPUs."""
        if not self.cores_per_node:
            return 1.0
        return min(1.0, self.cores_per_node / min(ranks, self.devices_per_node))

    def link(self, span: int) -> tuple[float, float]:
        """(alpha seconds, beta bytes/s) of a group whose ranks span ``span`` consecutive devices: inside one node
        when the span fits a node evenly (no group straddles two), else the inter-node link (the slowest hop sets
        a ring's pace)."""
        if span <= self.devices_per_node and self.devices_per_node % span == 0:
            return self.intra_alpha_us * 1e-6, self.intra_gbps * 1e9
        return self.inter_alpha_us * 1e-6, self.inter_gbps * 1e9


def builtin_clusters() -> list[str]:
    """The names of the cluster files shipped in parallel/clusters/."""
    return sorted(path.stem for path in BUILTIN.glob("*.toml"))


def load_cluster(name_or_path: str | os.PathLike[str]) -> Cluster:
    """A cluster file by path, or a built-in one by name; errors name the file and ``cluster.<key>``."""
    path = Path(name_or_path)
    if not path.exists() and str(name_or_path) in builtin_clusters():
        path = BUILTIN / f"{name_or_path}.toml"
    elif not path.exists():
        names = ", ".join(builtin_clusters())
        raise ConfigError(f"no such cluster file: {show_path(name_or_path)} (built-in: {names})")
    data = read_toml(path, "cluster file")
    source = show_path(path)
    unknown = sorted(set(data) - {"cluster"})
    if unknown:
        raise ConfigError(f"{source}: unknown table {unknown[0]!r} (a cluster file holds one [cluster] table)")
    if "cluster" not in data:
        raise ConfigError(f"{source}: no [cluster] table")
    return table_from_dict(Cluster, data["cluster"], "cluster", source)


CALIBRATED_HEADER = "# Written by hpc plan --calibrate: measured, not data-sheet figures."


def cluster_toml(cluster: Cluster) -> str:
    """A cluster as the TOML ``load_cluster`` reads back (``hpc plan --calibrate`` writes it)."""
    lines = [CALIBRATED_HEADER, "[cluster]"]
    for key, value in asdict(cluster).items():
        lines.append(f"{key} = {json.dumps(value if not isinstance(value, float) else round(value, 6))}")
    return "\n".join(lines) + "\n"

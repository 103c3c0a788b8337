"""The planner's calibration (``hpc plan --calibrate``, ``--validate``): its constants fitted to what a node
measured, and its predictions of a job spec set against measured runs. Standard library only; the measuring
itself is jobs/bench/calibrate.py's and jobs/bench/plan_check.py's (they start ranks and import torch).
"""

from __future__ import annotations

import statistics
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from hpc.config import show_text
from hpc.errors import ConfigError
from parallel.cluster import Cluster
from parallel.plan import OPTIMIZER_BYTES, Estimate, Transformer, estimate, spec_layout, spec_training

if TYPE_CHECKING:
    from hpc.config import JobSpec

RATES = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}  # tc's units of a shaped link
OPTIMIZER_PROBE = (16, 1 << 18)  # --calibrate's AdamW step: tensors, elements each (a mid-sized model's weights)


def fit_alpha_beta(samples: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of the ring all-reduce model, seconds = 2 (k-1) alpha + 2 (k-1)/k bytes / beta,
    through the mean of the smallest messages' measurements and the mean of the largest's (``hpc plan
    --calibrate``): the model's two uses are those ends (one-number all-reduces, bucket-sized exchanges), and a least
    squares fit over every size, ruled by the large messages, left the latency to noise (0 to 616 us in fits of one
    testbed link, whose mid-sized messages also ride the shaper's burst)."""
    rows = [(2.0 * (k - 1), 2.0 * (k - 1) / k * n, t, n) for n, k, t in samples if k > 1]
    if len(rows) < 2:
        raise ValueError("fitting alpha and beta needs two measurements on at least two ranks")
    sizes = sorted({n for *_, n in rows})
    if len(sizes) < 2:
        raise ValueError("fitting alpha and beta needs measurements of at least two message sizes")
    def mean_row(size: float) -> list[float]:
        at = [row[:3] for row in rows if row[3] == size]
        return [sum(column) / len(at) for column in zip(*at, strict=True)]

    (xs, ys, ts), (xl, yl, tl) = mean_row(sizes[0]), mean_row(sizes[-1])
    det = xs * yl - ys * xl
    alpha = (ts * yl - ys * tl) / det
    inverse_beta = (xs * tl - ts * xl) / det
    if alpha < 0:  # latency below what the measurements resolve: bandwidth alone, through the largest messages
        alpha, inverse_beta = 0.0, tl / yl
    return alpha, 1.0 / max(inverse_beta, 1e-15)


def ring_link(rows: list[dict], impl: str = "ring") -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of ``hpc bench allreduce``'s rows of our ring (or of ``impl``'s: ``cut`` on one
    node, its node stages, fitted as a ring)."""
    return fit_alpha_beta([(r["bytes"], r["ranks"], r["time_s"]) for r in rows if r["impl"] == impl])


def fit_overhead_and_rate(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds, FLOP/s) of seconds = fixed + flops / rate, fitted to (flops, seconds) samples of one layer's
    forward and backward at several sizes (``hpc plan --calibrate``) by least squares on the relative error (weights
    1/seconds^2), so that the small layers, which show the fixed cost, count as much as the large ones."""
    if len({flops for flops, _ in samples}) < 2:
        raise ValueError("fitting a fixed cost and a rate needs samples of at least two sizes")
    weights = [1.0 / max(t, 1e-12) ** 2 for _, t in samples]
    total = sum(weights)
    mean_f = sum(w * f for w, (f, _) in zip(weights, samples, strict=True)) / total
    mean_t = sum(w * t for w, (_, t) in zip(weights, samples, strict=True)) / total
    covariance = sum(w * (f - mean_f) * (t - mean_t) for w, (f, t) in zip(weights, samples, strict=True))
    variance = sum(w * (f - mean_f) ** 2 for w, (f, _) in zip(weights, samples, strict=True))
    slope = max(covariance / variance, 1e-18)
    return max(0.0, mean_t - slope * mean_f), 1.0 / slope


def fit_layers(rows: list[dict], memory_gbps: float) -> tuple[float, float]:
    """(fixed seconds, FLOP/s) of a block's forward and backward (jobs/bench/compute.py's rows): its time less the
    elementwise bytes the planner charges at the copy bandwidth, fitted as fixed + 3 x layer FLOPs / rate."""
    samples = []
    for row in rows:
        layer = Transformer(1, row["hidden"], row["heads"], row["seq_len"], 256)
        tokens = row["batch"] * row["seq_len"]
        moved = 2 * layer.activation_bytes(tokens, 1, 4) / (memory_gbps * 1e9)
        samples.append((3 * layer.layer_flops(tokens), row["seconds"] - moved))
    return fit_overhead_and_rate(samples)


def cpu_node(name: str, cores: int, memory_gib: float, ring_rows: list[dict], copy_gbps: float,
             layer_rows: list[dict], tensor_overhead_s: float, optimizer_s: float = 0.0,
             int8_s: tuple[float, float] = (0.0, 0.0)) -> Cluster:
    """A node of CPU ranks from one round of measurements: the ring's alpha and beta (both links), a GPT block's
    fixed cost and FLOP rate on one core and the rate on every core's threads, a copy's bandwidth, the optimizer's
    cost per tensor and per parameter (its traffic over the planner's fused minimum, the tensors' cost taken out),
    the int8 codec's per element (an encode with error feedback, a hop's decode or add)."""
    alpha, beta = ring_link(ring_rows)
    overhead, rate = fit_layers([row for row in layer_rows if row["threads"] == 1], copy_gbps)
    _, threaded_rate = fit_layers([row for row in layer_rows if row["threads"] == cores], copy_gbps)
    tflops = rate / 1e12
    fused_s = 2 * (4 + 4 + OPTIMIZER_BYTES["adamw"]) / (copy_gbps * 1e9)  # fp32 weights and gradients, Adam's state
    traffic = max(1.0, (optimizer_s - tensor_overhead_s / OPTIMIZER_PROBE[1]) / fused_s) if optimizer_s else 1.0
    return Cluster(
        name=name, source="hpc plan --calibrate", devices_per_node=max(64, cores), memory_gib=round(memory_gib, 2),
        peak_tflops_fp32=tflops, peak_tflops_tf32=tflops, peak_tflops_bf16=tflops, peak_tflops_fp16=tflops,
        matmul_efficiency=1.0, memory_gbps=copy_gbps, intra_alpha_us=alpha * 1e6, intra_gbps=beta / 1e9,
        inter_alpha_us=alpha * 1e6, inter_gbps=beta / 1e9, cores_per_node=cores,
        thread_speedup=min(float(cores), max(1.0, threaded_rate / rate)), layer_overhead_us=overhead * 1e6,
        tensor_overhead_us=tensor_overhead_s * 1e6, optimizer_traffic=traffic, int8_encode_ns=int8_s[0] * 1e9,
        int8_hop_ns=int8_s[1] * 1e9)


def with_floor(cluster: Cluster, step_s: float, peak_bytes: float, charged: Estimate) -> Cluster:
    """A step's fixed cost and a rank's base memory from a GPT too small to cost anything itself: its measured step
    less what the planner already ``charged``, and its peak resident set."""
    return replace(cluster, step_overhead_ms=max(0.0, step_s - charged.step_s) * 1e3, rank_base_mib=peak_bytes / 2**20)


def median_cluster(rounds: list[Cluster]) -> tuple[Cluster, dict[str, list[float]]]:
    """The first round with each measured constant the median of every round's (one round of a busy 2-core VM moves
    a rate or a latency by 10-50%), and every round's values by constant."""
    measured = {f.name: [getattr(c, f.name) for c in rounds] for f in fields(rounds[0])
                if isinstance(getattr(rounds[0], f.name), float)}
    return replace(rounds[0], **{name: statistics.median(values) for name, values in measured.items()}), measured


def testbed_cluster(cluster: Cluster, rate: str, link: tuple[float, float] | None = None) -> Cluster:
    """The namespace testbed as the planner sees it: one rank and one of this machine's cores per virtual host
    (computing at a core's share of the node's rate with every core busy), hosts joined by links shaped to
    ``rate`` (tc's units: 1gbit, 100mbit): at that rate and this node's alpha, or at ``link`` = (alpha s,
    beta B/s) when measured across the testbed (``jobs.bench.plan_check.validate`` gives hosts of several ranks
    their loopback as measured, and each row its ranks per host)."""
    unit = next((u for u in RATES if rate.endswith(u)), None)
    if unit is None or not rate[: -len(unit)].replace(".", "", 1).isdigit():
        raise ConfigError(f"--testbed: expected a rate such as 1gbit or 100mbit, got {show_text(rate)}")
    alpha_us, gbps = cluster.inter_alpha_us, float(rate[: -len(unit)]) * RATES[unit] / 8 / 1e9
    if link is not None:
        alpha_us, gbps = link[0] * 1e6, link[1] / 1e9
    busy_core = cluster.core_share(cluster.cores_per_node) if cluster.cores_per_node else 1.0  # every core busy
    return replace(cluster, name=f"namespace testbed at {rate}", devices_per_node=1, cores_per_node=1,
                   thread_speedup=busy_core, inter_alpha_us=alpha_us, inter_gbps=gbps)


def predict(spec: JobSpec, model: Transformer, ranks: int, cluster: Cluster) -> Estimate:
    """The planner's estimate of ``spec`` (its model as ``model``) run on ``ranks`` ranks, as ``hpc run`` lays it
    out."""
    return estimate(model, spec_training(spec, model.hidden), cluster, spec_layout(spec, ranks))


def compared(row: dict, predicted: Estimate) -> dict:
    """A measured row with the prediction next to it and their ratios (predicted over measured)."""
    return {**row, "layout": predicted.layout.label(), "predicted_step_s": predicted.step_s,
            "predicted_peak_bytes": predicted.memory_bytes, "step_ratio": predicted.step_s / row["step_s"],
            "memory_ratio": predicted.memory_bytes / row["peak_bytes"]}

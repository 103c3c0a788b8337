"""Figures of a run, a sweep and a benchmark: data in, a matplotlib ``Figure`` out; :func:`save_png` writes it.

Figures are built with ``matplotlib.figure.Figure`` and drawn by the Agg canvas, never through
pyplot: no global backend switch, no display, no figure registry that keeps every plot alive,
so this runs on a login node or inside a long process. Nothing here imports torch, and
matplotlib is imported by the functions, so ``import hpc`` and ``hpc --help`` stay fast.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.errors import ConfigError
from hpc.text import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LOG_SPAN = 100.0  # values spanning more than two decades get a log axis


def check_png_path(path: str | Path) -> Path:
    """Fail before a long benchmark or sweep view, not after it, on a path the plot cannot be written to."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot {path}: expected a .png file name")
    if not path.parent.is_dir():
        raise ConfigError(f"--plot {path}: no such directory {path.parent}")
    return path


def save_png(figure: Figure, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", dpi=100)
    return Path(path)


def _figure(width: float = 7.0, height: float = 4.0) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _spans_decades(values: Sequence[float]) -> bool:
    return min(values) > 0 and max(values) > LOG_SPAN * min(values)


def series_figure(steps: Sequence[int], values: Sequence[float], ylabel: str, title: str,
                  reference: tuple[float, str] | None = None) -> Figure:
    """One quantity per step (loss, throughput); ``reference`` draws a labelled horizontal line (a mean)."""
    figure = _figure()
    ax = figure.add_subplot()
    ax.plot(steps, values, linewidth=1.2, label="per step")
    if reference is not None:
        ax.axhline(reference[0], color="tab:red", linestyle="--", linewidth=1, label=reference[1])
        ax.legend()
    if _spans_decades(values):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return figure


def time_breakdown_figure(ranks: Sequence[Mapping[str, Any]]) -> Figure:
    """Per rank, totals over the run: compute and exposed wait stacked (with the rest of the step, where they
    do not fill it), and the communication time as its own hatched bar beside them: it overlaps compute (the reduction
    runs while backward does), so stacking it would count those seconds twice."""
    figure = _figure(max(7.5, 4.0 + 0.8 * len(ranks)), 4.0)
    ax = figure.add_subplot()
    positions = range(len(ranks))
    stacked, beside = [p - 0.2 for p in positions], [p + 0.2 for p in positions]
    bottom = [0.0] * len(ranks)
    for key, label in (("compute_s", "compute"), ("wait_s", "waiting for communication")):
        heights = [r.get(key) or 0.0 for r in ranks]
        ax.bar(stacked, heights, width=0.4, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    step_times = [r.get("step_time_s") or 0.0 for r in ranks]
    rest = [max(0.0, t - b) for t, b in zip(step_times, bottom, strict=True)]
    if max(rest) > 0.01 * max(step_times):  # the training loop counts compute as step time - wait: nothing left
        ax.bar(stacked, rest, width=0.4, bottom=bottom, color="lightgray",
               label="rest of the step (optimizer, data, ...)")
    ax.bar(beside, [r.get("comm_s") or 0.0 for r in ranks], width=0.4, fill=False,
           hatch="//", edgecolor="tab:purple", label="communication (overlaps compute)")
    ax.set_xticks(list(positions), [f"{r['rank']}\n{r.get('host', '')}" for r in ranks])
    ax.set(xlabel="rank", ylabel="seconds, total over the run", title="time per rank")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


def sweep_figure(points: Sequence[tuple[Mapping[str, Any], float]], metric: str) -> Figure:
    """One subplot per swept key: the metric of every task against that key's value.

    Numbers are scattered on a linear axis, or a log one when they span more than two decades;
    anything else (lists, strings, booleans) is shown as categories in order of first appearance.
    """
    keys = list(dict.fromkeys(key for params, _ in points for key in params))
    figure = _figure(max(4.0, 3.5 * len(keys)), 3.5)
    axes = figure.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    metrics = [value for _, value in points]
    for ax, key in zip(axes, keys, strict=True):
        _scatter_against(ax, [params.get(key) for params, _ in points], metrics)
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(metric)
    return figure


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scatter_against(ax: Axes, values: Sequence[Any], metrics: Sequence[float]) -> None:
    if all(_is_number(v) for v in values):
        ax.scatter(values, metrics)
        if _spans_decades(values):
            ax.set_xscale("log")
        return
    labels = [json.dumps(v) for v in values]
    categories = list(dict.fromkeys(labels))
    ax.scatter([categories.index(label) for label in labels], metrics)
    ax.set_xticks(range(len(categories)), categories, rotation=30 if len(categories) > 3 else 0)
    ax.set_xlim(-0.5, len(categories) - 0.5)


def bandwidth_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """``hpc bench allreduce`` rows: bus bandwidth against message size, log-log, one line per implementation."""

    lines: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        label = (f"torch.distributed ({row['transport']})" if row["impl"] == "torch"
                 else f"ring {row['codec']} ({row['transport']} transport)")
        lines.setdefault(label, []).append((row["bytes"], row["busbw_GBps"]))
    figure = _figure()
    ax = figure.add_subplot()
    for label, points in lines.items():
        ax.plot(*zip(*sorted(points), strict=True), marker="o", label=label)
    sizes = sorted({row["bytes"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [human_bytes(size) for size in sizes])
    ranks = ", ".join(str(n) for n in sorted({row["ranks"] for row in rows}))
    ax.set(xlabel="message size (float32, uncompressed)", ylabel="bus bandwidth (GB/s) = algbw x 2(n-1)/n",
           title=f"all-reduce on {ranks} ranks")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return figure

"""``hpc report RUN_DIR``: PNG plots of a run and one self-contained HTML page (PNGs inlined) to mail around.

Reads what a run leaves in its directory (``spec.run_path``): ``metrics.jsonl`` (one object per
step, rank 0), ``ranks/rank-*.json`` (each rank's totals, written at the end) and whether a
``timeline.json`` is there. Every field may be missing or null in files from older runs: what
is missing is left out of the plots and shown as ``-`` in the summary. Nothing here imports torch.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc.errors import HpcError
from hpc.rundir import METRICS_FILE, RANKS_DIR, TIMELINE_FILE
from hpc.text import human_bytes

THROUGHPUT_FIELDS = ("samples_per_s", "tokens_per_s")
WARMUP_SHARE = 0.1  # the first 10% of the steps (at least one) are left out of the mean throughput


class RunDirError(HpcError):
    """A run directory lacks the metrics to report on, or holds a file that is not what a run writes."""


@dataclass(frozen=True)
class Run:
    path: Path
    steps: list[dict[str, Any]]  # one record per step, in step order
    ranks: list[dict[str, Any]]  # per-rank totals by rank; empty when ranks/ is missing
    has_timeline: bool


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, one per step.

    A step logged twice (a run resumed from a checkpoint older than its last logged step) keeps
    its last record, the one the run went on from. An unparsable last line with no newline is
    a record rank 0 is still writing and is skipped; any other bad line is an error naming it.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunDirError(f"{path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, unreadable, not text
        raise RunDirError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    lines = text.splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise RunDirError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise RunDirError(f"{path}:{number}: expected an object with an integer \"step\", got {line[:80]}")
        by_step[record["step"]] = record
    if not by_step:
        raise RunDirError(f"{path} holds no steps yet")
    return [by_step[step] for step in sorted(by_step)]


def read_ranks(directory: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError as exc:
            raise RunDirError(f"{path}: not JSON ({exc})") from None
        except OSError as exc:
            raise RunDirError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("rank"), int):
            raise RunDirError(f"{path}: expected an object with an integer \"rank\"")
        records.append(record)
    return sorted(records, key=lambda record: record["rank"])


def read_run(run_dir: str | Path) -> Run:
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{path}: not a run directory (give <job.run_dir>/<job.name>, which holds {METRICS_FILE})")
    return Run(path, read_metrics(path / METRICS_FILE), read_ranks(path / RANKS_DIR),
               (path / TIMELINE_FILE).exists())


def series(steps: Sequence[dict[str, Any]], field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where ``field`` is logged."""
    kept = [(r["step"], r[field]) for r in steps if r.get(field) is not None]
    return [step for step, _ in kept], [value for _, value in kept]


def throughput_series(steps: Sequence[dict[str, Any]]) -> tuple[str, list[int], list[float]]:
    """(unit, steps, items per second) of ``samples_per_s`` or ``tokens_per_s``, whichever the model logs;
    ("", [], []) when neither is."""
    for field in THROUGHPUT_FIELDS:
        logged_steps, rates = series(steps, field)
        if rates:
            return field.removesuffix("_per_s") + "/s", logged_steps, rates
    return "", [], []


def mean_throughput(rates: Sequence[float]) -> float:
    """Items per second over the steps after warm-up: the harmonic mean of per-step rates, which is
    the total items over the total time when steps are equal in size (the arithmetic mean would
    over-weight the fast steps)."""
    skip = max(1, round(WARMUP_SHARE * len(rates))) if len(rates) > 1 else 0
    return statistics.harmonic_mean(rates[skip:])


def summary(run: Run) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table; ``-`` where the run did not log the field."""

    losses = series(run.steps, "loss")[1]
    rows = [("steps logged", f"{len(run.steps)} (last step {run.steps[-1]['step']})"),
            ("final loss", f"{losses[-1]:.6g}" if losses else "-")]
    unit, _, rates = throughput_series(run.steps)
    rows.append((f"mean throughput (after the first {WARMUP_SHARE:.0%} of steps)",
                 f"{mean_throughput(rates):,.0f} {unit}" if rates else "-"))
    sent = series(run.steps, "comm_bytes")[1]
    total = sum(sent)
    rows.append(("bytes sent by rank 0, all steps", f"{human_bytes(total)} ({total:,} bytes)" if sent else "-"))
    both = [(r["raw_bytes"], r["comm_bytes"]) for r in run.steps if r.get("raw_bytes") and r.get("comm_bytes")]
    ratio = sum(raw for raw, _ in both) / sum(sent for _, sent in both) if both else None
    rows.append(("compression ratio (uncompressed ring bytes / bytes sent)", f"{ratio:.3g}" if ratio else "-"))
    whose = "largest rank" if run.ranks else "rank 0"  # metrics.jsonl is rank 0's
    peaks = [r["peak_memory_bytes"] for r in run.ranks or run.steps if r.get("peak_memory_bytes") is not None]
    rows.append((f"peak memory ({whose})", human_bytes(max(peaks)) if peaks else "-"))
    return rows + straggler_rows(run.steps) + moe_rows(run.steps)


def straggler_rows(steps: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The ranks named as stragglers (hpc/observe/straggler.py): host, first step named, the largest slowdown."""
    named: dict[int, tuple[str, int, float]] = {}
    for record in steps:
        for s in record.get("stragglers", ()):
            host, first, worst = named.get(s["rank"], (s["host"], record["step"], 0.0))
            named[s["rank"]] = (host, first, max(worst, s["slowdown"]))
    return [(f"straggler: rank {rank}", f"on {host}, from step {first}, up to {worst:.2f}x the median rank's step")
            for rank, (host, first, worst) in sorted(named.items())]


def moe_rows(steps: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """A mixture-of-experts run's routing: kept tokens per expert of each MoE layer over all steps, the
    share of routed choices dropped, the load-balancing loss (1 = even). None for a dense run."""
    loads = [r["moe_tokens_per_expert"] for r in steps if r.get("moe_tokens_per_expert")]
    if not loads:
        return []
    totals = [[sum(step[layer][e] for step in loads) for e in range(len(loads[0][layer]))]
              for layer in range(len(loads[0]))]
    dropped = series(steps, "moe_dropped_fraction")[1]
    aux = series(steps, "moe_aux_loss")[1]
    rows = [(f"MoE layer {i}: tokens per expert, all steps", " ".join(f"{n:,}" for n in layer))
            for i, layer in enumerate(totals)]
    rows.append(("MoE: routed choices dropped (mean over steps)",
                 f"{statistics.mean(dropped):.2%}" if dropped else "-"))
    rows.append(("MoE: load-balancing loss, first / last step", f"{aux[0]:.4g} / {aux[-1]:.4g}" if aux else "-"))
    return rows


def write_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the plots the run's files allow and ``report.html`` to ``out`` (default RUN_DIR/report)."""
    from hpc.observe.plots import save_png, series_figure, time_breakdown_figure

    run = read_run(run_dir)
    out = Path(out) if out is not None else run.path / "report"
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out}: a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission
        raise RunDirError(f"--out {out}: cannot make that directory ({exc.strerror or exc})") from None
    plots: list[tuple[str, Path]] = []
    notes: list[str] = []
    steps, losses = series(run.steps, "loss")
    if losses:
        plots.append(("Loss", save_png(series_figure(steps, losses, "loss", "training loss"), out / "loss.png")))
    else:
        notes.append(f"No loss in {METRICS_FILE}: no loss plot.")
    unit, steps, rates = throughput_series(run.steps)
    if rates:
        mean = mean_throughput(rates)
        label = f"mean after the first {WARMUP_SHARE:.0%} of steps: {mean:,.0f} {unit}"
        figure = series_figure(steps, rates, unit, "throughput per step", reference=(mean, label))
        plots.append(("Throughput", save_png(figure, out / "throughput.png")))
    else:
        notes.append(f"No {' or '.join(THROUGHPUT_FIELDS)} in {METRICS_FILE}: no throughput plot.")
    if run.ranks:
        figure = time_breakdown_figure(run.ranks)
        plots.append(("Time per rank", save_png(figure, out / "time_breakdown.png")))
    else:
        notes.append(f"No per-rank totals ({RANKS_DIR}/rank-*.json, written when a run ends): "
                     "no time breakdown plot.")
    if run.has_timeline:
        notes.append(f"Timeline: {run.path / TIMELINE_FILE} is a Chrome trace: open it in "
                     "https://ui.perfetto.dev or chrome://tracing.")
    page = out / "report.html"
    page.write_text(render_html(run, summary(run), plots, notes))
    return [path for _, path in plots] + [page]


def render_html(run: Run, rows: Sequence[tuple[str, str]], plots: Sequence[tuple[str, Path]],
                notes: Sequence[str]) -> str:
    """One page with every image inlined as a ``data:`` URI, so the file alone carries the report."""
    title = html.escape(f"Run report: {run.path.absolute().name}")
    table = "\n".join(f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>" for label, value in rows)
    figures = "\n".join(
        f'<h2>{html.escape(heading)}</h2>\n<img src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode("ascii")}" alt="{html.escape(heading)}">'
        for heading, path in plots)
    remarks = "\n".join(f"<p>{html.escape(note)}</p>" for note in notes)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
th {{ text-align: left; padding-right: 2em; font-weight: normal; color: #555; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>{html.escape(str(run.path.absolute()))}</p>
<table>
{table}
</table>
{figures}
{remarks}
</body>
</html>
"""

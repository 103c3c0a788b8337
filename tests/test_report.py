"""``hpc report``, ``hpc sweep results --plot`` and ``hpc bench allreduce --plot``: real PNGs and a self-contained page.

Run directories are written here in the schema the training loop writes (``metrics.jsonl``,
``ranks/rank-*.json``), and one comes from a real two-rank ``hpc run``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.cli.main import main
from hpc.observe.plots import bandwidth_figure, series_figure, sweep_figure, time_breakdown_figure
from hpc.observe.report import read_metrics
from hpc.text import human_bytes
from tests.test_cli import _error_of

REPO = Path(__file__).resolve().parent.parent
BATCH = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RANKS = [
    {"rank": 0, "host": "node-a", "steps": 40, "step_time_s": 1.5, "compute_s": 0.9, "comm_s": 0.5, "wait_s": 0.2,
     "peak_memory_bytes": 300 << 20},
    {"rank": 1, "host": "node-b", "steps": 40, "step_time_s": 1.6, "compute_s": 1.1, "comm_s": 0.4, "wait_s": 0.1,
     "peak_memory_bytes": 420 << 20},
]


def _steps(count: int) -> list[dict]:
    """A run's records: the first step slow (warm-up), then small variations; every field of the schema."""
    records = []
    for step in range(1, count + 1):
        step_time = 0.5 if step == 1 else 0.02 + 0.003 * (step % 3)
        records.append({
            "step": step, "loss": 2.3 * 0.93**step, "lr": 0.05, "grad_norm": 1.0 / step,
            "samples_per_s": BATCH / step_time, "step_time_s": step_time, "compute_s": 0.6 * step_time,
            "comm_s": 0.3 * step_time, "wait_s": 0.1 * step_time, "comm_bytes": 68_904 + step,
            "raw_bytes": 275_000, "compression_ratio": 275_000 / (68_904 + step), "peak_memory_bytes": 100 << 20,
        })
    return records


def _write_run(run: Path, records: list[dict], ranks: list[dict] | None = RANKS, timeline: bool = True) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if ranks is not None:
        (run / "ranks").mkdir()
        for record in ranks:
            (run / "ranks" / f"rank-{record['rank']:05d}.json").write_text(json.dumps(record))
    if timeline:
        (run / "timeline.json").write_text('{"traceEvents": []}')


def _assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def _inlined_images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_writes_the_plots_and_a_page_that_carries_them_and_the_summary(tmp_path, capsys) -> None:
    run, records = tmp_path / "runs" / "mlp", _steps(40)
    _write_run(run, records)
    assert main(["report", str(run)]) == 0
    out = run / "report"
    names = ("loss.png", "throughput.png", "time_breakdown.png", "report.html")
    assert capsys.readouterr().out.splitlines() == [f"wrote {out / name}" for name in names]
    for name in names[:3]:
        _assert_png(out / name)
    page = (out / "report.html").read_text()
    assert _inlined_images(page) == [(out / name).read_bytes() for name in names[:3]]
    assert f"{records[-1]['loss']:.6g}" in page
    timed = records[4:]  # the first 10% of 40 steps left out: samples over seconds
    assert f"{BATCH * len(timed) / sum(r['step_time_s'] for r in timed):,.0f} samples/s" in page
    assert f"{sum(r['comm_bytes'] for r in records):,} bytes" in page
    assert f"{len(records) * 275_000 / sum(r['comm_bytes'] for r in records):.3g}" in page
    assert human_bytes(420 << 20) in page  # the largest rank's peak
    assert "https://ui.perfetto.dev" in page and str(run / "timeline.json") in page


def test_a_run_without_rank_totals_or_throughput_gets_what_it_has_and_says_what_is_missing(tmp_path, capsys) -> None:
    run = tmp_path / "old"
    records = [{"step": r["step"], "loss": r["loss"]} for r in _steps(12)]
    _write_run(run, records, ranks=None, timeline=False)
    out = tmp_path / "elsewhere"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "report.html"]
    page = (out / "report.html").read_text()
    assert len(_inlined_images(page)) == 1
    assert "no throughput plot" in page and "no time breakdown plot" in page and "perfetto" not in page
    assert page.count("<td>-</td>") == 4  # throughput, bytes, compression ratio, peak memory: not logged
    assert f"{records[-1]['loss']:.6g}" in page


def test_missing_metrics_is_one_line(tmp_path, capsys) -> None:
    code, err = _error_of(capsys, "report", str(tmp_path))
    assert code == 2 and err == f"hpc: error: {tmp_path / 'metrics.jsonl'} not found"


def test_a_file_where_a_directory_belongs_or_the_reverse_is_one_line(tmp_path, capsys) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text("[job]\n")
    assert _error_of(capsys, "report", str(spec)) == (
        2, f"hpc: error: {spec}: not a run directory (give <job.run_dir>/<job.name>, which holds metrics.jsonl)")
    (tmp_path / "odd" / "metrics.jsonl").mkdir(parents=True)
    assert _error_of(capsys, "report", str(tmp_path / "odd")) == (
        2, f"hpc: error: {tmp_path / 'odd' / 'metrics.jsonl'}: cannot read it (Is a directory)")
    run = tmp_path / "run"
    _write_run(run, _steps(5))
    assert _error_of(capsys, "report", str(run), "--out", str(spec)) == (
        2, f"hpc: error: --out {spec}: a file, not a directory")
    assert spec.read_text() == "[job]\n"


def test_a_malformed_line_is_named_by_file_and_number(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    _write_run(run, _steps(5))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = '{"step": 3, "loss": \n'
    (run / "metrics.jsonl").write_text("".join(lines))
    code, err = _error_of(capsys, "report", str(run))
    assert code == 2 and f"hpc: error: {run / 'metrics.jsonl'}:3: not JSON" in err
    lines[2] = '[1, 2]\n'
    (run / "metrics.jsonl").write_text("".join(lines))
    code, err = _error_of(capsys, "report", str(run))
    assert code == 2 and f"{run / 'metrics.jsonl'}:3: expected an object" in err


def test_a_step_logged_twice_keeps_its_last_record_and_a_half_written_last_line_is_skipped(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    first, resumed = _steps(5), [{**r, "loss": r["loss"] + 1} for r in _steps(5)[2:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in first + resumed) + '{"step": 6, "lo')
    assert read_metrics(path) == first[:2] + resumed


def test_series_figure_plots_the_values_and_a_log_axis_only_over_two_decades() -> None:
    records = _steps(30)
    steps, rates = [r["step"] for r in records], [r["samples_per_s"] for r in records]
    figure = series_figure(steps, rates, "samples/s", "throughput", reference=(2500.0, "mean"))
    (ax,) = figure.axes
    assert list(ax.lines[0].get_xdata()) == steps and list(ax.lines[0].get_ydata()) == rates
    assert ax.lines[1].get_ydata()[0] == 2500.0 and ax.get_yscale() == "linear"  # 128 to 3,200: under 2 decades
    assert series_figure(steps, [10.0**-s for s in steps], "loss", "loss").axes[0].get_yscale() == "log"


def test_time_breakdown_stacks_compute_wait_and_rest_and_shows_communication_beside() -> None:
    (ax,) = time_breakdown_figure(RANKS).axes
    bars = {container.get_label(): container for container in ax.containers}
    compute, wait = bars["compute"], bars["waiting for communication"]
    rest, comm = bars["rest of the step (optimizer, data, ...)"], bars["communication (overlaps compute)"]
    assert [b.get_height() for b in compute] == [r["compute_s"] for r in RANKS]
    assert [b.get_y() for b in wait] == [r["compute_s"] for r in RANKS]
    assert [b.get_y() + b.get_height() for b in rest] == pytest.approx([r["step_time_s"] for r in RANKS])
    assert [b.get_height() for b in comm] == [r["comm_s"] for r in RANKS]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0\nnode-a", "1\nnode-b"]
    no_rest = [{**r, "step_time_s": r["compute_s"] + r["wait_s"]} for r in RANKS]
    (ax,) = time_breakdown_figure(no_rest).axes
    assert [c.get_label() for c in ax.containers] == [
        "compute", "waiting for communication", "communication (overlaps compute)"]


SWEEP = """
[sweep]
base = "base.toml"
name = "lr-width"
metric = "final_loss"
[params]
"train.lr" = [1e-4, 1e-3, 1e-1]
"model.hidden_sizes" = [[16], [32, 16]]
"""


def _final_loss(params: dict) -> float:
    return 1.0 + params["train.lr"] * 10 - 0.1 * len(params["model.hidden_sizes"])


def test_sweep_results_plot_one_axis_per_swept_key(tmp_path, capsys) -> None:
    from slurm.sweep import load_sweep, plan, record_outcome, write_manifest

    (tmp_path / "base.toml").write_text('[job]\nname = "digits"\n[train]\nsteps = 5\n')
    (tmp_path / "sweep.toml").write_text(SWEEP)
    sweep = load_sweep(tmp_path / "sweep.toml")
    directory, planned = plan(sweep, [f"job.run_dir={tmp_path / 'runs'}"])
    tasks = [task for task, _ in planned]
    write_manifest(directory, sweep, tasks, "local", 1)
    finished = tasks[:-1]  # the last task has no result yet: not plotted
    for task in finished:
        task.run_path.mkdir(parents=True)
        (task.run_path / "result.json").write_text(json.dumps({"final_loss": _final_loss(task.params)}))
        record_outcome(directory, task.index, "COMPLETED")
    code, err = _error_of(capsys, "sweep", "status", str(directory), "--plot")
    assert code == 2 and "--plot applies to hpc sweep results" in err
    assert main(["sweep", "results", str(directory), "--plot"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {directory / 'results.png'}"
    _assert_png(directory / "results.png")

    points = [(task.params, _final_loss(task.params)) for task in finished]
    lr, width = sweep_figure(points, "final_loss (min)").axes
    assert (lr.get_xlabel(), width.get_xlabel()) == ("train.lr", "model.hidden_sizes")
    assert lr.get_xscale() == "log" and lr.get_ylabel() == "final_loss (min)"
    assert lr.collections[0].get_offsets().tolist() == [[p["train.lr"], loss] for p, loss in points]
    assert [t.get_text() for t in width.get_xticklabels()] == ["[16]", "[32, 16]"]
    assert width.collections[0].get_offsets().tolist() == [[len(p["model.hidden_sizes"]) - 1, loss]
                                                           for p, loss in points]


def test_bench_plot_path_is_checked_before_any_rank_starts(tmp_path, capsys) -> None:
    code, err = _error_of(capsys, "bench", "allreduce", "--plot", str(tmp_path / "missing" / "bw.png"))
    assert code == 2 and f"no such directory {tmp_path / 'missing'}" in err
    code, err = _error_of(capsys, "bench", "allreduce", "--plot", str(tmp_path / "bw.svg"))
    assert code == 2 and "expected a .png file name" in err


@pytest.mark.slow
def test_bench_allreduce_plot_has_a_line_per_implementation(tmp_path) -> None:
    plot = tmp_path / "bw.png"
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "allreduce", "-n", "2", "--launcher", "local",
         "--sizes", "1K,64K", "--codecs", "none,int8", "--iters", "1", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {plot}" in done.stderr
    _assert_png(plot)
    rows = [json.loads(line) for line in done.stdout.splitlines()]  # --json output stays JSON
    (ax,) = bandwidth_figure(rows).axes
    lines = {line.get_label(): line for line in ax.lines}
    assert set(lines) == {"torch.distributed (gloo)", "ring none (torch transport)", "ring int8 (torch transport)"}
    for label, line in lines.items():
        codec = label.split()[1] if label.startswith("ring") else "none"
        impl = "ring" if label.startswith("ring") else "torch"
        mine = [r for r in rows if r["impl"] == impl and r["codec"] == codec]
        assert list(line.get_xdata()) == [1024, 65536]
        assert list(line.get_ydata()) == [r["busbw_GBps"] for r in mine]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


@pytest.mark.slow
def test_report_of_a_real_two_rank_run(tmp_path, capsys) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "run", "-n", "2", "--launcher", "local", "jobs/examples/mlp.toml",
         "--set", "train.steps=30", "--set", f"job.run_dir={runs}", "--set", "train.log_every=100"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    run = runs / "mlp-digits"
    assert main(["report", str(run)]) == 0
    out = run / "report"
    for name in ("loss.png", "throughput.png"):
        _assert_png(out / name)
    assert (out / "time_breakdown.png").exists() == (run / "ranks").is_dir()
    page = (out / "report.html").read_text()
    result = json.loads((run / "result.json").read_text())
    assert f"{result['final_loss']:.6g}" in page and "samples/s" in page
    assert len(_inlined_images(page)) == len(list(out.glob("*.png")))

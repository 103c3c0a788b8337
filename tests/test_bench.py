import json
import subprocess
import sys

import pytest

from hpc.text import human_size, parse_size
from jobs.bench.allreduce import COLUMNS, format_table


@pytest.mark.parametrize(("text", "value"), [("1K", 1024), ("64M", 64 << 20), ("4096", 4096), ("1g", 1 << 30)])
def test_parse_size(text, value) -> None:
    assert parse_size(text) == value
    assert parse_size(human_size(value)) == value


@pytest.mark.parametrize("text", ["", "0", "12Q", "-1K"])
def test_parse_size_rejects(text) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.slow
def test_bench_allreduce_json_rows() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "allreduce", "-n", "2", "--launcher", "local",
         "--sizes", "1K,64K", "--codecs", "none,int8", "--iters", "2", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["bytes"], r["impl"], r["codec"]) for r in rows] == [
        (1024, "torch", "none"), (1024, "ring", "none"), (1024, "ring", "int8"),
        (65536, "torch", "none"), (65536, "ring", "none"), (65536, "ring", "int8"),
    ]
    for r in rows:
        assert set(COLUMNS) <= set(r) and r["ranks"] == 2 and r["time_s"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n = 1 for n = 2
        assert r["max_rel_error"] < (1e-6 if r["codec"] == "none" else 1e-2)
    assert "max_rel_err" in format_table(rows).splitlines()[0]


@pytest.mark.slow
def test_bench_reduce_scatter_json_rows() -> None:
    """``--op reduce-scatter``: ZeRO's exchange, each rank's chunk checked against the exact sum (torch's chunk r,
    the ring's r + 1); busbw (n-1)/n of algbw; codecs without a reduce-scatter left out."""
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "allreduce", "-n", "2", "--launcher", "local",
         "--sizes", "64K", "--codecs", "none,int8,topk", "--iters", "2", "--op", "reduce-scatter", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["op"], r["impl"], r["codec"]) for r in rows] == [
        ("reduce-scatter", "torch", "none"), ("reduce-scatter", "ring", "none"), ("reduce-scatter", "ring", "int8")]
    for r in rows:
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] / 2)
        assert r["max_rel_error"] < (1e-6 if r["codec"] == "none" else 1e-2)


def test_bench_rejects_unknown_codec(capsys) -> None:
    from hpc.cli.main import main

    assert main(["bench", "allreduce", "--codecs", "none,int4"]) == 2
    assert "--codecs: unknown int4" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_memory_zero_shards_per_rank() -> None:
    """dp = 2: ZeRO-1 halves the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the parameters too
    (whole-parameter shards: within 5%)."""
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "memory", "-n", "2", "--launcher", "local",
         "--impls", "ours", "--steps", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["zero"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert sorted(rows) == [0, 1, 2, 3]
    for r in rows.values():
        assert {"impl", "zero", "dp", "param_bytes", "grad_bytes", "optim_bytes", "peak_bytes", "step_s"} <= set(r)
        assert r["dp"] == 2 and r["impl"] == "ours" and r["step_s"] > 0
    assert rows[1]["param_bytes"] == rows[2]["param_bytes"] == rows[0]["param_bytes"]
    assert rows[3]["param_bytes"] == pytest.approx(rows[0]["param_bytes"] / 2, rel=0.05)
    assert rows[1]["optim_bytes"] == pytest.approx(rows[0]["optim_bytes"] / 2, rel=0.05)
    assert rows[1]["grad_bytes"] == rows[0]["grad_bytes"]
    for zero in (2, 3):
        assert rows[zero]["optim_bytes"] == pytest.approx(rows[0]["optim_bytes"] / 2, rel=0.05)
        assert rows[zero]["grad_bytes"] == pytest.approx(rows[0]["grad_bytes"] / 2, rel=0.05)


def _bench_train(*options: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "train", "-n", "2", "--launcher", "local", "--json",
         *options],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.slow
def test_bench_train_steps_ours_and_ddp_to_the_same_loss() -> None:
    rows = {r["impl"]: r for r in _bench_train("--codecs", "none,fp16", "--ddp", "ddp,ddp-fp16", "--steps", "2",
                                               "--warmup", "1", "--rounds", "1")}
    assert sorted(rows) == ["ddp", "ddp-fp16", "ours-torch-fp16", "ours-torch-none"]
    assert rows["ours-torch-none"]["loss"] == pytest.approx(rows["ddp"]["loss"], abs=1e-5)
    assert rows["ours-torch-fp16"]["loss"] == pytest.approx(rows["ddp"]["loss"], rel=1e-3)
    for r in rows.values():
        assert r["steps_per_s"] > 0 and r["weak_scaling"] == pytest.approx(r["steps_per_s"] / r["single_steps_per_s"])
        assert r["vs_reference"] == pytest.approx(r["steps_per_s"] / rows["ddp"]["steps_per_s"])


@pytest.mark.slow
def test_bench_train_time_to_loss_curves_stop_at_the_target_unless_full(tmp_path) -> None:
    options = ("--codecs", "none", "--ddp", "ddp", "--width", "32", "--batch", "2", "--eval-every", "2",
               "--max-steps", "4")
    reached = _bench_train(*options, "--target-loss", "100", "--plot", str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0
    for r in reached:  # any loss is under 100: at the target from the start, each row stops at its first evaluation
        assert [step for _, step, _ in r["curve"]] == [0, 2] and r["time_to_loss_s"] == 0.0
    full = {r["impl"]: r for r in _bench_train(*options, "--target-loss", "100", "--full")}
    for r in full.values():
        assert [step for _, step, _ in r["curve"]] == [0, 2, 4] and r["curve"][2][0] > r["curve"][1][0] > 0
    assert full["ours-torch-none"]["final_loss"] == pytest.approx(full["ddp"]["final_loss"], abs=1e-5)


@pytest.mark.parametrize(("argv", "message"), [
    (["--ddp", "ddp,ddp-int4"], "--ddp: unknown ddp-int4"),
    (["--full"], "--full is for time to loss"),
    (["--target-loss", "2", "--batch", "0"], "--batch must be positive"),
    (["--transports", "nccl"], "--transports: unknown nccl"),
])
def test_bench_train_rejects_bad_options(argv, message, capsys) -> None:
    from hpc.cli.main import main

    assert main(["bench", "train", "--launcher", "local", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_gpu_reads_a_run_of_ours_into_one_row(tmp_path) -> None:
    """``make bench-gpu``'s row of our trainer, from a CPU run of the MLP: what a GPU session must not find
    broken (only its device figures, MFU and peak memory, are the GPU's)."""
    from pathlib import Path

    from jobs.bench.gpu import WARMUP_STEPS, _ours

    spec = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "mlp.toml"
    for _ in range(2):  # a rerun into the same --out measures afresh: no resume, no steps of the first run
        row = _ours("mlp on the cpu", tmp_path, ["parallel.tp=1", "parallel.pp=1"], WARMUP_STEPS + 3, spec=spec)
        assert "error" not in row, row
        assert row["loop"] == "mlp on the cpu" and row["step_s"] > 0 and row["samples_per_s"] > 0
        assert row["mfu"] is None and "summary: 6 steps" in row["summary"], row["summary"]
        (metrics,) = (tmp_path / "mlp-on-the-cpu").glob("*/metrics.jsonl")
        assert len(metrics.read_text().splitlines()) == WARMUP_STEPS + 3


def test_bench_gpu_records_a_row_out_of_time_and_goes_on() -> None:
    from jobs.bench.gpu import _run

    done = _run(["-c", "import time; time.sleep(60)"], timeout_s=1)
    assert done.returncode != 0 and done.stderr.splitlines()[-1] == "out of time: stopped after 1 s"


def test_bench_gpu_weighs_its_rows_against_the_issues_bars() -> None:
    """Rows as make bench-gpu keeps them, repeated runs among them and a failed one: medians and the ratio's range
    over the runs (ours' slowest over their fastest, ours' fastest over their slowest), a bar with a side missing
    not measured."""
    from jobs.bench.gpu import verdicts

    codecs = "\n".join(json.dumps({"bytes": size, "codec": codec, "vs_copy": ratio}) for size, codec, ratio in [
        (64 << 20, "int8", 0.384), (256 << 20, "copy", 1.0), (256 << 20, "int8", 0.602), (256 << 20, "fp16", 0.562),
        (256 << 20, "bf16", 0.563)])
    checkpoint = "rank 0 said something\n" + json.dumps({"impl": "hdf5-async", "op": "save", "stall_of_memcpy": 1.07})

    def run(loop: str, rate: float, memory: float = 40e9, loss: float = 5.0) -> dict:
        return {"loop": loop, "tokens_per_s": rate, "peak_memory_bytes": memory, "loss_tail": loss}

    rows = [run("ours eager", 72000), run("plain eager", 70000), run("ours eager", 73000), run("plain eager", 71500),
            run("ours eager", 71000), run("plain eager", 70500),
            run("ours compiled", 100000), {"loop": "torchtitan compiled", "error": ["out of time"]},
            run("ours compiled", 102000), run("torchtitan compiled", 98000),
            run("3b bf16 compiled", 20000, 90e9, 5.0), run("3b float8 rowwise compiled", 26000, 85e9, 5.03),
            run("128k recompute", 60000, 30e9), run("128k recompute fused", 61000, 21e9),
            run("recompute full compiled", 80000, 15e9), run("recompute selective compiled", 90000, 20e9),
            {"loop": "codecs", "output": codecs}, {"loop": "checkpoint", "output": checkpoint}]
    assert verdicts(rows) == [
        "eager tokens/s, ours over the expert's plain loop: 1.021x (runs 3/3: 0.993-1.043) (bar >= 1.0x) met",
        "compiled tokens/s, ours over torchtitan's: 1.031x (runs 2/1: 1.020-1.041) (bar >= 1.05x) NOT met",
        "3B tokens/s, Float8 tensorwise over bf16: not measured",
        "3B tokens/s, Float8 rowwise over bf16: 1.300x (runs 1/1: 1.300-1.300) (bar >= 1.25x) met",
        "3b float8 rowwise compiled: loss of the last 5 steps, its distance from bf16's (5.0300 / 5.0000): 1.006x "
        "(bar <= 1.01x) met",
        "selective recompute over full: tokens/s 1.125x, peak memory 1.333x",
        "selective recompute over none: tokens/s 0.891x, peak memory 0.500x",
        "128k recompute: peak memory, fused head loss over unfused: 0.700x (bar <= 0.75x) met",
        "128k recompute: tokens/s, fused head loss over unfused: 1.017x (runs 1/1: 1.017-1.017) (bar >= 1.0x) met",
        "128k: tokens/s, fused head loss over unfused: not measured",
        "int8 encode + decode over the device copy: 0.602x (bar >= 0.5x) met",
        "fp16 encode + decode over the device copy: 0.562x (bar >= 0.6x) NOT met",
        "bf16 encode + decode over the device copy: 0.563x (bar >= 0.6x) NOT met",
        "async checkpoint stall over the device-to-host copy: 1.070x (bar <= 1.3x) met",
    ]


def test_bench_gpu_keeps_the_top_of_a_profiled_row_s_ops_table(tmp_path) -> None:
    """The profile group's rows carry their rank 0's ops table (hpc/observe/profile.py's file), cut to the top."""
    from jobs.bench.gpu import PROFILE_LINES, profiled

    (tmp_path / "run" / "profile").mkdir(parents=True)
    (tmp_path / "run" / "profile" / "rank0.ops.txt").write_text("\n".join(f"line {i}" for i in range(100)))
    row = profiled({"loop": "ours"}, tmp_path)
    assert row["loop"] == "ours" and row["ops"] == [f"line {i}" for i in range(PROFILE_LINES)]
    assert profiled({"loop": "theirs", "error": ["failed"]}, tmp_path / "none")["ops"] is None

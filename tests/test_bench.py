import json
import subprocess
import sys

import pytest

from hpc.text import human_size, parse_size
from jobs.bench.allreduce import COLUMNS, format_table


@pytest.mark.parametrize(("text", "value"), [("1K", 1024), ("64M", 64 << 20), ("4096", 4096), ("1g", 1 << 30),
                                             ("12kb", 12 << 10), ("8589934591G", 8589934591 << 30)])
def test_parse_size(text, value) -> None:
    assert parse_size(text) == value
    assert parse_size(human_size(value)) == value


@pytest.mark.parametrize(("text", "message"), [
    ("", "'' is not a size like 1K, 64M or 4096"),
    ("0", "'0' is not a size like 1K, 64M or 4096"),
    ("lots", "'lots' is not a size like 1K, 64M or 4096"),
    ("12Q", "'12Q' is not a size like 1K, 64M or 4096: the units are K, M and G, not Q"),
    ("999999T", "'999999T' is not a size like 1K, 64M or 4096: the units are K, M and G, not T"),
    ("-1K", "'-1K' is negative: a size is a byte count like 1K, 64M or 4096"),
    ("8589934592G", "'8589934592G' is too large: a size is at most 2^63 - 1 bytes"),
])
def test_parse_size_rejects(text, message) -> None:
    """Each says what is wrong: an unknown unit, a negative or a too large number is named as such."""
    with pytest.raises(ValueError) as caught:
        parse_size(text)
    assert str(caught.value) == message


def test_ckpt_export_names_a_negative_max_shard_size(capsys, tmp_path) -> None:
    """Another caller of ``parse_size``: refused before the checkpoint is read, nothing written."""
    from hpc.cli.main import main

    argv = [str(tmp_path / "step"), "--to", str(tmp_path / "out"), "--format", "hf", "--max-shard-size", "-5"]
    assert main(["ckpt", "export", *argv]) == 2
    assert capsys.readouterr().err == ("hpc: error: --max-shard-size: '-5' is negative: a size is a byte count like "
                                       "1K, 64M or 4096\n")
    assert list(tmp_path.iterdir()) == []


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
    (["--target-loss", "2", "--batch", "0"], "--batch must be at least 1 (got 0)"),
    (["--transports", "nccl"], "--transports: unknown nccl"),
])
def test_bench_train_rejects_bad_options(argv, message, capsys) -> None:
    from hpc.cli.main import main

    assert main(["bench", "train", "--launcher", "local", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """The rank counts ``launch_for_rows`` was called with, none started: each launch returns no rows."""
    from hpc.runtime import launch

    started: list[int] = []

    def launch_for_rows(n: int, launcher: str, rank_argv, parent: str | None = None) -> list[dict]:
        started.append(n)
        return []

    monkeypatch.setattr(launch, "launch_for_rows", launch_for_rows)
    return started


def _refused(capsys, argv: list[str]) -> str:
    """``hpc bench ARGV``'s one error line, refused with exit 2."""
    from hpc.cli.main import main

    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    return captured.err.removeprefix("hpc: error: ").rstrip("\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["allreduce", "--iters", "0"], "--iters must be at least 1 (got 0)"),
    (["allreduce", "--iters", "-1"], "--iters must be at least 1 (got -1)"),
    (["allreduce", "-n", "0"], "-n must be at least 1 (got 0)"),
    (["allreduce", "-n", "-3"], "-n must be at least 1 (got -3)"),
    (["allreduce", "--scopes", "flat,bogus"], "--scopes: unknown bogus (valid: flat, inter-node)"),
    (["allreduce", "--sizes", "4,3"], "--sizes 3: the least is 4 bytes (one float32)"),
    (["allreduce", "--sizes", "3", "--op", "reduce-scatter", "-n", "2"],
     "--sizes 3: the least is 8 bytes (a float32 per rank, 2 ranks)"),
    (["allreduce", "--sizes", "12", "--op", "reduce-scatter", "-n", "4"],
     "--sizes 12: the least is 16 bytes (a float32 per rank, 4 ranks)"),
    (["allreduce", "--sizes", "999999T"],
     "--sizes: '999999T' is not a size like 1K, 64M or 4096: the units are K, M and G, not T"),
    (["allreduce", "--sizes", "8589934592G"], "--sizes: '8589934592G' is too large: a size is at most 2^63 - 1 bytes"),
    (["alltoall", "--iters", "0"], "--iters must be at least 1 (got 0)"),
    (["checkpoint", "-n", "0"], "-n must be at least 1 (got 0)"),
    (["train", "--target-loss", "5", "--width", "7"], "--width must be a multiple of the GPT's 4 heads (got 7)"),
    (["train", "--target-loss", "5", "--layers", "0"], "--layers must be at least 1 (got 0)"),
    (["train", "--target-loss", "0"], "--target-loss must be positive (got 0.0)"),
    (["train", "--scopes", "bogus"], "--scopes: unknown bogus (valid: flat, inter-node)"),
    (["train", "--width", "0"], "--width is for time to loss: it needs --target-loss"),
    (["train", "--layers", "0"], "--layers is for time to loss: it needs --target-loss"),
    (["train", "--batch", "0"], "--batch is for time to loss: it needs --target-loss"),
    (["train", "--width", "64"], "--width is for time to loss: it needs --target-loss"),
    (["train", "--rounds", "0"], "--rounds must be at least 1 (got 0)"),
    (["memory", "--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["memory", "--zero", "0,4"], "--zero: unknown 4 (valid: 0, 1, 2, 3)"),
])
def test_bench_refuses_bad_options_before_any_rank(argv, message, launches, capsys, tmp_path, monkeypatch) -> None:
    """One line naming the option that is wrong and its value, exit 2, no rank started, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert _refused(capsys, [*argv, "--launcher", "local"]) == message
    assert launches == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["allreduce", "-n", "1", "--iters", "1", "--sizes", "4", "--scopes", "flat,inter-node"],
    ["allreduce", "-n", "4", "--sizes", "16", "--op", "reduce-scatter"],
    ["train", "--scopes", "flat,inter-node", "--rounds", "1", "--warmup", "0"],
    ["train", "--target-loss", "5", "--width", "8", "--layers", "1", "--batch", "1"],
    ["memory", "--steps", "1", "--zero", "0,3", "-n", "2"],
])
def test_bench_lets_the_least_good_options_through(argv, launches, capsys) -> None:
    """Next to each refusal: the smallest values that are right reach the launch."""
    from hpc.cli.main import main

    assert main(["bench", *argv, "--launcher", "local", "--json"]) == 0, capsys.readouterr().err
    assert len(launches) == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "3", "--codecs", "fp16"], "--sizes 3: the least is 4 bytes (one float32)"),
    (["--sizes", "32"], "--sizes 32: the least is 64 bytes (powersgd's 4x4 float32 matrix)"),
    (["--iters", "0"], "--iters must be at least 1 (got 0)"),
    (["--warmup", "-1"], "--warmup must be at least 0 (got -1)"),
    (["--codecs", "fp16,none"], "--codecs: unknown none (valid: fp16, bf16, int8, topk, powersgd)"),
    (["--device", "cuda"], "--device cuda: no CUDA GPU here"),
])
def test_bench_codecs_refuses_bad_options(argv, message, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _refused(capsys, ["codecs", *argv]) == message


@pytest.mark.parametrize("argv", [["--sizes", "64"], ["--sizes", "4", "--codecs", "fp16,bf16,int8,topk"]])
def test_bench_codecs_measures_its_least_sizes(argv, capsys) -> None:
    from hpc.cli.main import main

    assert main(["bench", "codecs", *argv, "--iters", "1", "--warmup", "0", "--device", "cpu", "--json"]) == 0
    assert all(json.loads(line)["bytes"] == int(argv[1]) for line in capsys.readouterr().out.splitlines())


def test_bench_checkpoint_refuses_a_dir_it_cannot_make_and_leaves_nothing(launches, capsys, tmp_path,
                                                                           monkeypatch) -> None:
    import errno
    import os
    from pathlib import Path

    import torch

    def refused(directory: Path, *argv: str) -> str:
        return _refused(capsys, ["checkpoint", "--dir", str(directory), *argv, "--launcher", "local"])

    (tmp_path / "file").write_text("")
    assert refused(tmp_path / "file") == f"--dir {tmp_path / 'file'}: it is not a directory"
    assert refused(tmp_path / "file" / "sub") == f"--dir {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is not a " \
                                                 "directory"
    mkdir = Path.mkdir

    def full_disk(path: Path) -> None:
        if path.name == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        mkdir(path)

    monkeypatch.setattr(Path, "mkdir", full_disk)
    assert refused(tmp_path / "new" / "full" / "sub") == f"--dir {tmp_path / 'new' / 'full' / 'sub'}: cannot " \
                                                         f"create {tmp_path / 'new' / 'full'}: No space left on device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert refused(tmp_path / "new", "--device", "cuda") == "--device cuda: no CUDA GPU here"
    assert launches == [] and [p.name for p in tmp_path.iterdir()] == ["file"]


def test_bench_checkpoint_removes_the_dirs_it_made_after_the_run(capsys, tmp_path, monkeypatch) -> None:
    """Each run deletes its files; the --dir made for them goes too, passed or failed, and one there before stays."""
    import os

    from hpc.cli.main import main
    from hpc.errors import HpcError
    from hpc.runtime import launch

    def launch_for_rows(n: int, launcher: str, rank_argv, parent: str | None = None) -> list[dict]:
        assert os.path.isdir(parent)
        if parent.endswith("fails"):
            raise HpcError("rank 0 failed")
        return []

    monkeypatch.setattr(launch, "launch_for_rows", launch_for_rows)
    (tmp_path / "there").mkdir()
    codes = [main(["bench", "checkpoint", "--dir", str(directory), "--launcher", "local", "--device", "cpu", "--json"])
             for directory in (tmp_path / "made" / "ok", tmp_path / "made" / "fails", tmp_path / "there")]
    assert codes == [0, 2, 0]
    assert capsys.readouterr().err == "hpc: error: rank 0 failed\n"
    assert [p.name for p in tmp_path.iterdir()] == ["there"]


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

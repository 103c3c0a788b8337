"""``make bench-gpu``: our trainer on one GPU beside what a user would run instead, from one run.

Each row is a fresh process (the GPU's memory and compile caches start empty):

- the 0.72B Llama of ``jobs/bench/llama_bench.toml`` through ``hpc run -n 1``, eager and with
  ``train.compile = true``, against the hand-written transformers loop (``jobs/bench/plain_llama.py``:
  torch's default AdamW, its fused AdamW, and compiled): tokens/s, model TFLOP/s, MFU, peak memory;
- the ring's codecs against a device-to-device copy (``hpc bench codecs``);
- the asynchronous checkpoint's stall against the device-to-host copy (``hpc bench checkpoint``);
- a data-parallel step of 2 ranks sharing the GPU over Gloo against 1 rank, the GPT example.

It installs nothing (the GPU machine has no network): run from the checkout with ``PYTHONPATH``.
Every row is appended to ``--out``/rows.jsonl as it finishes, so a run cut short keeps what it measured;
the last lines weigh the rows against the bars of issue 29 (``verdicts``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpc.runtime.launch import stop_process_groups

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "jobs" / "bench" / "llama_bench.toml"
GPT = REPO / "jobs" / "examples" / "gpt.toml"
WARMUP_STEPS = 3  # left out of every median: allocation, autotuning, compilation


def _run(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess:
    """A row's process, in a session of its own: past ``timeout_s`` its whole group goes (``hpc run``'s ranks run
    in sessions of their own too, so ``hpc``'s launcher stops them as it dies), and the row records the timeout
    instead of ending the bench."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_groups([child])
            stdout, stderr = child.communicate()
            stderr += f"\nout of time: stopped after {timeout_s:g} s"
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def ours(name: str, out: Path, overrides: Sequence[str], steps: int, ranks: int = 1, spec: Path = SPEC) -> dict:
    """``hpc run`` of a spec; the median step of its metrics after the warm-up, its peak memory and MFU."""
    run_dir = out / name.replace(" ", "-")
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: a rerun's medians must be its own steps
    sets = [arg for item in (f"job.run_dir={run_dir}", f"train.steps={steps}", *overrides) for arg in ("--set", item)]
    done = _run(["-m", "hpc.cli.main", "run", "-n", str(ranks), "--launcher", "local", str(spec), *sets], 900)
    if done.returncode:
        return {"loop": name, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    (result_file,) = run_dir.glob("*/result.json")
    records = [json.loads(line) for line in result_file.with_name("metrics.jsonl").open()]
    step_s = statistics.median(r["step_time_s"] for r in records[WARMUP_STEPS:])
    unit = next(key for key in records[0] if key.endswith("_per_s"))
    rate = statistics.median(r[unit] for r in records[WARMUP_STEPS:])
    mfu = statistics.median(r["mfu"] for r in records[WARMUP_STEPS:]) if records[0].get("mfu") else None
    result = json.loads(result_file.read_text())
    return {"loop": name, "step_s": step_s, unit: rate, "mfu": mfu, "loss": records[-1]["loss"],
            "peak_memory_bytes": result.get("peak_memory_bytes"), "summary": done.stdout.strip().splitlines()[-1]}


def plain(name: str, options: Sequence[str], steps: int) -> dict:
    done = _run(["-m", "jobs.bench.plain_llama", "--steps", str(steps), "--warmup", str(WARMUP_STEPS), *options], 900)
    if done.returncode:
        return {"loop": name, "error": done.stderr.strip().splitlines()[-3:]}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "loop": name}


def bench_output(name: str, argv: Sequence[str]) -> dict:
    """A ``hpc bench`` command's printed table, kept as it printed."""
    done = _run(["-m", "hpc.cli.main", "bench", *argv], 600)
    return {"loop": name, "returncode": done.returncode, "output": (done.stdout + done.stderr).strip()[-20000:]}


def rows(out: Path, steps: int, only: set[str]) -> list[tuple[str, callable]]:
    """(group, thunk) in the order they run: the issue's bars first, the quick ones before the compiled rows,
    whose compilation takes minutes (a run cut short keeps what ran)."""
    dp = ["parallel.tp=1", "parallel.pp=1", "checkpoint.every_steps=0", "parallel.microbatches=1"]
    shared = [*dp, "parallel.backend=gloo", "parallel.device=cuda"]
    table = [
        ("llama", lambda: ours("ours eager", out, [], steps)),
        ("llama", lambda: plain("plain eager AdamW", [], steps)),
        ("llama", lambda: plain("plain eager fused AdamW", ["--fused"], steps)),
        ("codecs", lambda: bench_output("codecs", ["codecs", "--json"])),
        ("checkpoint", lambda: bench_output("checkpoint", ["checkpoint", "-n", "1", "--size", "512M", "--iters", "3",
                                                           "--json", "--launcher", "local", "--device", "cuda",
                                                           "--dir", str(out / "checkpoint")])),
        ("compiled", lambda: ours("ours compiled", out, ["train.compile=true"], steps)),
        ("compiled", lambda: plain("plain compiled fused AdamW", ["--compile", "--fused"], steps)),
        ("dp", lambda: ours("gpt 1 rank cuda", out, [*shared], 30, 1, GPT)),
        ("dp", lambda: ours("gpt dp=2 sharing the gpu", out, [*shared], 30, 2, GPT)),
    ]
    return [(group, thunk) for group, thunk in table if not only or group in only]


def _json_lines(row: dict | None) -> list[dict]:
    """The JSON rows a ``hpc bench ... --json`` printed (its row's kept output)."""
    rows = []
    for line in (row or {}).get("output", "").splitlines():
        with contextlib.suppress(ValueError):  # a line of the rank's log, or one cut by the kept length
            rows.append(json.loads(line))
    return [row for row in rows if isinstance(row, dict)]


def _bar(name: str, ratio: float | None, bar: float, at_most: bool = False) -> str:
    if ratio is None:
        return f"{name}: not measured"
    met = ratio <= bar if at_most else ratio >= bar
    return f"{name}: {ratio:.3f}x (bar {'<=' if at_most else '>='} {bar}x) {'met' if met else 'NOT met'}"


def verdicts(rows: Sequence[dict]) -> list[str]:
    """Issue 29's bars from one run's rows: ours against the better eager loop (tokens/s and peak memory), the
    compiled loops, each codec against the copy at the largest size, the async checkpoint's stall."""
    by = {row["loop"]: row for row in rows if "error" not in row}
    rate = lambda name: by[name]["tokens_per_s"] if name in by else None  # noqa: E731
    plain = [by[name] for name in ("plain eager AdamW", "plain eager fused AdamW") if name in by]
    best = max(plain, key=lambda row: row["tokens_per_s"]) if plain else None
    ours = by.get("ours eager")
    lines = [
        _bar("eager tokens/s, ours over the better plain loop",
             ours["tokens_per_s"] / best["tokens_per_s"] if ours and best else None, 1.0),
        _bar("eager peak memory, ours over that loop's",
             ours["peak_memory_bytes"] / best["peak_memory_bytes"] if ours and best else None, 1.1, at_most=True),
        _bar("compiled tokens/s, ours over the compiled plain loop",
             rate("ours compiled") / rate("plain compiled fused AdamW")
             if rate("ours compiled") and rate("plain compiled fused AdamW") else None, 1.0),
    ]
    codecs = _json_lines(by.get("codecs"))
    largest = max((row["bytes"] for row in codecs), default=None)
    for codec, bar in (("int8", 0.5), ("fp16", 0.6), ("bf16", 0.6)):
        ratio = next((row["vs_copy"] for row in codecs if row["codec"] == codec and row["bytes"] == largest), None)
        lines.append(_bar(f"{codec} encode + decode over the device copy", ratio, bar))
    stall = next((row["stall_of_memcpy"] for row in _json_lines(by.get("checkpoint"))
                  if row["impl"] == "hdf5-async" and row["op"] == "save"), None)
    lines.append(_bar("async checkpoint stall over the device-to-host copy", stall, 1.3, at_most=True))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-gpu", help="rows.jsonl and the runs' directories")
    # 20: a median over 17 steps for 5 s more a row (a step is about 0.23 s eager): the bars sit near 1.0x
    parser.add_argument("--steps", type=int, default=20, help="steps of each Llama run (3 warm-up)")
    parser.add_argument("--only", default="", help="comma list of llama, codecs, checkpoint, dp, compiled")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    done = []
    with (out / "rows.jsonl").open("a") as log:
        for _, thunk in rows(out, args.steps, set(filter(None, args.only.split(",")))):
            started = time.perf_counter()
            row = {**thunk(), "wall_s": round(time.perf_counter() - started, 1)}
            done.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
        lines = verdicts(done)
        log.write(json.dumps({"verdicts": lines}) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

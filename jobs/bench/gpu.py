"""``make bench-gpu``: our trainer on one GPU beside what a user would run instead, from one run.

Each row is a fresh process (the GPU's memory and compile caches start empty), and the rows a verdict weighs
run ``--repeat`` times, interleaved (ours, theirs, ours, ...), their median and spread reported:

- the 0.72B Llama of ``jobs/bench/llama_bench.toml`` through ``hpc run -n 1`` against the expert's transformers
  loop (``jobs/bench/plain_llama.py``), eager; compiled (``train.compile``) against torchtitan's model, per-block
  compile and loss in that loop (``jobs/bench/titan_llama.py``), and torchtitan eager once;
- the fused head loss (``train.fused_head_loss``) at Llama 3's vocabulary of 128,256 on that body, with and
  without recomputed blocks: peak memory and tokens/s against our unfused loss;
- Float8 (``train.float8``, rowwise and tensorwise) against bf16, compiled, on the 3.2B Llama of
  ``jobs/bench/llama3b_bench.toml``, and its loss against bf16's over the 0.72B's first 200 steps;
- selective recompute (``train.recompute``) against full and none, compiled;
- with ``--only profile``: ours compiled, torchtitan compiled and the 3.2B in Float8 under torch.profiler, the top of
  each one's ops by device time in its row (``train.profile_steps``; the peers' ``--profile``);
- with ``--only``: the ring's codecs against a device-to-device copy (``hpc bench codecs``), the asynchronous
  checkpoint's stall against the device-to-host copy (``hpc bench checkpoint``), a data-parallel step of 2 ranks
  sharing the GPU over Gloo against 1 rank (the GPT example).

It installs nothing (the GPU machine has no network): run from the checkout with ``PYTHONPATH`` holding the
peers' packages (``make bench-gpu-deps``). Every row is appended to ``--out``/rows.jsonl as it finishes, and a
row that would start past ``--budget-s`` is skipped, so a run cut short keeps what it measured; the last lines
weigh the rows against the bars of issues 29 and 44 (``verdicts``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
ROW_TIMEOUT_S = 900.0  # one row's process at most (--row-timeout-s)


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


SPEC_3B = REPO / "jobs" / "bench" / "llama3b_bench.toml"
VOCAB_128K = ["model.args.vocab_size=128256", "model.args.tie_word_embeddings=true"]  # Llama 3's tokenizer
LOSS_TAIL = 5  # the steps whose mean loss compares two runs of the same data (Float8 against bf16)
PROFILED, PROFILE_LINES = 3, 30  # the profile group's steps, and the ops table's lines a row keeps
LOSS_STEPS = 200  # issue 44: Float8's loss within 1% of bf16's over the bench model's first 200 steps
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # tensorwise first: the faster in torchao's tables
FLOAT8_LOSS_RECIPE = "tensorwise"  # the faster recipe in torchao's tables: the one a speed bar needs
# the order a default run takes: the open bars first (session 22: compiled 0.1% short, Float8's speed and loss,
# the fused head loss), then what the last leases measured
DEFAULT_GROUPS = ("compiled", "float8", "float8-loss", "head-loss", "eager", "selective", "head-loss-kept", "profile",
                  "titan-eager")


def _ours(name: str, out: Path, overrides: Sequence[str], steps: int, ranks: int = 1, spec: Path = SPEC,
         timeout_s: float = ROW_TIMEOUT_S) -> dict:
    """``hpc run`` of a spec; the median step of its metrics after the warm-up, its peak memory and MFU."""
    run_dir = out / name.replace(" ", "-")
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: a rerun's medians must be its own steps
    sets = [arg for item in (f"job.run_dir={run_dir}", f"train.steps={steps}", *overrides) for arg in ("--set", item)]
    done = _run(["-m", "hpc.cli.main", "run", "-n", str(ranks), "--launcher", "local", str(spec), *sets],
                timeout_s)
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
            "loss_tail": statistics.fmean(r["loss"] for r in records[-LOSS_TAIL:]),
            "peak_memory_bytes": result.get("peak_memory_bytes"), "summary": done.stdout.strip().splitlines()[-1]}


def _peer(name: str, module: str, options: Sequence[str], steps: int, timeout_s: float = ROW_TIMEOUT_S) -> dict:
    """A peer's loop (``jobs.bench.plain_llama``, ``jobs.bench.titan_llama``): its one JSON line."""
    done = _run(["-m", module, "--steps", str(steps), "--warmup", str(WARMUP_STEPS), *options], timeout_s)
    if done.returncode:
        return {"loop": name, "error": done.stderr.strip().splitlines()[-3:]}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "loop": name}


def bench_output(name: str, argv: Sequence[str]) -> dict:
    """A ``hpc bench`` command's printed table, kept as it printed."""
    done = _run(["-m", "hpc.cli.main", "bench", *argv], 600)
    return {"loop": name, "returncode": done.returncode, "output": (done.stdout + done.stderr).strip()[-20000:]}


def _interleaved(repeat: int, *rows: tuple[str, callable]) -> list[tuple[str, callable]]:
    return [row for _ in range(repeat) for row in rows]


def rows(out: Path, steps: int, repeat: int, only: Sequence[str], timeout_s: float = ROW_TIMEOUT_S,
         ) -> list[tuple[str, callable]]:
    """(group, thunk) in the order they run: the groups in ``only``'s order (default ``DEFAULT_GROUPS``: the
    issues' bars first), each group's rows interleaved ``repeat`` times where a bar weighs them."""
    ours = functools.partial(_ours, timeout_s=timeout_s)
    peer = functools.partial(_peer, timeout_s=timeout_s)
    dp = ["parallel.tp=1", "parallel.pp=1", "checkpoint.every_steps=0", "parallel.microbatches=1"]
    shared = [*dp, "parallel.backend=gloo", "parallel.device=cuda"]
    compiled = ["train.compile=true"]
    recompute = ["train.activation_checkpointing=true"]
    fused = ["train.fused_head_loss=true"]
    table = [
        *_interleaved(repeat, ("eager", lambda: ours("ours eager", out, [], steps)),
                      ("eager", lambda: peer("plain eager", "jobs.bench.plain_llama", [], steps))),
        *_interleaved(repeat, ("compiled", lambda: ours("ours compiled", out, compiled, steps)),
                      ("compiled", lambda: peer("torchtitan compiled", "jobs.bench.titan_llama", ["--compile"],
                                                steps))),
        ("float8", lambda: ours("3b bf16 compiled", out, compiled, steps, spec=SPEC_3B)),
        *[("float8", functools.partial(ours, f"3b float8 {recipe} compiled", out,
                                       [*compiled, f"train.float8={recipe}"], steps, spec=SPEC_3B))
          for recipe in FLOAT8_RECIPES],
        ("float8-loss", lambda: ours("bf16 200 steps", out, compiled, LOSS_STEPS)),
        ("float8-loss", lambda: ours(f"float8 {FLOAT8_LOSS_RECIPE} 200 steps", out,
                                     [*compiled, f"train.float8={FLOAT8_LOSS_RECIPE}"], LOSS_STEPS)),
        ("selective", lambda: ours("recompute full compiled", out, [*compiled, *recompute], steps)),
        ("selective", lambda: ours("recompute selective compiled", out,
                                   [*compiled, *recompute, "train.recompute=selective"], steps)),
        ("head-loss", lambda: ours("128k recompute", out, [*VOCAB_128K, *compiled, *recompute], steps)),
        ("head-loss", lambda: ours("128k recompute fused", out, [*VOCAB_128K, *compiled, *recompute, *fused], steps)),
        ("head-loss-kept", lambda: ours("128k", out, [*VOCAB_128K, *compiled], steps)),
        ("head-loss-kept", lambda: ours("128k fused", out, [*VOCAB_128K, *compiled, *fused], steps)),
        ("titan-eager", lambda: peer("torchtitan eager", "jobs.bench.titan_llama", [], steps)),
        ("profile", lambda: profiled(ours("ours compiled profiled", out, [*compiled, f"train.profile_steps={PROFILED}"],
                                          steps), out / "ours-compiled-profiled")),
        ("profile", lambda: profiled(peer("torchtitan compiled profiled", "jobs.bench.titan_llama",
                                          ["--compile", "--profile", str(PROFILED), "--profile-dir",
                                           str(out / "titan-profile")], steps), out / "titan-profile")),
        ("profile", lambda: profiled(ours("3b float8 tensorwise profiled", out,
                                          [*compiled, "train.float8=tensorwise", f"train.profile_steps={PROFILED}"],
                                          steps, spec=SPEC_3B), out / "3b-float8-tensorwise-profiled")),
        ("codecs", lambda: bench_output("codecs", ["codecs", "--json"])),
        ("checkpoint", lambda: bench_output("checkpoint", ["checkpoint", "-n", "1", "--size", "512M", "--iters", "3",
                                                           "--json", "--launcher", "local", "--device", "cuda",
                                                           "--dir", str(out / "checkpoint")])),
        ("dp", lambda: ours("gpt 1 rank cuda", out, [*shared], 30, 1, GPT)),
        ("dp", lambda: ours("gpt dp=2 sharing the gpu", out, [*shared], 30, 2, GPT)),
    ]
    order = only or DEFAULT_GROUPS
    return sorted(((group, thunk) for group, thunk in table if group in order),
                  key=lambda row: order.index(row[0]))  # stable: a group's rows keep their order


def profiled(row: dict, where: Path) -> dict:
    """A row with the top of its rank 0's ops table (torch.profiler, by device time) from under ``where``."""
    tables = sorted(where.glob("**/rank0.ops.txt"))
    return {**row, "ops": tables[0].read_text().splitlines()[:PROFILE_LINES] if tables else None}


def _json_lines(row: dict | None) -> list[dict]:
    """The JSON rows a ``hpc bench ... --json`` printed (its row's kept output)."""
    rows = []
    for line in (row or {}).get("output", "").splitlines():
        with contextlib.suppress(ValueError):  # a line of the rank's log, or one cut by the kept length
            rows.append(json.loads(line))
    return [row for row in rows if isinstance(row, dict)]


def _bar(name: str, ratio: float | None, bar: float, at_most: bool = False, spread: str = "") -> str:
    if ratio is None:
        return f"{name}: not measured"
    met = ratio <= bar if at_most else ratio >= bar
    return f"{name}: {ratio:.3f}x{spread} (bar {'<=' if at_most else '>='} {bar}x) {'met' if met else 'NOT met'}"


def spreads(rows: Sequence[dict]) -> dict[str, dict]:
    """Per loop: its runs' tokens/s (median, min, max, spread = (max - min) / median) and median peak memory."""
    by: dict[str, list[dict]] = {}
    for row in rows:
        if "error" not in row and "tokens_per_s" in row:
            by.setdefault(row["loop"], []).append(row)
    table = {}
    for loop, runs in by.items():
        rates = [run["tokens_per_s"] for run in runs]
        median = statistics.median(rates)
        table[loop] = {"runs": len(runs), "tokens_per_s": median, "min": min(rates), "max": max(rates),
                       "spread": (max(rates) - min(rates)) / median,
                       "peak_memory_bytes": statistics.median(run["peak_memory_bytes"] for run in runs),
                       "loss_tail": statistics.median(run.get("loss_tail", run.get("loss")) for run in runs)}
    return table


def verdicts(rows: Sequence[dict]) -> list[str]:
    """Issue 44's bars from one run's rows (medians of the repeated runs, with the ratio's range over the runs:
    ours' slowest over their fastest to ours' fastest over their slowest), then issue 29's codec and checkpoint
    bars where those rows ran."""
    table = spreads(rows)

    def ratio(ours: str, theirs: str, bar: float, title: str) -> str:
        if ours not in table or theirs not in table:
            return _bar(title, None, bar)
        a, b = table[ours], table[theirs]
        spread = f" (runs {a['runs']}/{b['runs']}: {a['min'] / b['max']:.3f}-{a['max'] / b['min']:.3f})"
        return _bar(title, a["tokens_per_s"] / b["tokens_per_s"], bar, spread=spread)

    lines = [ratio("ours eager", "plain eager", 1.0, "eager tokens/s, ours over the expert's plain loop"),
             ratio("ours compiled", "torchtitan compiled", 1.05, "compiled tokens/s, ours over torchtitan's"),
             *[ratio(f"3b float8 {recipe} compiled", "3b bf16 compiled", 1.25,
                     f"3B tokens/s, Float8 {recipe} over bf16") for recipe in FLOAT8_RECIPES]]
    for ours, theirs in ((f"float8 {FLOAT8_LOSS_RECIPE} 200 steps", "bf16 200 steps"),
                         *((f"3b float8 {recipe} compiled", "3b bf16 compiled") for recipe in FLOAT8_RECIPES)):
        if ours in table and theirs in table:
            low, high = table[ours]["loss_tail"], table[theirs]["loss_tail"]
            lines.append(_bar(f"{ours}: loss of the last {LOSS_TAIL} steps, its distance from bf16's "
                              f"({low:.4f} / {high:.4f})", 1 + abs(low / high - 1), 1.01, at_most=True))
    if "recompute selective compiled" in table and "recompute full compiled" in table:
        selective = table["recompute selective compiled"]
        for name, other in (("full", "recompute full compiled"), ("none", "ours compiled")):
            if other in table:
                lines.append(f"selective recompute over {name}: tokens/s "
                             f"{selective['tokens_per_s'] / table[other]['tokens_per_s']:.3f}x, peak memory "
                             f"{selective['peak_memory_bytes'] / table[other]['peak_memory_bytes']:.3f}x")
    for base in ("128k recompute", "128k"):
        fused = f"{base} fused"
        if base in table and fused in table:
            memory = table[fused]["peak_memory_bytes"] / table[base]["peak_memory_bytes"]
            lines.append(_bar(f"{base}: peak memory, fused head loss over unfused", memory, 0.75, at_most=True))
        lines.append(ratio(fused, base, 1.0, f"{base}: tokens/s, fused head loss over unfused"))
    by = {row["loop"]: row for row in rows if "error" not in row}
    codecs = _json_lines(by.get("codecs"))
    largest = max((row["bytes"] for row in codecs), default=None)
    for codec, bar in (("int8", 0.5), ("fp16", 0.6), ("bf16", 0.6)):
        if codecs:
            found = next((row["vs_copy"] for row in codecs if row["codec"] == codec and row["bytes"] == largest), None)
            lines.append(_bar(f"{codec} encode + decode over the device copy", found, bar))
    stall = next((row["stall_of_memcpy"] for row in _json_lines(by.get("checkpoint"))
                  if row["impl"] == "hdf5-async" and row["op"] == "save"), None)
    if by.get("checkpoint"):
        lines.append(_bar("async checkpoint stall over the device-to-host copy", stall, 1.3, at_most=True))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-gpu", help="rows.jsonl and the runs' directories")
    # 15: a median over 12 steps (a step is about 0.23 s eager, 0.16 s compiled); three runs give the spread
    parser.add_argument("--steps", type=int, default=15, help="steps of each Llama run (3 warm-up)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row a bar weighs, interleaved")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no row past this many seconds (the GPU lease's time)")
    parser.add_argument("--row-timeout-s", type=float, default=ROW_TIMEOUT_S, help="one row's process at most")
    parser.add_argument("--only", default="", help="comma list of groups, run in this order: "
                                                   f"{', '.join(DEFAULT_GROUPS)} (the default), codecs, checkpoint, dp")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    done, started_all = [], time.perf_counter()
    with (out / "rows.jsonl").open("a") as log:
        for group, thunk in rows(out, args.steps, args.repeat, tuple(filter(None, args.only.split(","))),
                                 args.row_timeout_s):
            if time.perf_counter() - started_all > args.budget_s:
                print(json.dumps({"skipped": group, "after_s": round(time.perf_counter() - started_all)}))
                continue
            started = time.perf_counter()
            row = {**thunk(), "group": group, "wall_s": round(time.perf_counter() - started, 1)}
            done.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
        lines = verdicts(done)
        log.write(json.dumps({"spreads": spreads(done), "verdicts": lines}) + "\n")
    print(json.dumps(spreads(done)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

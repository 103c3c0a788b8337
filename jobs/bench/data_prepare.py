"""``hpc data prepare`` against a plain loop of the same tokenizer's ``encode_batch`` on the same input, in one run.

    python -m jobs.bench.data_prepare --mb 200 --rounds 2

Writes a synthetic JSONL file of about ``--mb`` MB (documents of 1 to 12 license paragraphs drawn by a
seeded shuffle from ``/usr/share/common-licenses``) unless it is there, then alternates, ``--rounds`` times:

- ``prepare``: ``hpc data prepare --tokenizer T --out DIR FILE`` in its own process; wall time, and the
  peak resident memory of that process (``ru_maxrss`` from ``wait4``);
- ``encode_batch``: another process reads every document into memory first (untimed), cuts them into the
  same chunks (``jobs.data.prepare.CHUNK_CHARS`` characters), starts Rayon's threads with one untimed call,
  and times only the ``encode_batch`` calls, on every core; then ``encode_batch_fast`` (what ``prepare``
  calls, no character offsets) alike, and the plain loop with the reading and JSON parsing included.
  Each starts from a freshly loaded tokenizer, its BPE word cache empty, as ``prepare``'s process does.

Throughput is the JSONL file's bytes over the wall time; CPU s is the process's CPU time (every thread)
over the same span, which a busy machine disturbs less. Every ``prepare`` output is hashed: the rounds
must be byte-identical. Rows print as a table and, with ``--json``, as JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hpc.text import format_table
from jobs.data.datasets import license_files
from jobs.data.tokens import META, OFFSETS, TOKENS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_TOKENIZER = REPO / "jobs" / "examples" / "tokenizer.json"


def make_jsonl(path: Path, megabytes: float, seed: int = 0) -> None:
    """Documents of 1-12 license paragraphs, drawn by ``seed``, until the file holds ``megabytes`` MB."""
    paragraphs = [part.strip() for file in license_files() for part in file.read_text().split("\n\n") if part.strip()]
    rng, target, written = random.Random(seed), int(megabytes * 1e6), 0
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as handle:
        while written < target:
            doc = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 12)))
            written += handle.write(json.dumps({"id": written, "text": doc}) + "\n")
    os.replace(partial, path)


def run_prepare(jsonl: Path, tokenizer: Path, out: Path) -> dict[str, float | str]:
    """``hpc data prepare`` in its own process: wall seconds, peak RSS and the output's sha256."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "hpc.cli.main", "data", "prepare", "--tokenizer", str(tokenizer),
               "--out", str(out), str(jsonl)]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    output, errors = process.stdout.read().decode(), process.stderr.read().decode()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"hpc data prepare failed ({process.returncode}): {errors.strip()}")
    digest = hashlib.sha256()
    for name in (TOKENS, OFFSETS, META):
        digest.update((out / name).read_bytes())
    return {"impl": "hpc data prepare", "seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024,
            "sha256": digest.hexdigest()[:16], "output": output.strip()}


def baseline(jsonl: Path, tokenizer_path: Path) -> list[dict[str, float | str]]:
    """In this process: ``encode_batch`` and ``encode_batch_fast`` alone over documents read beforehand,
    then the plain loop that reads, parses and encodes chunk by chunk."""
    from tokenizers import Tokenizer

    from jobs.data.prepare import CHUNK_CHARS

    with open(jsonl, "rb") as handle:
        docs = [json.loads(line)["text"] for line in handle]
    chunks, chunk, chars = [], [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS:
            chunks.append(chunk)
            chunk, chars = [], 0
    chunks.append(chunk)
    del docs
    Tokenizer.from_file(str(tokenizer_path)).encode_batch(chunks[0], add_special_tokens=False)  # Rayon's threads up
    rows = []
    for name in ("encode_batch", "encode_batch_fast"):
        encode = getattr(Tokenizer.from_file(str(tokenizer_path)), name)  # fresh: its word cache empty, as prepare's
        start, cpu = time.perf_counter(), time.process_time()
        for chunk in chunks:
            encode(chunk, add_special_tokens=False)
        rows.append({"impl": f"{name} (documents in memory)", "seconds": time.perf_counter() - start,
                     "cpu_s": time.process_time() - cpu})
    del chunks
    cpu = time.process_time()
    loop = _plain_loop(jsonl, Tokenizer.from_file(str(tokenizer_path)), CHUNK_CHARS)
    rows.append({"impl": "read + json.loads + encode_batch", "seconds": loop, "cpu_s": time.process_time() - cpu})
    return rows


def _plain_loop(jsonl: Path, tokenizer, chunk_chars: int) -> float:
    start, chunk, chars = time.perf_counter(), [], 0
    with open(jsonl, "rb") as handle:
        for line in handle:
            chunk.append(json.loads(line)["text"])
            chars += len(chunk[-1])
            if chars >= chunk_chars:
                tokenizer.encode_batch(chunk, add_special_tokens=False)
                chunk, chars = [], 0
    tokenizer.encode_batch(chunk, add_special_tokens=False)
    return time.perf_counter() - start


def run_baseline(jsonl: Path, tokenizer: Path) -> list[dict[str, float | str]]:
    command = [sys.executable, "-m", "jobs.bench.data_prepare", "--baseline", str(jsonl), "--tokenizer", str(tokenizer)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=200, help="JSONL size in MB (default 200)")
    parser.add_argument("--rounds", type=int, default=2, help="prepare/baseline pairs, alternating (default 2)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hpc-bench-data"), help="where the files go")
    parser.add_argument("--tokenizer", type=Path, default=EXAMPLE_TOKENIZER, help="default: the example BPE")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON lines")
    parser.add_argument("--baseline", type=Path, help=argparse.SUPPRESS)  # the baseline's own process
    args = parser.parse_args()
    if args.baseline:
        print(json.dumps(baseline(args.baseline, args.tokenizer)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    jsonl = args.dir / f"licenses-{args.mb:g}mb.jsonl"
    if not jsonl.exists():
        make_jsonl(jsonl, args.mb)
    size = jsonl.stat().st_size
    rows = []
    for round_ in range(args.rounds):
        rows += [{**row, "round": round_} for row in [run_prepare(jsonl, args.tokenizer, args.dir / "set"),
                                                      *run_baseline(jsonl, args.tokenizer)]]
    print(_report(rows, size, os.cpu_count()))
    if args.json:
        for row in rows:
            print(json.dumps(row))


def _report(rows: list[dict], size: int, cores: int | None) -> str:
    best = {}
    for row in rows:
        best[row["impl"]] = min(best.get(row["impl"], float("inf")), row["seconds"])
    reference = best["encode_batch (documents in memory)"]
    table = [[row["round"], row["impl"], f"{row['seconds']:.1f}", f"{row['cpu_s']:.1f}",
              f"{size / row['seconds'] / 1e6:.2f}",
              f"{reference / row['seconds']:.2f}", f"{row['peak_rss_mb']:.0f}" if "peak_rss_mb" in row else "",
              row.get("sha256", "")] for row in rows]
    hashes = {row["sha256"] for row in rows if "sha256" in row}
    lines = [f"{size / 1e6:.1f} MB of JSONL, {cores} cores; x = best encode_batch time / this time",
             format_table(["round", "impl", "s", "CPU s", "MB/s", "x", "peak RSS MB", "output sha256"], table),
             f"prepare outputs identical across rounds: {len(hashes) == 1}",
             "best: " + ", ".join(f"{impl} {size / seconds / 1e6:.2f} MB/s" for impl, seconds in best.items())]
    prepare_rows = [row for row in rows if "output" in row]
    pairs = [next(r["seconds"] for r in rows if r["round"] == row["round"] and r["impl"].startswith("encode_batch "))
             / row["seconds"] for row in prepare_rows]
    lines.append("prepare's throughput over encode_batch's, round by round: "
                 + ", ".join(f"{ratio:.2f}x" for ratio in pairs) + f" (median {statistics.median(pairs):.2f}x)")
    return "\n".join([*lines, "hpc data prepare printed: " + prepare_rows[-1]["output"]])


if __name__ == "__main__":
    main()

"""Rank 0's live view of training: a progress bar on a terminal, periodic lines otherwise.

Launchers pipe rank output to prefix it, so ranks cannot ask isatty() themselves:
``hpc run`` passes ``HPC_PROGRESS=tty`` when its own output is a terminal. A bar
redraws with carriage returns only (no cursor movement), which survives prefixing.
Slurm logs and CI get plain lines every ``log_every`` steps.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def progress_mode(environ: dict[str, str] | None = None, stream: TextIO = sys.stderr) -> str:
    mode = (environ if environ is not None else os.environ).get("HPC_PROGRESS")
    if mode in ("tty", "plain", "off"):
        return mode
    return "tty" if stream.isatty() else "plain"


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    def __init__(self, total_steps: int, log_every: int, mode: str, unit: str = "samples", start_step: int = 0):
        self.total_steps = total_steps
        self.log_every = log_every
        self.mode = mode
        self.unit = unit
        self.start_step = start_step
        self.started = time.perf_counter()
        self.bar = None
        if mode == "tty":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", ncols=100, file=sys.stderr)

    def update(self, step: int, loss: float, lr: float, throughput: float) -> None:
        """Report that ``step`` (0-based) finished."""
        done = step + 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f} {self.unit}/s {throughput:,.0f}", refresh=False)
            self.bar.update(done - self.bar.n)
        elif self.mode == "plain" and (done % self.log_every == 0 or done == self.total_steps):
            elapsed = time.perf_counter() - self.started
            remaining = elapsed / max(done - self.start_step, 1) * (self.total_steps - done)
            print(
                f"step {done}/{self.total_steps} loss {loss:.4f} lr {lr:.3g} "
                f"{self.unit}/s {throughput:,.0f} eta {format_duration(remaining)}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

"""``train.profile_steps``: torch.profiler over a few training steps, after the warm-up, on every rank.

torch's profiler records what a step ran (host ops, and on a GPU every kernel with its device time); we only say
when and where: it starts after ``PROFILE_AFTER`` steps (allocation, autotuning, compilation), records
``train.profile_steps`` steps, and writes each rank's trace (``rank<r>.trace.json``, for Perfetto or
chrome://tracing) and its ops by device time (``rank<r>.ops.txt``, torch's ``key_averages`` table) to
``<run_path>/profile/``, as torchtitan's ``profiling.enable_profiling`` does.
"""

from __future__ import annotations

from pathlib import Path

import torch

PROFILE_AFTER = 3  # steps left unprofiled first, as the benchmarks leave them out of their medians
TABLE_ROWS = 40


class StepProfiler:
    """Call ``step()`` after each training step and ``close()`` after the last; with ``steps`` 0 both do nothing."""

    def __init__(self, steps: int, run_path: Path, rank: int, device: torch.device) -> None:
        self.out, self.rank, self.cuda = Path(run_path) / "profile", rank, device.type == "cuda"
        self.profiler = None
        if not steps:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        every = torch.profiler.schedule(wait=PROFILE_AFTER - 1, warmup=1, active=steps, repeat=1)
        self.profiler = torch.profiler.profile(activities=activities, schedule=every, on_trace_ready=self._write)
        self.profiler.start()

    def _write(self, profiler: torch.profiler.profile) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.out / f"rank{self.rank}.trace.json"))
        order = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=order, row_limit=TABLE_ROWS)
        (self.out / f"rank{self.rank}.ops.txt").write_text(table + "\n")

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()

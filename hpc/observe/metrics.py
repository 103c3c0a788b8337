"""Per-step metrics as JSON lines in the run directory (and TensorBoard when installed); per-rank totals.

One object per step, easy to tail, plot (``hpc report``) and load with pandas.
Rank 0 writes ``metrics.jsonl``: the global loss and its own timings. Every rank
writes its totals to ``ranks/rank-XXXXX.json`` at the end, which is what the
per-rank time breakdown compares. ``FIELDS`` is the schema; docs/OBSERVABILITY.md
lists it, and a test checks the two agree and that a run writes every field.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

from hpc.rundir import RANKS_DIR

FIELDS = MappingProxyType({
    "step": "1-based step number",
    "loss": "the global batch's mean loss",
    "lr": "learning rate used for the step",
    "grad_norm": "global gradient norm before clipping, across TP and PP",
    "samples_per_s": "throughput of a model that counts samples (the MLP); absent otherwise",
    "tokens_per_s": "throughput of a model that counts tokens (the GPT); absent otherwise",
    "step_time_s": "wall time of the step",
    "compute_s": "step time not spent waiting for communication (step_time_s - wait_s)",
    "comm_s": "time inside gradient reductions (partly hidden behind backward) and pipeline transfers; on a GPU "
              "from CUDA events on the communication stream",
    "wait_s": "time the training loop was blocked on communication, what overlap did not hide; on a GPU from "
              "CUDA events on the compute stream",
    "comm_bytes": "bytes this rank sent for gradient reductions",
    "raw_bytes": "what an uncompressed ring all-reduce of the same gradients sends: 2 (n-1)/n of their size",
    "compression_ratio": "raw_bytes / comm_bytes: 1 without compression, about 4 with int8",
    "peak_memory_bytes": "peak memory: CUDA allocator peak on GPU, peak resident set size on CPU",
})
RANK_TOTALS = ("step_time_s", "compute_s", "comm_s", "wait_s")  # summed per rank into ranks/rank-XXXXX.json
TENSORBOARD_DIR = "tensorboard"


def peak_memory_bytes(device: Any = None) -> int:
    """The CUDA allocator's peak on a GPU; on CPU this process's peak resident set since its program started:
    Linux's VmHWM, which belongs to the address space. ``ru_maxrss`` is kept across fork and exec, so a rank
    started by a large process (a test runner, a notebook) would report its parent's size."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# Dense peak FLOP/s per device by (name fragment, bf16 or float32 math), from the vendors' datasheets
# (SXM parts; sparsity excluded). MFU is the model's FLOPs over this; an unknown device reports none.
PEAK_FLOPS = (
    ("H200", 989e12, 67e12), ("H100", 989e12, 67e12), ("GH200", 989e12, 67e12), ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12), ("A10G", 70e12, 31.2e12), ("V100", 125e12, 15.7e12),
)


def device_peak_flops(device: Any, bf16: bool) -> float | None:
    """The device's dense peak for the math the model runs (bf16 under autocast, else float32); None when
    the device is a CPU or not in ``PEAK_FLOPS``."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for fragment, bf16_peak, fp32_peak in PEAK_FLOPS:
        if fragment in name:
            return bf16_peak if bf16 else fp32_peak
    return None


def _tensorboard_writer(directory: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=str(directory))


class MetricsLog:
    def __init__(self, path: Path, tensorboard: bool = True):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)
        self._tensorboard = _tensorboard_writer(path.parent / TENSORBOARD_DIR) if tensorboard else None

    def write(self, record: dict[str, object]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            step = int(record["step"])  # type: ignore[arg-type]
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def write_rank_totals(run_dir: Path, rank: int, totals: dict[str, object]) -> Path:
    path = run_dir / RANKS_DIR / f"rank-{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, **totals}))
    return path

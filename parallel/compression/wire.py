"""Each codec's bytes on the wire over the gradient's own bytes: the one table the codecs report (``wire_ratio``)
and the planner charges (``hpc plan``, parallel/plan.py).

Standard library only: ``hpc plan`` reads it on a login node without torch. ``itemsize`` is the bytes of one
gradient element before the codec (4 for float32).
"""

from __future__ import annotations

INT8_BLOCK = 256  # values per float32 scale of the int8 codec
CAST_BYTES = {"fp16": 2, "bf16": 2}  # bytes per value of the cast codecs' wire dtypes
INDEX_BYTES = 4  # top-k's int32 index per value sent


def cast_ratio(name: str, itemsize: int = 4) -> float:
    """fp16 or bf16: the wire dtype's bytes over the gradient's (0.5 for float32)."""
    return CAST_BYTES[name] / itemsize


def int8_ratio(block: int = INT8_BLOCK, itemsize: int = 4) -> float:
    """One byte per value and a float32 scale per block: (1 + 4/block) / itemsize (0.254 for 256 and float32)."""
    return (1 + 4 / block) / itemsize


def topk_ratio(fraction: float, itemsize: int = 4) -> float:
    """``fraction`` of the values, each with its int32 index: 2 x fraction for float32."""
    return fraction * (INDEX_BYTES + itemsize) / itemsize


def powersgd_compresses(rank: int, rows: int, cols: int) -> bool:
    """Whether P (rows x rank) and Q (cols x rank) are smaller than the rows x cols matrix they replace."""
    return rank * (rows + cols) < rows * cols


def powersgd_ratio(rank: int, rows: int, cols: int) -> float:
    """rank (rows + cols) / (rows cols) of a matrix it compresses (2 r / h for h x h), else 1: sent whole."""
    return rank * (rows + cols) / (rows * cols) if powersgd_compresses(rank, rows, cols) else 1.0


def wire_ratio(codec: str, itemsize: int = 4, topk_fraction: float = 0.01, powersgd_rank: int = 4,
               matrix: tuple[int, int] = (1, 1)) -> float:
    """The ratio of ``codec`` (a name of ``hpc.config.CODEC_NAMES``); PowerSGD's of a ``matrix`` (rows, cols)."""
    ratios = {
        "none": lambda: 1.0,
        "fp16": lambda: cast_ratio("fp16", itemsize),
        "bf16": lambda: cast_ratio("bf16", itemsize),
        "int8": lambda: int8_ratio(INT8_BLOCK, itemsize),
        "topk": lambda: topk_ratio(topk_fraction, itemsize),
        "powersgd": lambda: powersgd_ratio(powersgd_rank, *matrix),
    }
    if codec not in ratios:
        raise ValueError(f"unknown gradient compression {codec!r} (valid: {', '.join(ratios)})")
    return ratios[codec]()

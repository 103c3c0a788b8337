"""The one table from codec name to implementation; the names themselves are ``hpc.config.CODEC_NAMES``.

The job spec must validate ``parallel.compression`` without importing torch, so the
names live in ``hpc.config``; this table keys its implementations by exactly those
names (tested), in the same order, and everything else reads one or the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from parallel.compression.base import Codec, Reducer
from parallel.compression.casts import CastCodec, RingReducer
from parallel.compression.int8 import Int8Codec
from parallel.compression.powersgd import PowerSGDReducer
from parallel.compression.topk import TopKReducer


@dataclass(frozen=True)
class Implementation:
    make_reducer: Callable[[float, int], Reducer]  # (topk_fraction, powersgd_rank) -> a fresh reducer
    make_ring_codec: Callable[[], Codec] | None = None  # codecs applied at every ring hop only


def _in_ring(make_codec: Callable[[], Codec]) -> Implementation:
    return Implementation(lambda _fraction, _rank: RingReducer(make_codec()), make_codec)


REGISTRY: dict[str, Implementation] = {
    "none": _in_ring(Codec),
    "fp16": _in_ring(partial(CastCodec, "fp16")),
    "bf16": _in_ring(partial(CastCodec, "bf16")),
    "int8": _in_ring(Int8Codec),
    "topk": Implementation(lambda fraction, _rank: TopKReducer(fraction)),
    "powersgd": Implementation(lambda _fraction, rank: PowerSGDReducer(rank)),
}
RING_CODECS = tuple(name for name, implementation in REGISTRY.items() if implementation.make_ring_codec)


def make_codec(name: str) -> Codec:
    implementation = REGISTRY.get(name)
    if implementation is None or implementation.make_ring_codec is None:
        raise ValueError(f"unknown ring codec {name!r} (valid: {', '.join(RING_CODECS)})")
    return implementation.make_ring_codec()


def make_reducer(name: str, topk_fraction: float = 0.01, powersgd_rank: int = 4) -> Reducer:
    implementation = REGISTRY.get(name)
    if implementation is None:
        raise ValueError(f"unknown gradient compression {name!r} (valid: {', '.join(REGISTRY)})")
    return implementation.make_reducer(topk_fraction, powersgd_rank)

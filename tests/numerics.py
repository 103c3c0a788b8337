"""Tolerances for "trains exactly like one process" that follow from the optimizer, not from one CPU.

Two runs that differ only in summation order (another layout, another SIMD width, another BLAS
kernel) get gradients that differ in their last bits: a reduction's rounding error is relative
to the sum of its terms' magnitudes, not to the result, so a gradient element that cancels to
nearly zero can be off by much more than its own ulp. SGD moves a parameter linearly in its
gradient, so that error stays at the rounding level of the tensor's movement. Adam divides each
gradient by its running RMS ``sqrt(v)``: where ``v`` is tiny, a last-bit difference becomes a
visible part of a step. Such elements are few; which ones they are depends on the CPU.

Adam's update is bounded whatever the gradients. With ``r = b1**2 / b2 < 1``, Cauchy-Schwarz on
``m_t = (1-b1) sum_k b1**(t-k) g_k`` against ``v_t = (1-b2) sum_k b2**(t-k) g_k**2`` gives, for
torch's bias-corrected step ``lr * m_t/(1-b1**t) / (sqrt(v_t/(1-b2**t)) + eps)``::

    |step_t| <= lr * B_t,   B_t = (1-b1)/(1-b1**t) * sqrt((1-b2**t)/(1-b2)) * sqrt((1-r**t)/(1-r))

(``B_1 = 1``: the first step is ``lr * sign(g)``; ``B_10 = 1.04`` for (0.9, 0.999); ``eps`` only
shrinks it). The same holds with L2 weight decay (folded into ``g``) and AdamW's decoupled decay
(a contraction, it shrinks differences), and for any schedule whose rate never exceeds ``lr``.
So two runs from the same start end at most ``reach = 2 * lr * sum_t B_t`` apart, in every
element: the bound a pure-noise gradient can reach.

``assert_trained_close`` for Adam and AdamW checks, per tensor:

* every element within ``rtol * |expected| + reach`` (the bound above: nothing can be further);
* all but ``OUTLIERS`` of its elements (a fraction, at least one) within
  ``rtol * |expected| + TIGHT * reach / 2``, a ``TIGHT`` part of the furthest Adam can move a
  parameter, once up to ``OUTLIERS`` of its units (at least one) are set aside. ``TIGHT = 1e-4``:
  about 1e-5 (100 float32 ulps, the reductions of a few steps in another order) where a gradient
  is not dominated by cancellation, times 10 for what the few sensitive elements' differences feed
  back into the others' gradients (tests/test_numerics.py: about 1% of the sensitive element's own
  difference).

Units: a weight's gradient is a sum over tokens of outer products ``delta_t x_t^T``, so the
cancellation that makes an element sensitive is often a unit's, not an element's: an output
unit whose backpropagated ``delta`` sums to nearly zero makes its whole row sensitive (and the
same unit's bias element, and its column in the next layer), an input feature its whole column.
A unit sums over the tokens that reach it: a dense layer's over the whole batch, an expert's over
the few routed to it (3 tokens at some step of tests/test_moe.py's tiny MoE), where one unit
cancelling is far likelier. On a CPU without AVX-512 (AMD EPYC AVX2; MKL_ENABLE_INSTRUCTIONS=AVX2
or SSE4_2 on an Intel one) one hidden unit of an expert moved by 1.7-3x the tight bound across its
16-element row, its bias and its column of the next layer: 14 + 7 + 1 elements, one unit each.
The rows or columns set aside are those holding the most outliers (for a tensor of more than two
dimensions, rows are its first dimension). A real error still fails: it moves most of a tensor, or
at least two rows of it (a swapped shard row), and a wrongly routed token or a dropped expert
gradient moves whole tensors (tests/test_numerics.py, tests/test_moe.py).

Measured on the tiny GPT of tests/test_3d.py (tp2 and pp2 against one process, 67,392 parameters;
ATEN_CPU_CAPABILITY default, avx2 and avx512 x MKL_CBWR unset, COMPATIBLE and AVX2): the worst
tensor had 4 of 4,096 elements beyond a tenth of the tight bound, at most one element in the model
beyond it, and none beyond 1.2e-3 lr; ``OUTLIERS = 1/256`` allows 16 in 4,096, a factor 4 over
the count even at a tenth of the tight bound.
A genuine error (a missing all-reduce, a wrong shard, one rank's gradient not averaged, even
at one step) moves most elements of a tensor by a tenth of a step or more, and the loss with
them, so it still fails (tests/test_numerics.py). Adam cannot see a gradient scaled by one
constant at every step (its update is scale-free but for ``eps``); the loss comparisons and SGD
runs cover that.

For SGD (any momentum) every element must be within ``rtol * |expected| + TIGHT * max|expected -
initial|`` over the tensor: SGD moves a parameter linearly in its gradient, so rounding stays at
the rounding level of the tensor's movement; without ``initial`` a caller gives ``atol`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

TIGHT = 1e-4
OUTLIERS = 1 / 256
RTOL = 1e-5
LOSS_RTOL = 1e-5  # losses are means over a batch: their rounding does not go through 1/sqrt(v)


def adam_step_bound(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """``B_t``: torch's Adam step ``t`` (1-based) moves an element by at most ``lr * B_t``."""
    b1, b2 = betas
    r = b1 * b1 / b2
    geometric = t if r == 1 else (1 - r**t) / (1 - r)
    return (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2)) * math.sqrt(geometric)


def adam_reach(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999), first_step: int = 1) -> float:
    """How far apart two Adam runs of ``steps`` steps (from step ``first_step``) can end, per element."""
    return 2 * lr * sum(adam_step_bound(t, betas) for t in range(first_step, first_step + steps))


def _as_matrix(values: np.ndarray) -> np.ndarray:
    """Rows (the first dimension: output units, tokens of an embedding) by everything else."""
    return values.reshape(len(values), -1)


def outliers_outside_units(outside: np.ndarray) -> int:
    """How many of the ``outside`` elements remain once ``OUTLIERS`` of the rows and columns (at least one) are
    set aside, each time the one holding the most of them (a vector's units are its elements: none is)."""
    if outside.ndim < 2:
        return int(outside.sum())
    remaining = _as_matrix(outside).copy()
    for _ in range(max(1, int(OUTLIERS * sum(remaining.shape)))):
        rows, columns = remaining.sum(1), remaining.sum(0)
        if rows.max() >= columns.max():
            remaining[rows.argmax(), :] = False
        else:
            remaining[:, columns.argmax()] = False
    return int(remaining.sum())


def trained_mismatches(actual: np.ndarray, expected: np.ndarray, *, optimizer: str, lr: float, steps: int,
                       initial: np.ndarray | None = None, atol: float | None = None,
                       betas: tuple[float, float] = (0.9, 0.999)) -> str | None:
    """Why ``actual`` is not ``expected`` trained another way by ``optimizer``, or None when it is."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    diff = np.abs(actual - expected)
    if not np.isfinite(diff).all():
        return "not finite"
    relative = RTOL * np.abs(expected)
    if optimizer in ("adam", "adamw"):
        reach = adam_reach(lr, steps, betas)
        tight = TIGHT * reach / 2
        beyond = outliers_outside_units(diff > relative + tight)
        allowed = max(1, int(OUTLIERS * diff.size))
        if (diff > relative + reach).any():
            return f"max diff {diff.max():.3g} beyond Adam's reach {reach:.3g} ({steps} steps of lr {lr:g})"
        if beyond > allowed:
            return (f"{beyond} of {diff.size} elements beyond {tight:.3g} outside its most sensitive units "
                    f"(at most {allowed} may be: max diff {diff.max():.3g})")
        return None
    if atol is None:
        if initial is None:
            raise ValueError("SGD's bound is relative to the tensor's movement: pass initial, or atol")
        atol = TIGHT * float(np.abs(expected - np.asarray(initial, dtype=np.float64)).max())
    worst = int(np.argmax(diff - relative - atol))
    if diff.flat[worst] > relative.flat[worst] + atol:
        return f"element {np.unravel_index(worst, diff.shape)}: diff {diff.flat[worst]:.3g} beyond {atol:.3g}"
    return None


def assert_trained_close(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], *, optimizer: str,
                         lr: float, steps: int, name: str = "", initial: Mapping[str, np.ndarray] | None = None,
                         atol: float | None = None, betas: tuple[float, float] = (0.9, 0.999)) -> None:
    """Every tensor of ``expected`` (key by key) matches ``actual`` as two runs of the same training can.

    ``optimizer`` is "adam"/"adamw" (``lr`` its peak rate, ``steps`` those both runs took) or
    "sgd" (with ``initial``, the tensors before training, or an explicit ``atol``).
    """
    assert actual.keys() == expected.keys(), f"{name}: {sorted(set(actual) ^ set(expected))}"
    failures = []
    for key, value in expected.items():
        start = None if initial is None else initial[key]
        why = trained_mismatches(actual[key], value, optimizer=optimizer, lr=lr, steps=steps, initial=start,
                                 atol=atol, betas=betas)
        if why:
            failures.append(f"{key}: {why}")
    assert not failures, f"{name}: " + "; ".join(failures)

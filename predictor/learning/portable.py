"""Arithmetic that gives the same result on every x86-64 CPU, for what decides placement.

A replay is only worth publishing if another machine can repeat it. Vectorised
kernels round by instruction set: numpy's ``interp``, ``log`` and ``exp`` take
AVX-512 paths where the CPU has them, torch picks its kernels by
``ATEN_CPU_CAPABILITY``, and a float32 model fed back its own updates drifts
apart by about 1e-7 per forecast between two machines. One forecast then lands
on the other side of a threshold and the replay's figures move by a percent.

So the predictor keeps float arithmetic where rounding cannot reach a decision:
the model runs in float64 (its last bits still differ by kernel, by about
1e-16), and every forecast leaves the learner on a grid of ``FORECAST_DIGITS``
decimals, which a difference that small crosses about once in 1e10 forecasts.
What is computed from forecasts afterwards (interpolation between horizons, the
gap histogram's edges, the blend of two forecasts) is plain Python on scalars:
IEEE operations in a fixed order, which every CPU rounds alike.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

FORECAST_DIGITS = 6
"""Forecast probabilities are rounded to this many decimals: far finer than any
threshold the placement compares them with, far coarser than float64's last bits."""


def settle(probabilities: Iterable[float]) -> tuple[float, ...]:
    """``probabilities`` on the forecast grid (``round`` is exact on a float's value)."""
    return tuple(round(float(p), FORECAST_DIGITS) for p in probabilities)


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear ``ys`` over increasing ``xs`` at ``x``, flat beyond both ends:
    ``np.interp`` on one number, in the same formula, without its vector kernel."""
    if x <= xs[0]:
        return ys[0]
    high = bisect.bisect_left(xs, x)
    if high >= len(xs):
        return ys[-1]
    if xs[high] == x:
        return ys[high]
    low = high - 1
    slope = (ys[high] - ys[low]) / (xs[high] - xs[low])
    return slope * (x - xs[low]) + ys[low]


def geometric_grid(start: float, stop: float, count: int) -> tuple[float, ...]:
    """``count`` points from ``start`` to ``stop`` (both exact), evenly spaced in log."""
    step = math.log(stop / start) / (count - 1)
    inner = (start * math.exp(step * index) for index in range(1, count - 1))
    return (float(start), *inner, float(stop))


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))

"""The scalar arithmetic the predictor decides with: numpy's answers, to rounding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvstore.predictor.learning.counting import blend
from kvstore.predictor.learning.model import ReturnModel
from kvstore.predictor.learning.portable import (
    FORECAST_DIGITS,
    geometric_grid,
    interpolate,
    settle,
)


def test_interpolation_is_numpys_to_rounding_and_exact_at_the_knots() -> None:
    rng = np.random.default_rng(0)
    xs = np.cumsum(rng.uniform(0.1, 3.0, size=40)).tolist()
    ys = np.cumsum(rng.uniform(0.0, 5.0, size=40)).tolist()
    for x in [xs[0] - 1.0, *xs, xs[-1] + 1.0, *rng.uniform(xs[0], xs[-1], size=500).tolist()]:
        assert interpolate(x, xs, ys) == pytest.approx(float(np.interp(x, xs, ys)), rel=1e-12)
    assert [interpolate(x, xs, ys) for x in xs] == ys  # a knot is its own value
    assert interpolate(xs[0] - 5.0, xs, ys) == ys[0] and interpolate(1e9, xs, ys) == ys[-1]


def test_the_geometric_grid_keeps_its_ends_and_a_constant_ratio() -> None:
    grid = geometric_grid(1.0, 7 * 86400.0, 80)
    assert len(grid) == 80 and grid[0] == 1.0 and grid[-1] == 7 * 86400.0
    assert np.allclose(grid, np.geomspace(1.0, 7 * 86400.0, 80), rtol=1e-12)
    ratios = [b / a for a, b in zip(grid, grid[1:], strict=False)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)


def test_forecasts_settle_on_a_grid_coarser_than_float64_rounding() -> None:
    p = 0.123456789
    assert settle([p, p + 1e-13, p - 1e-13]) == (0.123457,) * 3
    assert all(round(q, FORECAST_DIGITS) == q for q in settle([1 / 3, 2 / 3, 0.0, 1.0]))


def test_the_blend_is_the_mean_log_odds_kept_monotone() -> None:
    blended = blend([0.2, 0.6, 0.5], [0.8, 0.6, 0.9])
    assert blended[0] == pytest.approx(0.5) and blended[1] == pytest.approx(0.6)
    z = 0.5 * (math.log(0.5 / 0.5) + math.log(0.9 / 0.1))
    assert blended[2] == pytest.approx(1 / (1 + math.exp(-z)))
    assert list(blended) == sorted(blended)


def test_a_models_first_weights_come_from_its_seed_alone() -> None:
    """Not from torch's generator, whose uniform draws round by instruction set."""
    torch.manual_seed(123)
    first = ReturnModel(5, seed=7)
    torch.manual_seed(456)
    again, other = ReturnModel(5, seed=7), ReturnModel(5, seed=8)
    weights = [p.detach().clone() for p in first.parameters()]
    assert all(p.dtype == torch.float64 for p in weights)
    assert all(torch.equal(a, b) for a, b in zip(weights, again.parameters(), strict=True))
    assert not torch.equal(weights[0], next(other.parameters()))
    bound = 1 / math.sqrt(5)
    assert float(weights[0].abs().max()) <= bound

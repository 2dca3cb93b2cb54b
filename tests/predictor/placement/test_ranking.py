"""``IdleForecast``: a forecast read as idle time grows, shaped between its horizons by
the gaps seen (``GapShape``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.placement.ranking import GapShape, IdleForecast

HORIZONS = (60.0, 600.0, 3600.0)


def _forecast(*probabilities: float, at: float = 100.0) -> IdleForecast:
    return IdleForecast.made(ReturnForecast("s", at, HORIZONS, probabilities), at)


def _gaps(*seconds: float, repeat: int = 60) -> GapShape:
    shape = GapShape()
    for gap in seconds:
        for _ in range(repeat):
            shape.add(gap)
    return shape


def test_the_levels_are_the_forecast_at_its_horizons() -> None:
    idle = _forecast(0.2, 0.5, 0.9)
    assert idle.levels == ((60.0, 0.2), (600.0, 0.5), (3600.0, 0.9))
    gaps = GapShape()
    for horizon, p in idle.levels:
        assert idle.within(horizon, gaps) == pytest.approx(p)
    assert idle.within(7200.0, gaps) == pytest.approx(0.9)  # flat beyond the last


def test_the_chance_is_conditional_on_not_being_back_yet() -> None:
    """(F(e + H) - F(e)) / (1 - F(e)), read from when the forecast was made."""
    idle = _forecast(0.2, 0.5, 0.9)
    gaps = GapShape()
    assert idle.chance(600.0, 100.0, gaps) == pytest.approx(0.5)
    # 60 s idle, then 540 s more reaches the 10-minute horizon: (0.5 - 0.2) / 0.8
    assert idle.chance(540.0, 160.0, gaps) == pytest.approx(0.3 / 0.8)
    # past the last horizon nothing more is expected
    assert idle.chance(600.0, 100.0 + 3600.0, gaps) == 0.0
    # a session certain to have been back by now reads as not coming
    assert _forecast(1.0, 1.0, 1.0).chance(60.0, 200.0, gaps) == 0.0


def test_between_horizons_the_gaps_seen_give_the_shape() -> None:
    idle = _forecast(0.2, 0.6, 0.9)
    # Every return between one and ten minutes came at about two minutes: by 150 s
    # the forecast has risen (nearly) all the way to its 10-minute level.
    shaped = idle.within(150.0, _gaps(120.0))
    assert shaped == pytest.approx(0.6, abs=0.02)
    # With too few gaps seen there, the forecast's own interpolation is read.
    assert idle.within(150.0, GapShape()) == pytest.approx(idle.forecast.within(150.0))
    assert idle.within(150.0, GapShape()) < shaped


def test_gap_counts_interpolate_in_log_time_as_numpy_would() -> None:
    """The count is read millions of times a replay, in Python, not with ``np.interp``:
    the same interpolation, to rounding (numpy's own rounding depends on the CPU's
    vector instructions, so the last bit is not compared)."""
    rng = np.random.default_rng(0)
    shape = GapShape()
    edges = np.log1p(np.asarray(GapShape.EDGES))
    for gap in rng.lognormal(4.0, 2.5, size=500):
        shape.add(float(gap))
    cumulative = np.asarray([shape.count(edge) for edge in GapShape.EDGES])
    assert cumulative[0] == 0.0 and cumulative[-1] == 500.0
    probes = [0.0, *GapShape.EDGES, 1e9, *rng.lognormal(4.0, 3.0, size=300).tolist()]
    for seconds in probes:
        expected = float(np.interp(math.log1p(seconds), edges, cumulative))
        assert shape.count(seconds) == pytest.approx(expected, rel=1e-12, abs=1e-12), seconds

"""How well a replay's forecasts ranked and were calibrated on the idle periods a human
ends, beside two baselines scored on exactly the same periods.

The learner scores itself on every idle period (``learning.quality``). What a
placement policy needs most is the wait for a *human*: an agent's tool result
is back in seconds whatever the model says. So the replay keeps every
forecast it was given when a session went idle, with what came of it, and
scores the periods that a human ends (or would: an agent that handed back to
its human and never heard again), per horizon ``h``:

- ``model``: the forecast's P(back within h).
- ``prev_gap``: the session's previous human gap. Its AUC is that of the raw
  score (a shorter last wait ranks higher); its Brier score is that of the
  calibrated rule: the frequency of a return within ``h`` so far among
  periods whose previous gap fell in the same bucket (relative to ``h``).
- ``base_rate``: the frequency of a return within ``h`` so far.

A label is 1 when the session was back within ``h``, 0 when ``h`` passed
without it before the replay ended, and unknown (left out) otherwise. The
baselines learn a label only once it would have been known (at the return,
or when ``h`` passed), so their scores are prequential, as the model's are.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.learning.quality import RankHistogram

# Bucket edges of the previous gap, as multiples of the horizon.
_GAP_EDGES = np.array([0.125, 0.5, 1.0, 2.0, 8.0])
_NO_GAP = len(_GAP_EDGES) + 1  # the bucket of a session's first wait


@dataclass(frozen=True, slots=True)
class IdlePeriod:
    """A session gone idle at ``at``, back after ``gap`` (``math.inf``: never), whether a
    human ends it, the forecast it was given, and its previous human gap."""

    at: float
    gap: float
    human: bool
    forecast: ReturnForecast
    prev_gap: float | None


class _Scorer:
    """AUC (``RankHistogram``) and Brier score of one predictor at one horizon."""

    def __init__(self) -> None:
        self.ranks = RankHistogram()
        self.squared = 0.0
        self.count = 0

    def add(self, rank_score: float, probability: float, label: int) -> None:
        self.ranks.add(rank_score, label)
        self.squared += (probability - label) ** 2
        self.count += 1

    def auc(self) -> float:
        return self.ranks.auc()

    def brier(self) -> float:
        return self.squared / self.count if self.count else math.nan


def _label(period: IdlePeriod, horizon: float, end: float) -> int | None:
    if period.gap <= horizon:
        return 1
    return 0 if period.at + horizon <= end else None


def _bucket(prev_gap: float | None, horizon: float) -> int:
    if prev_gap is None:
        return _NO_GAP
    return int(np.searchsorted(_GAP_EDGES, prev_gap / horizon))


def _score_horizon(
    periods: Sequence[IdlePeriod], horizon: float, end: float
) -> dict[str, _Scorer]:
    scorers = {"model": _Scorer(), "prev_gap": _Scorer(), "base_rate": _Scorer()}
    known: list[tuple[float, int, int]] = []  # (when the label is known, bucket, label)
    rate = [1.0, 2.0]  # Laplace: returns + 1, periods + 2
    buckets: dict[int, list[float]] = {}
    for period in sorted(periods, key=lambda p: p.at):
        while known and known[0][0] <= period.at:  # labels the baselines know by now
            _, seen_bucket, seen = heapq.heappop(known)
            rate[0] += seen
            rate[1] += 1
            counts = buckets.setdefault(seen_bucket, [0.0, 0.0])
            counts[0] += seen
            counts[1] += 1
        label = _label(period, horizon, end)
        if label is None or not period.human:
            continue
        bucket = _bucket(period.prev_gap, horizon)
        base = rate[0] / rate[1]
        counts = buckets.get(bucket, [0.0, 0.0])
        calibrated = (counts[0] + base) / (counts[1] + 1.0)  # shrunk to the base rate
        raw = 0.5 if period.prev_gap is None else 1.0 / (1.0 + period.prev_gap / horizon)
        forecast = period.forecast.within(horizon)
        scorers["model"].add(forecast, forecast, label)
        scorers["prev_gap"].add(raw, calibrated, label)
        scorers["base_rate"].add(base, base, label)
        heapq.heappush(known, (period.at + min(period.gap, horizon), bucket, label))
    return scorers


def score_periods(
    periods: Sequence[IdlePeriod], horizons: Sequence[float], end: float
) -> tuple[dict[str, Any], list[tuple[float, float, int]]]:
    """The human-period scores of every predictor per horizon (``"auc_human"``,
    ``"brier_human"``, ``"n_human"``, and the same under ``"prev_gap"`` and
    ``"base_rate"``), and the calibration points of every period whose label is
    known and that a human ends: (horizon, the forecast's probability, label)."""
    report: dict[str, Any] = {
        "auc_human": {},
        "brier_human": {},
        "n_human": {},
        "prev_gap": {"auc_human": {}, "brier_human": {}},
        "base_rate": {"auc_human": {}, "brier_human": {}},
    }
    for horizon in horizons:
        name = f"{horizon:g}"
        scorers = _score_horizon(periods, horizon, end)
        report["auc_human"][name] = scorers["model"].auc()
        report["brier_human"][name] = scorers["model"].brier()
        report["n_human"][name] = scorers["model"].count
        for baseline in ("prev_gap", "base_rate"):
            report[baseline]["auc_human"][name] = scorers[baseline].auc()
            report[baseline]["brier_human"][name] = scorers[baseline].brier()
    calibration = [
        (horizon, period.forecast.within(horizon), label)
        for period in periods
        if period.human
        for horizon in horizons
        if (label := _label(period, horizon, end)) is not None
    ]
    return report, calibration

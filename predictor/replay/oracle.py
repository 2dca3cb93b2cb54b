"""Oracles for the replay: the true next arrival, sharp or blurred to a chosen AUC.

``oracle`` feeds ``PlacementPolicy`` ``perfect_forecast``: 1 at every horizon
the session's true gap falls within, 0 at the others. That bounds what any
predictor could do, but not what a *realistic* one can: a model whose AUC is
0.65 is nowhere near it. ``oracle:AUC`` (``BlurredOracle``) answers the
question in between: what would the same policy save with a forecaster of
exactly this discrimination, calibrated? It tells whether a predictor falls
short of the oracle because of its features (the AUC) or because of the policy
that reads them.

The blur: per idle period one draw ``e ~ N(0, 1)``; at each horizon the score
is ``s = d * (y - 1/2) + e`` with ``y`` the true label, so the scores of
returning and non-returning sessions are two unit normals ``d`` apart and
``AUC = Phi(d / sqrt 2)``. The probability given is the posterior,
``logit p = logit(base rate) + d * s``: calibrated, and monotone across the
horizons because ``y`` and the base rate both are. The base rates are read
from the whole trace: an oracle may look ahead, the predictor never does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from kvstore.errors import ConfigError
from kvstore.predictor.learning.online import ReturnForecast


class BlurredOracle:
    """Forecasts of a given AUC at every horizon, from the true gap (see the module)."""

    def __init__(self, auc: float, base_rates: Sequence[float], seed: int = 0) -> None:
        if not 0.5 < auc < 1.0:
            raise ConfigError(f"an oracle's AUC must lie in (0.5, 1), got {auc}")
        self.auc = auc
        self.separation = math.sqrt(2.0) * NormalDist().inv_cdf(auc)
        self.base_logits = [_logit(min(max(p, 1e-4), 1 - 1e-4)) for p in base_rates]
        self._rng = np.random.default_rng(seed)

    def forecast(
        self, session: str, at: float, gap: float, horizons: Sequence[float]
    ) -> ReturnForecast:
        """The forecast for a session going idle at ``at`` that is back after ``gap``
        seconds (``math.inf``: never)."""
        noise = float(self._rng.standard_normal())
        d = self.separation
        probabilities = []
        for horizon, base in zip(horizons, self.base_logits, strict=True):
            score = d * (float(gap <= horizon) - 0.5) + noise
            probabilities.append(1.0 / (1.0 + math.exp(-(base + d * score))))
        return ReturnForecast(session, at, tuple(float(h) for h in horizons), tuple(probabilities))


def base_rates(
    idle_at: Sequence[float], gaps: Sequence[float], horizons: Sequence[float], end: float
) -> tuple[float, ...]:
    """P(back within h) per horizon over the idle periods whose label the trace tells
    (back within h, or idle for h before the trace ended)."""
    rates = []
    for horizon in horizons:
        known = [
            gap <= horizon
            for at, gap in zip(idle_at, gaps, strict=True)
            if gap <= horizon or at + horizon <= end
        ]
        rates.append(sum(known) / len(known) if known else 0.5)
    return tuple(rates)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))

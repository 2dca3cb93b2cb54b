"""Prequential quality of the return model, beside two baselines scored on the same labels.

Prequential: every forecast is scored against its label when the label
becomes known, *before* the model learns from it, so the running scores are
honest out-of-sample numbers from the first event on, with no held-out set.

Per horizon, three predictors are scored on exactly the same (event, label)
pairs:

- ``model``: the probability the model gave when the session went idle.
- ``base_rate``: the frequency of label 1 at this horizon so far (Laplace
  smoothed). It knows nothing about the session; it is the bar for calibration.
- ``last_gap``: the frequency of label 1 so far among events whose previous
  gap was also within the horizon (or also beyond it, or also absent). This
  is the obvious heuristic, "a user who came back fast last time will again",
  turned into a calibrated probability; it is the bar for ranking.

Metrics: AUC (ranking: does a session that returns score above one that does
not?), Brier score and log loss (running means; both reward calibration).

AUC memory is bounded by a histogram rather than a reservoir: each label keeps
``AUC_BINS`` counts over the score's logit in [-8, 8] (probabilities 0.0003 to
0.9997, a logit step of 0.016). The Mann-Whitney statistic with ties
(a tie counts one half) is then exact over *all* recorded pairs for scores
rounded to that grid; rounding can only turn an ordered pair into a tie, so
it moves the AUC by at most half the share of pairs that share a bin. A
reservoir would be exact on its scores but forget most pairs of a long run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

AUC_BINS = 1000
_LOGIT_RANGE = 8.0
_EPS = 1e-7  # log loss clips probabilities to [eps, 1 - eps]


class RankHistogram:
    """Scores per label in ``AUC_BINS`` logit bins; ``auc()`` is Mann-Whitney with ties."""

    def __init__(self, bins: int = AUC_BINS) -> None:
        self.counts = np.zeros((2, bins), dtype=np.int64)  # row 0: negatives, row 1: positives

    def add(self, probability: float, label: int) -> None:
        p = min(max(probability, _EPS), 1.0 - _EPS)
        logit = min(max(math.log(p / (1.0 - p)), -_LOGIT_RANGE), _LOGIT_RANGE)
        bins = self.counts.shape[1]
        index = min(int((logit + _LOGIT_RANGE) / (2 * _LOGIT_RANGE) * bins), bins - 1)
        self.counts[label, index] += 1

    def auc(self) -> float:
        """P(a positive outscores a negative), ties counting one half; NaN without both labels."""
        neg, pos = self.counts
        pairs = int(neg.sum()) * int(pos.sum())
        if pairs == 0:
            return math.nan
        neg_below = np.cumsum(neg) - neg
        return float((pos * (neg_below + 0.5 * neg)).sum() / pairs)


@dataclass
class _Score:
    """Running AUC, Brier and log loss of one predictor at one horizon."""

    ranks: RankHistogram = field(default_factory=RankHistogram)
    n: int = 0
    brier_sum: float = 0.0
    log_loss_sum: float = 0.0

    def add(self, probability: float, label: int) -> None:
        self.ranks.add(probability, label)
        self.n += 1
        self.brier_sum += (probability - label) ** 2
        p = min(max(probability, _EPS), 1.0 - _EPS)
        self.log_loss_sum -= math.log(p if label else 1.0 - p)

    def metrics(self) -> dict[str, float]:
        n = self.n or math.nan
        return {
            "auc": self.ranks.auc(),
            "brier": self.brier_sum / n,
            "log_loss": self.log_loss_sum / n,
        }


@dataclass
class _Rate:
    """A Laplace-smoothed frequency of label 1: the baselines' prediction."""

    positives: int = 0
    n: int = 0

    def predict(self) -> float:
        return (self.positives + 1) / (self.n + 2)

    def add(self, label: int) -> None:
        self.positives += label
        self.n += 1


@dataclass
class _Horizon:
    """All scores at one horizon."""

    model: _Score = field(default_factory=_Score)
    base_rate: _Score = field(default_factory=_Score)
    last_gap: _Score = field(default_factory=_Score)
    rate: _Rate = field(default_factory=_Rate)
    rate_by_last_gap: dict[bool | None, _Rate] = field(default_factory=dict)


class PrequentialScores:
    """Scores per horizon of the model and the two baselines; ``report()`` at any time."""

    def __init__(self) -> None:
        self._horizons: dict[float, _Horizon] = {}

    def record(
        self, horizon: float, probability: float, label: int, baseline_last_gap: float | None
    ) -> None:
        """Score one forecast whose label at ``horizon`` just became known.

        ``baseline_last_gap`` is the session's previous idle gap at the time
        of the forecast (None if it had none), for the last-gap baseline.
        """
        h = self._horizons.setdefault(horizon, _Horizon())
        short = None if baseline_last_gap is None else baseline_last_gap <= horizon
        by_gap = h.rate_by_last_gap.setdefault(short, _Rate())
        h.model.add(probability, label)
        h.base_rate.add(h.rate.predict(), label)
        h.last_gap.add(by_gap.predict(), label)
        h.rate.add(label)
        by_gap.add(label)

    def report(self) -> dict[str, dict[str, float]]:
        """``{metric: {horizon: value}}``, horizons written as ``f"{h:g}"`` (``"60"``, ``"600"``).

        Metrics: ``n``, ``positive_rate``, then ``auc``, ``brier`` and
        ``log_loss`` for the model and with a ``base_rate_`` and a
        ``last_gap_`` prefix for the baselines. A metric that is not defined
        yet (AUC before both labels were seen) is NaN.
        """
        report: dict[str, dict[str, float]] = {}

        def put(name: str, key: str, value: float) -> None:
            report.setdefault(name, {})[key] = value

        for horizon, h in sorted(self._horizons.items()):
            key = f"{horizon:g}"
            put("n", key, float(h.rate.n))
            put("positive_rate", key, h.rate.positives / h.rate.n)
            for prefix, score in (
                ("", h.model),
                ("base_rate_", h.base_rate),
                ("last_gap_", h.last_gap),
            ):
                for name, value in score.metrics().items():
                    put(prefix + name, key, value)
        return report

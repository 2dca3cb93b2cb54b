"""Forecasters that count instead of learning weights, beside the model in ``online``.

Each keeps Laplace-smoothed frequencies of what came of past idle periods, so
it is calibrated from its first label and needs no optimiser:

- ``ToolReturns``: how often a session idle while its tool runs was back within
  each horizon. A tool's result comes back in seconds whoever the user is, so
  the model need not spend itself learning that.
- ``HumanGapTable``: P(back within h | the bin of the session's previous human
  gap): the previous-gap rule, calibrated. On kv-cache-tester the raw previous
  gap ranks the next human wait about as well as anything the model learns
  online, and the model alone took thousands of labels to find the step where
  the previous gap crosses h. ``blend`` averages the two in logit space.
- ``SupersededReturns``: how often a session left idle when its user started
  another one came back at all. Whether a user returns to an older session
  depends on the deployment (one terminal, one session; or many tabs), so it is
  counted, not assumed; the learner keeps one count for sessions that were
  waiting on a tool (a parent whose subagent just started comes back) and one
  for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HUMAN_GAP_EDGES = (60.0, 180.0, 600.0, 1800.0, 3600.0)
"""Bin bounds of the previous human gap (seconds), around the placement horizons."""

_NO_GAP = len(HUMAN_GAP_EDGES) + 1  # the bin of a session whose human has not waited yet
_TABLE_PRIOR = 4.0  # a bin starts as the pooled rate, worth this many periods
_EPS = 1e-4


class ToolReturns:
    """P(back within each horizon) of sessions idle while a tool runs; a prior of 9 in
    10, worth 10 periods."""

    def __init__(self, horizons: Sequence[float]) -> None:
        self.within = [9.0] * len(horizons)
        self.known = [10.0] * len(horizons)

    def predict(self) -> tuple[float, ...]:
        return tuple(w / n for w, n in zip(self.within, self.known, strict=True))

    def learn(self, k: int, label: int) -> None:
        self.within[k] += label
        self.known[k] += 1


class HumanGapTable:
    """P(back within each horizon | bin of the previous human gap), shrunk to the pooled
    rate of every bin (itself Laplace-smoothed from one half), monotone in the horizon."""

    def __init__(self, horizons: Sequence[float]) -> None:
        bins = _NO_GAP + 1
        self.within = np.zeros((bins, len(horizons)))
        self.known = np.zeros((bins, len(horizons)))
        self.pooled_within = np.ones(len(horizons))
        self.pooled_known = np.full(len(horizons), 2.0)

    @staticmethod
    def bin(human_gaps: Sequence[float]) -> int:
        if not human_gaps:
            return _NO_GAP
        gap = human_gaps[-1]
        return sum(1 for edge in HUMAN_GAP_EDGES if gap > edge)

    def predict(self, bin_: int) -> np.ndarray:
        pooled = self.pooled_within / self.pooled_known
        rates = (self.within[bin_] + _TABLE_PRIOR * pooled) / (self.known[bin_] + _TABLE_PRIOR)
        return np.maximum.accumulate(rates)

    def learn(self, bin_: int, k: int, label: int) -> None:
        self.within[bin_, k] += label
        self.known[bin_, k] += 1
        self.pooled_within[k] += label
        self.pooled_known[k] += 1


def blend(model: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The mean of two forecasts' log-odds, per horizon, kept monotone in the horizon."""
    m = np.clip(np.asarray(model, dtype=np.float64), _EPS, 1.0 - _EPS)
    t = np.clip(np.asarray(table, dtype=np.float64), _EPS, 1.0 - _EPS)
    z = 0.5 * (np.log(m / (1.0 - m)) + np.log(t / (1.0 - t)))
    return np.maximum.accumulate(1.0 / (1.0 + np.exp(-z)))


class SupersededReturns:
    """P(a session idle for its human comes back at all | its user has since started
    another session): a Laplace frequency from one half, labelled 1 at the return and
    0 once ``within`` seconds pass without one."""

    def __init__(self, within: float) -> None:
        self.within_s = within
        self.returned = 1.0
        self.known = 2.0

    def rate(self) -> float:
        return self.returned / self.known

    def learn(self, label: int) -> None:
        self.returned += label
        self.known += 1

    def scaled(self, probabilities: Sequence[float]) -> tuple[float, ...]:
        """``probabilities`` (P(back within h), as forecast before) times the chance of
        coming back at all: a superseded session that returns does so as it would have."""
        rate = self.rate()
        return tuple(min(1.0, max(0.0, rate * p)) for p in probabilities)

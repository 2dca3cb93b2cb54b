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

``Counts`` holds one learner's tables. They are learnt from the same labels as
the model's weights, so they are saved in the same file (``ReturnModel.save``):
a daemon that restarts, or one started from a pre-trained file, forecasts from
what was counted, not from the priors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import ConfigError
from kvstore.predictor.learning.portable import logit, sigmoid

HUMAN_GAP_EDGES = (60.0, 180.0, 600.0, 1800.0, 3600.0)
"""Bin bounds of the previous human gap (seconds), around the placement horizons."""

_NO_GAP = len(HUMAN_GAP_EDGES) + 1  # the bin of a session whose human has not waited yet
_TABLE_PRIOR = 4.0  # a bin starts as the pooled rate, worth this many periods
_EPS = 1e-4


TOOL_PRIOR = (9.0, 10.0)
"""A tool wait's prior: back within a horizon 9 times in 10, worth 10 waits."""


class ToolReturns:
    """P(back within each horizon) of sessions idle while a tool runs, from
    ``TOOL_PRIOR``."""

    def __init__(self, horizons: Sequence[float]) -> None:
        self.within = [TOOL_PRIOR[0]] * len(horizons)
        self.known = [TOOL_PRIOR[1]] * len(horizons)

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


def blend(model: Iterable[float], table: Iterable[float]) -> tuple[float, ...]:
    """The mean of two forecasts' log-odds, per horizon, kept monotone in the horizon
    (scalar arithmetic: ``portable``)."""
    blended: list[float] = []
    for m, t in zip(model, table, strict=True):
        m, t = (min(max(float(p), _EPS), 1.0 - _EPS) for p in (m, t))
        p = sigmoid(0.5 * (logit(m) + logit(t)))
        blended.append(max(p, blended[-1]) if blended else p)
    return tuple(blended)


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


@dataclass
class Counts:
    """The counting forecasters of one model: tool returns, the human-gap table, and
    superseded returns, kept apart for sessions waiting on a tool (``True``) or not."""

    tools: ToolReturns
    gap_table: HumanGapTable
    superseded: dict[bool, SupersededReturns]

    @classmethod
    def fresh(cls, horizons: Sequence[float]) -> Counts:
        """Every table at its prior; superseded sessions count as not back after the
        longest horizon."""
        within = max(horizons)
        return cls(
            ToolReturns(horizons),
            HumanGapTable(horizons),
            {tool: SupersededReturns(within) for tool in (False, True)},
        )

    def to_state(self) -> dict[str, Any]:
        """Plain lists and numbers, which ``torch.load(weights_only=True)`` reads back."""
        table = self.gap_table
        return {
            "tools": [list(self.tools.within), list(self.tools.known)],
            "gap_table": [
                table.within.tolist(),
                table.known.tolist(),
                table.pooled_within.tolist(),
                table.pooled_known.tolist(),
            ],
            "superseded": {
                str(tool).lower(): [counts.returned, counts.known]
                for tool, counts in self.superseded.items()
            },
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], horizons: Sequence[float]) -> Counts:
        """The tables ``to_state`` wrote, for a model with ``horizons``; a ``ConfigError``
        if they do not fit them (a file edited or made by another version)."""
        counts = cls.fresh(horizons)
        width = len(horizons)
        try:
            within, known = (np.asarray(part, dtype=np.float64) for part in state["tools"])
            gap_parts = [np.asarray(part, dtype=np.float64) for part in state["gap_table"]]
            superseded = {
                tool: [float(value) for value in state["superseded"][str(tool).lower()]]
                for tool in (False, True)
            }
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"the saved counts are malformed: {error!r}") from None
        table = counts.gap_table
        shapes = [(width,), (width,), table.within.shape, table.known.shape, (width,), (width,)]
        parts = [within, known, *gap_parts]
        if len(parts) != len(shapes) or any(
            part.shape != shape for part, shape in zip(parts, shapes, strict=True)
        ):
            raise ConfigError(f"the saved counts do not fit a model of {width} horizons")
        if any(len(pair) != 2 for pair in superseded.values()):
            raise ConfigError("the saved superseded counts are malformed")
        counts.tools.within, counts.tools.known = within.tolist(), known.tolist()
        table.within, table.known, table.pooled_within, table.pooled_known = gap_parts
        for tool, (returned, seen) in superseded.items():
            counts.superseded[tool].returned, counts.superseded[tool].known = returned, seen
        return counts

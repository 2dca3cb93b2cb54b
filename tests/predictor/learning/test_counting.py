"""The counting forecasters beside the model: tool returns, the previous-gap table, the
blend of the table with the model, and how often superseded sessions come back."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.predictor.learning.counting import (
    HUMAN_GAP_EDGES,
    HumanGapTable,
    SupersededReturns,
    ToolReturns,
    blend,
)

HORIZONS = (60.0, 600.0, 3600.0)


def test_the_table_bins_the_previous_human_gap_around_the_horizons() -> None:
    assert HumanGapTable.bin(()) == len(HUMAN_GAP_EDGES) + 1  # no human wait yet
    assert HumanGapTable.bin([5000.0, 30.0]) == 0  # the last one counts
    assert HumanGapTable.bin([60.0]) == 0 and HumanGapTable.bin([61.0]) == 1
    assert HumanGapTable.bin([7200.0]) == len(HUMAN_GAP_EDGES)


def test_a_bin_starts_at_the_pooled_rate_and_moves_to_its_own() -> None:
    table = HumanGapTable(HORIZONS)
    assert table.predict(0).tolist() == [0.5, 0.5, 0.5]
    for _ in range(40):
        table.learn(0, 0, 1)  # short previous gaps: back within a minute
        table.learn(4, 0, 0)  # long ones: not
    short, long = table.predict(0)[0], table.predict(4)[0]
    pooled = 41 / 82
    assert short == pytest.approx((40 + 4 * pooled) / 44)
    assert long == pytest.approx((0 + 4 * pooled) / 44)
    assert table.predict(2)[0] == pytest.approx(pooled)  # never seen: the pooled rate


def test_the_table_is_monotone_in_the_horizon() -> None:
    table = HumanGapTable(HORIZONS)
    for _ in range(10):
        table.learn(1, 0, 1)
        table.learn(1, 1, 0)  # counts that disagree across horizons
    rates = table.predict(1)
    assert np.all(np.diff(rates) >= 0)


def test_the_blend_is_the_mean_log_odds_and_stays_monotone() -> None:
    same = blend(np.array([0.2, 0.5, 0.8]), np.array([0.2, 0.5, 0.8]))
    assert same == pytest.approx([0.2, 0.5, 0.8])
    assert blend(np.array([0.1]), np.array([0.9])) == pytest.approx([0.5])
    odds = np.sqrt((0.2 / 0.8) * (0.6 / 0.4))
    assert blend(np.array([0.2]), np.array([0.6]))[0] == pytest.approx(odds / (1 + odds))
    assert np.all(np.diff(blend(np.array([0.3, 0.2, 0.9]), np.array([0.3, 0.4, 0.5]))) >= 0)
    assert 0.0 < blend(np.array([0.0]), np.array([1.0]))[0] < 1.0  # clipped, not NaN


def test_tool_returns_start_at_nine_in_ten() -> None:
    tools = ToolReturns(HORIZONS)
    assert tools.predict() == (0.9, 0.9, 0.9)
    tools.learn(0, 0)
    assert tools.predict()[0] == pytest.approx(9 / 11)


def test_superseded_returns_scale_a_forecast_by_the_chance_of_coming_back() -> None:
    counts = SupersededReturns(within=3600.0)
    assert counts.rate() == 0.5
    assert counts.scaled([0.2, 0.6, 1.0]) == pytest.approx((0.1, 0.3, 0.5))
    for _ in range(8):
        counts.learn(0)
    assert counts.rate() == pytest.approx(1 / 10)
    assert counts.scaled([1.0]) == pytest.approx((0.1,))

"""The rule baselines on hand-built scenarios over a real store: where each leaves a chain."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support import kv
from support.sessions import Sessions

from kvstore.kinds import TierKind
from kvstore.predictor.learning.model import DEFAULT_HORIZONS
from kvstore.predictor.placement.baselines import (
    LONG_HUMAN_GAP_S,
    LogNormalGaps,
    PrevGapPolicy,
    ToolAwarePolicy,
    ToolGaps,
    TTLPolicy,
)
from kvstore.predictor.placement.hooks import SessionPolicy
from kvstore.predictor.placement.policy import PlacementConfig, PlacementPolicy
from kvstore.store.tiered_store import TieredStore

HBM, DRAM, SSD = TierKind.HBM, TierKind.DRAM, TierKind.SSD


def opened(policy: SessionPolicy, tmp_path: Path) -> Sessions:
    config = kv.config(kv.hbm(8), kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    return Sessions(TieredStore(config, policy=policy), policy)


def test_a_ttl_demotes_one_tier_per_timeout_and_drops_from_the_last(tmp_path: Path) -> None:
    policy = TTLPolicy(60.0)
    run = opened(policy, tmp_path)
    with run.store as store:
        a = run.request("a", 0, 3, now=0.0)
        policy.on_idle(store, a, None, 1.0)
        policy.tick(store, 60.0)
        assert run.where(0, 3) == [HBM] * 3  # idle 59 s
        policy.tick(store, 61.0)
        assert run.where(0, 3) == [DRAM] * 3
        policy.tick(store, 100.0)
        assert run.where(0, 3) == [DRAM] * 3
        policy.tick(store, 121.0)
        assert run.where(0, 3) == [SSD] * 3
        policy.tick(store, 181.0)
        assert run.where(0, 3) == [None] * 3  # out of the last tier: dropped


def test_a_return_stops_the_ttl_clock(tmp_path: Path) -> None:
    policy = TTLPolicy(60.0)
    run = opened(policy, tmp_path)
    with run.store as store:
        a = run.request("a", 0, 3, now=0.0)
        policy.on_idle(store, a, None, 1.0)
        run.request("a", 0, 3, now=30.0)  # back before the timeout
        policy.tick(store, 200.0)
        assert run.where(0, 3) == [HBM] * 3


def test_tool_aware_keeps_a_chain_in_hbm_while_its_tool_runs(tmp_path: Path) -> None:
    policy = ToolAwarePolicy()
    run = opened(policy, tmp_path)
    with run.store as store:
        tool = run.request("t", 0, 3, now=0.0, tool_running=True)
        assert policy.on_idle(store, tool, None, 1.0) is HBM
        human = run.request("h", 1000, 3, now=2.0)
        assert policy.on_idle(store, human, None, 3.0) is DRAM  # handed back to its human
        assert run.where(0, 3) == [HBM] * 3
        assert run.where(1000, 3) == [DRAM] * 3


def test_prev_gap_demotes_only_after_a_long_human_wait(tmp_path: Path) -> None:
    policy = PrevGapPolicy()
    run = opened(policy, tmp_path)
    with run.store as store:
        quick = run.request("q", 0, 2, now=0.0)
        policy.on_idle(store, quick, None, 1.0)
        quick = run.request("q", 0, 3, now=61.0)  # a human back after a minute
        assert policy.on_idle(store, quick, None, 62.0) is HBM
        slow = run.request("s", 1000, 2, now=0.0)
        policy.on_idle(store, slow, None, 1.0)
        later = 1.0 + LONG_HUMAN_GAP_S + 60.0
        slow = run.request("s", 1000, 3, now=later)  # a human back after 11 minutes
        assert policy.on_idle(store, slow, None, later + 1.0) is DRAM
        assert run.where(0, 3) == [HBM] * 3
        assert run.where(1000, 3) == [DRAM] * 3
        tool = run.request("s", 1000, 4, now=later + 5.0, tool_running=True)
        assert policy.on_idle(store, tool, None, later + 6.0) is HBM  # a tool: back soon


def test_the_log_normal_is_learnt_from_the_deployments_human_gaps() -> None:
    gaps = LogNormalGaps(min_samples=5)
    assert gaps.parameters == (pytest.approx(math.log(120.0)), 2.0)  # the prior
    for gap in (30.0, 60.0, 120.0, 240.0, 480.0):
        gaps.observe(gap)
    mu, sigma = gaps.parameters
    assert mu == pytest.approx(math.log(120.0))
    assert sigma == pytest.approx(math.log(2.0) * math.sqrt(2.5))
    forecast = gaps.forecast("s", 10.0, (60.0, 120.0, 3600.0), tool_running=False)
    assert forecast.probabilities[1] == pytest.approx(0.5)
    assert forecast.probabilities[0] < 0.5 < forecast.probabilities[2] < 1.0
    soon = gaps.forecast("s", 10.0, (60.0, 120.0), tool_running=True)
    assert soon.probabilities == (1.0, 1.0)


def test_tool_gaps_count_the_waits_whose_outcome_is_known() -> None:
    tools = ToolGaps()
    assert tools.within((60.0, 600.0), now=0.0) == (0.9, 0.9)  # the prior: 9 in 10
    tools.waiting("a", 0.0)
    tools.waiting("b", 0.0)
    tools.waiting("c", 0.0)
    tools.returned("a", 5.0)  # back in 5 s
    tools.returned("b", 100.0)  # back in 100 s
    tools.returned("nobody", 100.0)  # was not waiting on a tool: nothing counted
    # At 700 s, "c" has waited past both horizons: a "not back" at each.
    # Within 60 s: a only (1 + 9) of a, b, c (3 + 10); within 600 s: a, b (2 + 9) of 13.
    assert tools.within((60.0, 600.0), now=700.0) == (10 / 13, 11 / 13)
    # At 300 s, c's outcome at 600 s is not known yet: it counts at 60 s only.
    assert tools.within((60.0, 600.0), now=300.0) == (10 / 13, 11 / 12)


def test_the_log_normal_with_tool_gaps_forecasts_a_tool_wait_from_them() -> None:
    tools = ToolGaps()
    gaps = LogNormalGaps(tools=tools)
    for session in ("a", "b"):
        tools.waiting(session, 0.0)
    tools.returned("a", 2.0)
    forecast = gaps.forecast("b", 1000.0, (60.0, 3600.0), tool_running=True)
    # b has waited 1,000 s: a "not back" within 60 s, unknown within an hour.
    assert forecast.probabilities == (10 / 12, 10 / 11)
    human = gaps.forecast("c", 1000.0, (60.0, 3600.0), tool_running=False)
    prior = LogNormalGaps().forecast("c", 0.0, (60.0, 3600.0), tool_running=False)
    assert human.probabilities == prior.probabilities  # a human wait: the log-normal's


@pytest.mark.parametrize("counted", [False, True], ids=["lognormal", "lognormal-tools"])
def test_a_tool_wait_past_a_minute_keeps_dram_only_where_tool_gaps_are_counted(
    tmp_path: Path, counted: bool
) -> None:
    """The plain log-normal forecasts a tool wait back within the minute for sure, so a
    wait still open after it reads as never coming back; counted tool gaps (some tools
    ran minutes) keep it ahead of a human who is less likely back."""
    tools = ToolGaps()
    for i, gap in enumerate([5.0] * 10 + [300.0] * 10):
        tools.waiting(f"earlier-{i}", 0.0)
        tools.returned(f"earlier-{i}", gap)
    gaps = LogNormalGaps(tools=tools if counted else None)
    policy = PlacementPolicy(PlacementConfig(check_min_s=10.0, check_fraction=0.0))
    config = kv.config(kv.hbm(8), kv.dram(3), kv.ssd(tmp_path / "lmdb"))
    run = Sessions(TieredStore(config, policy=policy), policy)
    with run.store as store:
        run.busy(5)
        human = run.request("h", 1000, 3, now=0.0)
        policy.on_idle(store, human, gaps.forecast("h", 1.0, DEFAULT_HORIZONS, False), 1.0)
        assert run.where(1000, 3) == [DRAM] * 3  # HBM is the running request's
        tool = run.request("t", 2000, 3, now=2.0, tool_running=True)
        policy.on_idle(store, tool, gaps.forecast("t", 3.0, DEFAULT_HORIZONS, True), 3.0)
        assert run.where(2000, 3) == [HBM] * 3
        policy.tick(store, 100.0)  # the tool has run for 97 s
        run.request("r", 3000, 3, now=100.0)  # needs t's HBM
        if counted:
            assert run.where(2000, 3) == [DRAM] * 3
            assert run.where(1000, 3) == [SSD] * 3
        else:
            assert run.where(2000, 3) == [SSD] * 3
            assert run.where(1000, 3) == [DRAM] * 3

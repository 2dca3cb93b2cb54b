"""The decision log: the ring on its own, then what ``PlacementPolicy`` logs, with which
reason, on hand-built scenarios over a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import kv
from support.sessions import Sessions, StepForecast, opened

from kvstore import TierKind
from kvstore.predictor.learning.model import DEFAULT_HORIZONS
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.placement.decisions import Action, Decision, DecisionLog, Reason, Why
from kvstore.predictor.placement.policy import PlacementPolicy

HBM, DRAM, SSD = TierKind.HBM, TierKind.DRAM, TierKind.SSD
PLACE, DEMOTE, WRITE_DOWN = Action.PLACE, Action.DEMOTE, Action.WRITE_DOWN
PLANNED, PREFETCH, EVICT = Action.PREFETCH_PLANNED, Action.PREFETCH, Action.EVICT
AN_HOUR = "P(back within 3600 s)=0.40 < keep 0.5"
RUNNING = "hbm full of running requests"
OUTRANKS = "outranks dram's next victim (0.95 > 0.00)"

Row = tuple[float, Action, TierKind | None, TierKind | None, int, str]


def forecast(session: str, at: float, *probabilities: float) -> ReturnForecast:
    return ReturnForecast(session, at, DEFAULT_HORIZONS, tuple(probabilities))


def logged(policy: PlacementPolicy, session: str) -> list[Row]:
    """The session's decisions, oldest first: (at, action, from, to, chunks, reason)."""
    latest = reversed(policy.decisions.latest(session))
    return [(d.at, d.action, d.source, d.to, d.chunks, d.why.text()) for d in latest]


def decision(session: str, at: float, chunks: int = 1) -> Decision:
    return Decision(at, session, EVICT, DRAM, SSD, chunks, Why(Reason.TOOL_RUNNING), (), None)


# -- the ring ---------------------------------------------------------------------------


def test_the_log_keeps_the_latest_and_lists_them_newest_first() -> None:
    log = DecisionLog(kept=3)
    for i in range(5):
        log.record(decision("a" if i % 2 == 0 else "b", float(i)))
    assert (len(log), log.kept, log.recorded) == (3, 3, 5)
    assert [(d.session, d.at) for d in log.latest()] == [("a", 4.0), ("b", 3.0), ("a", 2.0)]
    assert [d.at for d in log.latest("a")] == [4.0, 2.0]
    assert [d.at for d in log.latest(limit=2)] == [4.0, 3.0]
    assert [d.at for d in log.latest("a", limit=1)] == [4.0]
    assert log.latest("nobody") == []


def test_what_the_log_hands_out_are_copies() -> None:
    """A reader serialises them after letting go of the lock the policy writes under, so
    an eviction record counting more blocks meanwhile must not change the reader's."""
    log = DecisionLog()
    kept = decision("a", 1.0)
    log.record(kept)
    (copy,) = log.latest()
    kept.chunks += 4
    assert (copy.chunks, log.latest()[0].chunks) == (1, 5)


def test_a_log_keeps_at_least_one_decision() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DecisionLog(kept=0)


def test_a_decision_is_serialised_with_its_reason_in_words_and_its_forecast() -> None:
    why = Why(Reason.UNLIKELY, SSD, p=0.4, horizon=3600.0, keep=0.5)
    levels = ((60.0, 0.05), (600.0, 0.2), (3600.0, 0.4))
    placed = Decision(1.0, "a", PLACE, HBM, None, 3, why, levels, 0.5)
    assert placed.to_dict() == {
        "at": 1.0,
        "session": "a",
        "action": "place",
        "from": "hbm",
        "to": None,
        "chunks": 3,
        "reason": AN_HOUR,
        "forecast": {"at": 0.5, "horizons_s": [60.0, 600.0, 3600.0], "p_return": [0.05, 0.2, 0.4]},
    }
    unforecast = Decision(2.0, "b", PLANNED, SSD, HBM, 2, Why(Reason.RESUMED), (), None)
    assert unforecast.to_dict()["reason"] == "request started: its lookup is next"
    assert unforecast.to_dict()["forecast"] is None


# -- what the policy logs ---------------------------------------------------------------


def test_a_chain_nobody_expects_back_is_demoted_out_of_a_full_tier_and_copied_down(
    three_tiers: Sessions,
) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)  # HBM is full now
    run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    assert logged(run.policy, "a") == [
        (1.0, PLACE, HBM, None, 3, AN_HOUR),
        (1.0, DEMOTE, HBM, DRAM, 3, "P(back within 60 s)=0.05 < keep 0.5; " + RUNNING),
        (1.0, WRITE_DOWN, DRAM, SSD, 3, "copied ahead of eviction: ssd has room"),
    ]
    (latest,) = run.policy.decisions.latest("a", limit=1)
    assert latest.forecast == ((60.0, 0.05), (600.0, 0.2), (3600.0, 0.4))
    assert latest.forecast_at == 1.0
    for now in (11.0, 21.0, 31.0):  # the next looks find nothing to change: nothing logged
        run.policy.tick(run.store, now)
    assert len(logged(run.policy, "a")) == 3


def test_a_demotion_names_the_full_tier_whose_next_victim_outranks_the_chain(
    tmp_path: Path,
) -> None:
    policy = PlacementPolicy()
    run = opened(policy, kv.hbm(8), kv.dram(3), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        run.busy(5)
        likely = run.request("likely", 0, 3, now=0.0)
        policy.on_idle(store, likely, forecast("likely", 1.0, 0.2, 0.9, 0.95), 1.0)
        unlikely = run.request("unlikely", 1000, 3, now=2.0)
        policy.on_idle(store, unlikely, forecast("unlikely", 3.0, 0.1, 0.3, 0.9), 3.0)
    ten_minutes = "P(back within 600 s)=0.30 < keep 0.5"
    assert logged(policy, "unlikely") == [
        (3.0, PLACE, HBM, SSD, 3, "P(back within 3600 s)=0.90 >= keep 0.5"),
        (3.0, DEMOTE, HBM, SSD, 3, f"{ten_minutes}; dram full, next victim at 0.90 outranks it"),
    ]


def test_a_chain_waiting_for_a_tool_stays_hot_and_says_so(three_tiers: Sessions) -> None:
    run = three_tiers
    state = run.request("a", 0, 3, now=0.0, tool_running=True)
    run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    assert logged(run.policy, "a") == [
        (1.0, PLACE, HBM, HBM, 3, "tool running"),
        (1.0, WRITE_DOWN, HBM, DRAM, 3, "copied ahead of eviction: dram has room"),
    ]


def test_a_chain_kept_hot_is_copied_into_a_full_tier_only_past_its_next_victim(
    tmp_path: Path,
) -> None:
    """DRAM (4 chunks) is full of a chain nobody expects back. A session likely back
    within a minute stays in HBM and is copied into DRAM now, pushing that chain out
    while nobody waits rather than on the clock of the request that next needs HBM's
    room; a session waiting for its tool stays in HBM uncopied: its result reads the
    chain there within seconds."""
    policy = PlacementPolicy()
    run = opened(policy, kv.hbm(16), kv.dram(4), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        run.pushed_down({"gone": 0}, 4, (0.0, 0.0, 0.0), DRAM)
        assert run.where(0, 4) == [DRAM] * 4
        tool = run.request("tool", 1000, 3, now=2.0, tool_running=True)
        policy.on_idle(store, tool, forecast("tool", 3.0, 0.9, 0.95, 0.99), 3.0)
        assert run.where(1000, 3) == [HBM] * 3 and run.where(0, 4) == [DRAM] * 4
        soon = run.request("soon", 2000, 3, now=4.0)
        policy.on_idle(store, soon, forecast("soon", 5.0, 0.9, 0.95, 0.99), 5.0)
        assert run.where(2000, 3) == [HBM] * 3 and policy.owned("soon")[DRAM] == 3
        assert run.where(0, 4) == [DRAM] + [SSD] * 3
    assert logged(policy, "tool") == [(3.0, PLACE, HBM, HBM, 3, "tool running")]
    assert logged(policy, "soon") == [
        (5.0, PLACE, HBM, HBM, 3, "P(back within 10 s)=0.52 >= keep 0.5"),
        (5.0, WRITE_DOWN, HBM, DRAM, 3, f"copied ahead of eviction: {OUTRANKS}"),
    ]


def test_a_rising_forecast_logs_its_new_target_and_the_prefetch(three_tiers: Sessions) -> None:
    """Back 300 s after going idle: DRAM at first; from 241 s on, back within a minute."""
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)
    run.policy.on_idle(run.store, state, StepForecast("a", 1.0, after=300.0), 1.0)
    busy = run.tracker.get("busy")
    assert busy is not None
    run.policy.on_idle(run.store, busy, forecast("busy", 2.0, 0.9, 0.95, 0.99), 2.0)
    for now in range(11, 241, 10):
        run.policy.tick(run.store, float(now))
    run.policy.tick(run.store, 251.0)
    soon = "P(back within 60 s)=1.00 >= keep 0.5"
    assert logged(run.policy, "a") == [
        (1.0, PLACE, HBM, DRAM, 3, "P(back within 600 s)=1.00 >= keep 0.5"),
        (1.0, DEMOTE, HBM, DRAM, 3, "P(back within 60 s)=0.00 < keep 0.5; " + RUNNING),
        (1.0, WRITE_DOWN, DRAM, SSD, 3, "copied ahead of eviction: ssd has room"),
        (251.0, PLACE, DRAM, HBM, 3, soon),
        (251.0, PLANNED, DRAM, HBM, 3, soon),
        (251.0, PREFETCH, DRAM, HBM, 3, soon),
    ]
    (latest,) = run.policy.decisions.latest("a", limit=1)
    assert latest.forecast == () and latest.forecast_at == 1.0  # a forecast without horizons


def test_evictions_are_counted_per_session_tier_and_destination_not_per_block(
    tmp_path: Path,
) -> None:
    """DRAM holds 6 chunks. A chain nobody expects back stays there while there is room
    (copied to LMDB first); two requests then push it out, one block at 10 s and two at
    20 s: one record each. The first eviction measured DRAM's residence (10 s), which the
    policy then ranks by."""
    policy = PlacementPolicy()
    run = opened(policy, kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        gone = run.request("gone", 0, 3, now=0.0)
        policy.on_idle(store, gone, forecast("gone", 1.0, 0.0, 0.0, 0.0), 1.0)
        run.request("x", 1000, 4, now=10.0)
        run.request("y", 2000, 2, now=20.0)
        assert run.where(0, 3) == [SSD] * 3
    pressure = "pressure: dram full; P(back within {} s)=0.00"
    assert logged(policy, "gone") == [
        (1.0, PLACE, DRAM, None, 3, "P(back within 3600 s)=0.00 < keep 0.5"),
        (1.0, WRITE_DOWN, DRAM, SSD, 3, "copied ahead of eviction: ssd has room"),
        (10.0, EVICT, DRAM, SSD, 1, pressure.format(600)),
        (20.0, EVICT, DRAM, SSD, 2, pressure.format(10)),
    ]
    assert logged(policy, "x") == logged(policy, "y") == []  # running: never evicted here


def test_a_running_session_evicted_under_pressure_is_logged_as_running(tmp_path: Path) -> None:
    policy = PlacementPolicy()
    run = opened(policy, kv.dram(4), kv.ssd(tmp_path / "lmdb"))
    with run.store:
        run.request("first", 0, 3, now=0.0)
        run.request("second", 1000, 3, now=5.0)  # both running: the older goes first
    assert logged(policy, "first") == [
        (5.0, EVICT, DRAM, SSD, 2, "pressure: dram full; session running"),
    ]

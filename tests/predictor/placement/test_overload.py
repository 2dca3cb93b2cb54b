"""The placement policy while the engine cannot keep up: it watches the chains of the
sessions started and not finished against the fastest tier, and falls back to LRU while
draining them would make a request wait past SSD's horizon (``placement.overload``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import kv
from support.sessions import opened

from kvstore import TierKind
from kvstore.predictor.learning.model import DEFAULT_HORIZONS
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.placement.overload import AdmissionWatch, OverloadConfig
from kvstore.predictor.placement.policy import PlacementConfig, PlacementPolicy

DRAM, SSD = TierKind.DRAM, TierKind.SSD


def forecast(session: str, at: float, *probabilities: float) -> ReturnForecast:
    return ReturnForecast(session, at, DEFAULT_HORIZONS, tuple(probabilities))


def test_the_watch_falls_back_while_the_queue_would_wait_past_its_threshold() -> None:
    """300 blocks started against room for 100: while one 10-block session finishes every
    10 s the 200 beyond the room drain in 200 s, and nothing changes; once finishes
    stop, the wait grows past 600 s and, held for 100 s, the watch falls back; once
    everything has finished it places again, 100 s later."""
    watch = AdmissionWatch(OverloadConfig(enter_wait_s=600, leave_wait_s=60, sustain_s=100))
    sessions = [f"s{i}" for i in range(30)]
    for session in sessions:
        watch.started(session, 10)
    now = 0.0
    for i in range(30):  # the engine keeps pace: a session out, a session in
        watch.update(now, room=100)
        watch.finished(sessions[i])
        watch.started(f"more{i}", 10)
        now += 10.0
    assert not watch.overloaded and watch.wait_s(room=100) == pytest.approx(200.0)
    fell_back = None
    while fell_back is None and now < 1000.0:  # nothing finishes any more
        if watch.update(now, room=100):
            fell_back = now
        now += 10.0
    assert fell_back is not None
    assert watch.wait_s(room=100) > 600.0
    for session in [*sessions, *(f"more{i}" for i in range(30))]:
        watch.finished(session)
    drained = now
    while watch.update(now, room=100):
        now += 10.0
    assert now == drained + 100.0
    assert watch.to_dict() == {
        "entered": 1,
        "overloaded_s": pytest.approx(now - fell_back),
        "held_back": 0,
        "late": 0,
    }


def test_while_started_chains_overflow_the_fast_tier_the_policy_evicts_and_waits_as_lru(
    tmp_path: Path,
) -> None:
    """Two idle chains, the older likelier back: the predictor would evict the newer one
    (``test_policy``'s ``test_victims_go_by_predicted_return_not_recency``). With a
    queue of started sessions needing twice DRAM, it evicts as LRU does, prefetches
    nothing for a resume, and places nobody until the queue has drained."""
    overload = OverloadConfig(sustain_s=20.0)
    policy = PlacementPolicy(PlacementConfig(check_min_s=10.0, overload=overload))
    run = opened(policy, kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        likely = run.request("likely", 0, 2, now=0.0)
        policy.on_idle(store, likely, forecast("likely", 1.0, 0.6, 0.7, 0.8), 1.0)
        later = run.request("later", 1000, 2, now=2.0)
        policy.on_idle(store, later, forecast("later", 3.0, 0.52, 0.55, 0.6), 3.0)
        queued = run.arrive("queued", 3000, 13, now=4.0)  # over twice DRAM's 6 blocks
        for now in (10.0, 20.0):
            policy.tick(store, now)
        assert not policy.watch.overloaded  # not for 20 s yet
        policy.tick(store, 30.0)
        assert policy.watch.overloaded
        run.request("new", 2000, 3, now=31.0)  # needs one slot more than is free
        assert run.where(0, 2) == [DRAM, SSD]  # LRU: the older chain's tail
        assert run.where(1000, 2) == [DRAM, DRAM]
        run.arrive("likely", 0, 2, now=32.0)
        assert run.where(0, 2) == [DRAM, SSD]  # no prefetch for a request that waits
        assert policy.prefetches.issued == 0
        assert policy.watch.held_back == 2  # the two resumes' prefetches
        policy.on_idle(store, queued, forecast("queued", 40.0, 0.1, 0.1, 0.1), 40.0)
        for now in (50.0, 60.0):
            policy.tick(store, now)
        assert policy.watch.overloaded  # drained, but not for 20 s yet
        policy.tick(store, 70.0)
        assert not policy.watch.overloaded
        assert policy.watch.to_dict() == {
            "entered": 1,
            "overloaded_s": pytest.approx(40.0),
            "held_back": 3,  # and the queued session's idle placement
            "late": 0,
        }


def test_a_daemon_that_only_hears_of_admitted_requests_never_falls_back(tmp_path: Path) -> None:
    """Reported at admission (vLLM), started chains are the running ones: a session
    reported started and finished before the next look leaves nothing behind."""
    policy = PlacementPolicy(PlacementConfig(overload=OverloadConfig(sustain_s=0.0)))
    run = opened(policy, kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        for i in range(20):
            now = 10.0 * i
            state = run.request(f"s{i}", 1000 * i, 5, now=now)
            policy.on_idle(store, state, forecast(f"s{i}", now + 1, 0.5, 0.6, 0.7), now + 1)
            policy.tick(store, now + 5)
        assert policy.watch.to_dict() == {
            "entered": 0,
            "overloaded_s": 0.0,
            "held_back": 0,
            "late": 0,
        }


def test_no_prefetch_is_made_for_a_request_that_would_be_admitted_after_it_left(
    tmp_path: Path,
) -> None:
    """Long before any fallback (``sustain_s`` is a day), a resume whose request waits
    behind a queue that drains slower than a block stays in DRAM prefetches nothing: the
    copy would leave unread. Once the queue is gone, a resume prefetches again."""
    policy = PlacementPolicy(PlacementConfig(overload=OverloadConfig(sustain_s=86_400.0)))
    run = opened(policy, kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        run.pushed_down({"a": 0, "b": 1000}, 2, (0.5, 0.6, 0.7), to=SSD)
        run.busy(2)  # DRAM holds something: its size in blocks is known
        queued = run.arrive("queued", 3000, 13, now=2.0)  # over twice DRAM, nothing drains
        run.arrive("a", 0, 2, now=3.0)
        assert run.where(0, 2) == [SSD, SSD]
        assert policy.prefetches.issued == 0
        assert not policy.watch.overloaded and policy.watch.late == 1
        policy.on_idle(store, queued, forecast("queued", 10.0, 0.1, 0.1, 0.1), 10.0)
        run.arrive("b", 1000, 2, now=11.0)  # nothing waits beyond DRAM's room now
        assert run.where(1000, 2) == [DRAM, DRAM]
        assert policy.prefetches.issued == 2 and policy.watch.late == 1

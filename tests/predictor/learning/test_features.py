"""Feature extraction on hand-built sessions: exact values, widths, missing history."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import numpy as np
import pytest

from kvstore.predictor.learning.features import FEATURES, feature_names, feature_vector
from kvstore.predictor.learning.sessions import SessionState, SessionTracker
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger

# Monday 2024-01-01, 06:00 UTC: a quarter into the day, 1/28 into the week.
MONDAY_6AM = datetime(2024, 1, 1, 6, tzinfo=UTC).timestamp()


def by_name(state: SessionState, now: float, tracker: SessionTracker) -> dict[str, float]:
    return dict(zip(feature_names(), feature_vector(state, now, tracker).tolist(), strict=True))


def test_hand_built_session_gives_exact_values() -> None:
    tracker = SessionTracker()
    state = SessionState(
        session="s",
        user=None,
        first_seen=MONDAY_6AM - 3600.0,
        requests=5,
        idle_since=MONDAY_6AM,
        gaps=[5.0, 900.0, 30.0],
        last_trigger=Trigger.TOOL,
        new_tokens=1023,
        last_steps=9,
        last_output_tokens=255,
        context_tokens=65535,
        tool_running=True,
    )
    f = by_name(state, MONDAY_6AM, tracker)
    assert f["hour_of_day[0]"] == pytest.approx(1.0)  # sin(2pi * 1/4)
    assert f["hour_of_day[1]"] == pytest.approx(0.0, abs=1e-6)
    assert f["weekday[0]"] == pytest.approx(math.sin(2 * math.pi / 28), rel=1e-6)
    assert f["weekday[1]"] == pytest.approx(math.cos(2 * math.pi / 28), rel=1e-6)
    assert f["session_age"] == pytest.approx(math.log1p(3600.0))
    assert f["requests"] == pytest.approx(math.log(6.0))
    assert f["last_steps"] == pytest.approx(math.log(10.0))
    assert f["last_output_tokens"] == pytest.approx(math.log(256.0))
    assert f["context_tokens"] == pytest.approx(math.log(65536.0))
    assert f["new_tokens"] == pytest.approx(math.log(1024.0))
    assert (f["last_gap[0]"], f["last_gap[1]"]) == (pytest.approx(math.log(31.0)), 0.0)
    assert f["mean_log_gap"] == pytest.approx((math.log(6) + math.log(901) + math.log(31)) / 3)
    assert f["long_gaps"] == pytest.approx(math.log(2.0))  # one gap over 10 min
    assert f["gap_count"] == pytest.approx(math.log(4.0))
    assert (f["trigger[0]"], f["trigger[1]"]) == (0.0, 1.0)  # Trigger order: USER, TOOL
    assert f["tool_running"] == 1.0


def test_missing_history_reads_zero_with_an_indicator() -> None:
    state = SessionState(session="new", user=None, first_seen=100.0, requests=1)
    f = by_name(state, 100.0, SessionTracker())
    assert (f["last_gap[0]"], f["last_gap[1]"]) == (0.0, 1.0)
    assert (f["mean_log_gap"], f["long_gaps"], f["gap_count"], f["session_age"]) == (0, 0, 0, 0)
    assert [f[f"user_history[{i}]"] for i in range(3)] == [0.0, 0.0, 1.0]
    assert (f["trigger[0]"], f["trigger[1]"]) == (0.0, 0.0)


def test_user_history_comes_from_the_users_other_sessions() -> None:
    tracker = SessionTracker()
    for session, gap in (("a", 9.0), ("b", 99.0)):
        tracker.started(RequestStarted(session, Trigger.USER, 10, 0, 0.0), user="u")
        tracker.finished(RequestFinished(session, 1, 1, 10, False, 0, 0, 1.0))
        tracker.started(RequestStarted(session, Trigger.USER, 10, 0, 1.0 + gap))
    state, _ = tracker.started(RequestStarted("c", Trigger.USER, 10, 0, 500.0), user="u")
    f = by_name(state, 500.0, tracker)
    assert f["user_history[0]"] == pytest.approx((math.log(10) + math.log(100)) / 2)
    assert f["user_history[1]"] == pytest.approx(math.log(3.0))
    assert f["user_history[2]"] == 0.0


def test_vector_matches_the_registry() -> None:
    state = SessionState(session="s", user=None, first_seen=0.0)
    vector = feature_vector(state, 10.0, SessionTracker())
    assert vector.dtype == np.float32
    assert len(vector) == len(feature_names()) == sum(width for _, width, _ in FEATURES)
    assert len(set(feature_names())) == len(feature_names())


def test_new_tokens_are_the_prompt_beyond_the_previous_context() -> None:
    tracker = SessionTracker()
    state, _ = tracker.started(RequestStarted("s", Trigger.USER, 3000, 0, 0.0))
    assert state.new_tokens == 3000  # a first request: all of it is new
    tracker.finished(RequestFinished("s", 1, 200, 3200, False, 0, 0, 5.0))
    state, _ = tracker.started(RequestStarted("s", Trigger.USER, 3250, 0, 60.0))
    assert state.new_tokens == 50  # a short follow-up question
    state = tracker.finished(RequestFinished("s", 1, 10, 3260, False, 0, 0, 61.0))
    assert by_name(state, 61.0, tracker)["new_tokens"] == pytest.approx(math.log(51.0))


def test_human_gaps_are_kept_apart_from_tool_gaps() -> None:
    tracker = SessionTracker()
    moments = [(0.0, Trigger.USER), (300.0, Trigger.USER), (305.0, Trigger.TOOL)]
    for at, trigger in moments:
        tracker.started(RequestStarted("s", trigger, 10, 0, at), user="u")
        tracker.finished(RequestFinished("s", 1, 5, 15, False, 0, 0, at + 1.0))
    state = tracker.get("s")
    assert state is not None
    assert state.gaps == [299.0, 4.0] and state.human_gaps == [299.0]
    f = by_name(state, 306.0, tracker)
    assert f["last_gap[0]"] == pytest.approx(math.log1p(4.0))  # the tool's
    assert f["last_human_gap[0]"] == pytest.approx(math.log1p(299.0))
    assert f["last_human_gap[1]"] == 0.0
    assert f["mean_log_human_gap"] == pytest.approx(math.log1p(299.0))
    assert (f["user_human_history[0]"], f["user_human_history[1]"]) == (
        pytest.approx(math.log1p(299.0)),
        0.0,
    )
    fresh = SessionTracker()
    fresh.started(RequestStarted("n", Trigger.USER, 10, 0, 0.0))
    new = fresh.finished(RequestFinished("n", 1, 5, 15, False, 0, 0, 1.0))
    g = by_name(new, 2.0, fresh)
    assert (g["last_human_gap[1]"], g["user_human_history[1]"]) == (1.0, 1.0)  # none yet

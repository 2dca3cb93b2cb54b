"""Features of a session at the moment it goes idle, one small function each.

Every feature is a function ``(state, now, tracker) -> values`` registered in
``FEATURES`` with its name and width; ``feature_vector`` concatenates them in
that order, so adding a feature is one function and one line, and a saved
model's input width changes exactly when the list does.

Choices that hold for all of them:

- Counts, sizes and durations enter as ``log1p``: human waits span seconds to
  days (TraceLab: p50 ~86 s, p99 ~14 h), and a linear model should see a
  factor of ten as one step, not a hundred.
- Clock features are cyclic (sin, cos), so 23:59 sits next to 00:00. They use
  UTC: the tracker does not know the user's time zone, and a model that learns
  per deployment absorbs a fixed offset.
- A missing history (no previous gap, no user) reads 0 and has its own
  indicator, so a linear model can tell "none yet" from "a very short one".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.predictor.learning.sessions import SessionState, SessionTracker
from kvstore.wire.events import Trigger

Feature = Callable[[SessionState, float, SessionTracker], Sequence[float]]

LONG_GAP = 600.0
"""A gap longer than this (seconds) counts as long: the human left, not just read the answer."""

_DAY = 86400.0
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday; Monday is 0


def _cyclic(fraction: float) -> list[float]:
    angle = 2.0 * math.pi * fraction
    return [math.sin(angle), math.cos(angle)]


def _mean_log(gaps: Sequence[float]) -> float:
    return sum(math.log1p(g) for g in gaps) / len(gaps) if gaps else 0.0


def hour_of_day(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return _cyclic((now % _DAY) / _DAY)


def weekday(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return _cyclic(((now / _DAY + _EPOCH_WEEKDAY) % 7.0) / 7.0)


def session_age(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(max(0.0, now - state.first_seen))]


def requests(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(state.requests)]


def last_steps(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(state.last_steps)]


def last_output_tokens(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(state.last_output_tokens)]


def context_tokens(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(state.context_tokens)]


def new_tokens(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    """What the last request added to the context: a short follow-up question is a chat
    in progress, a pasted document or a fresh prompt is more often a one-off."""
    return [math.log1p(state.new_tokens)]


def last_gap(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    """log1p of the previous gap, and 1 if there was none."""
    if not state.gaps:
        return [0.0, 1.0]
    return [math.log1p(state.gaps[-1]), 0.0]


def last_human_gap(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    """log1p of the previous gap a human ended, and 1 if there was none: the strongest
    single sign of the next human wait (tool gaps, seconds long, would drown it)."""
    if not state.human_gaps:
        return [0.0, 1.0]
    return [math.log1p(state.human_gaps[-1]), 0.0]


def mean_log_human_gap(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [_mean_log(state.human_gaps)]


def user_human_history(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    """Mean log human gap over the user's sessions, and 1 if there is none."""
    gaps = tracker.user_human_gaps(state.user)
    return [_mean_log(gaps), 0.0 if gaps else 1.0]


def mean_log_gap(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [_mean_log(state.gaps)]


def long_gaps(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(sum(1 for g in state.gaps if g > LONG_GAP))]


def gap_count(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [math.log1p(len(state.gaps))]


def user_history(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    """Mean log gap and log1p count over the user's sessions, and 1 if there is no history."""
    gaps = tracker.user_gaps(state.user)
    return [_mean_log(gaps), math.log1p(len(gaps)), 0.0 if gaps else 1.0]


def trigger(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    """One-hot of what started the request that just ended, in ``Trigger`` order."""
    return [1.0 if state.last_trigger is t else 0.0 for t in Trigger]


def tool_running(state: SessionState, now: float, tracker: SessionTracker) -> list[float]:
    return [1.0 if state.tool_running else 0.0]


FEATURES: list[tuple[str, int, Feature]] = [
    ("hour_of_day", 2, hour_of_day),
    ("weekday", 2, weekday),
    ("session_age", 1, session_age),
    ("requests", 1, requests),
    ("last_steps", 1, last_steps),
    ("last_output_tokens", 1, last_output_tokens),
    ("context_tokens", 1, context_tokens),
    ("new_tokens", 1, new_tokens),
    ("last_gap", 2, last_gap),
    ("last_human_gap", 2, last_human_gap),
    ("mean_log_human_gap", 1, mean_log_human_gap),
    ("mean_log_gap", 1, mean_log_gap),
    ("long_gaps", 1, long_gaps),
    ("gap_count", 1, gap_count),
    ("user_history", 3, user_history),
    ("user_human_history", 2, user_human_history),
    ("trigger", len(Trigger), trigger),
    ("tool_running", 1, tool_running),
]


def feature_names() -> list[str]:
    """One name per column of ``feature_vector``: ``name`` or ``name[i]`` for wide features."""
    names: list[str] = []
    for name, width, _ in FEATURES:
        names.extend([name] if width == 1 else [f"{name}[{i}]" for i in range(width)])
    return names


def feature_vector(state: SessionState, now: float, tracker: SessionTracker) -> np.ndarray:
    """Features of ``state`` at ``now`` (when it went idle): float32, in ``FEATURES`` order."""
    values: list[float] = []
    for name, width, feature in FEATURES:
        part = feature(state, now, tracker)
        assert len(part) == width, f"feature {name} gave {len(part)} values, declared {width}"
        values.extend(part)
    return np.asarray(values, dtype=np.float32)

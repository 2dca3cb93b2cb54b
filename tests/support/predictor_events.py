"""Session events for a real daemon's predictor, and a wait until it has worked them off.

Event times are given (the ``time`` field): the daemon's predictor runs on the clock
of the events it receives, so an hour of idle time is one event an hour later. These
streams keep a clock of their own (``T0``), so their daemons are told to take event
times that far from theirs (``OWN_CLOCK``); a daemon left at its defaults refuses an
event off its clock, and its predictor never sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from kvstore.wire.events import RequestFinished, RequestStarted, SessionEvent, Trigger

T0 = 1_800_000_000.0
OWN_CLOCK = {"event_time_ahead_s": 1e10, "event_time_behind_s": 1e10}
RETURNING_SESSIONS = 20  # sessions of ``returning_sessions()``, half of which come back


def post(client: httpx.Client, *events: SessionEvent) -> None:
    for event in events:
        response = client.post("/v1/events", json=event.to_json())
        assert response.status_code == 200 and response.json() == {"accepted": True}


def started(session: str, at: float) -> RequestStarted:
    return RequestStarted(session, Trigger.USER, 1000, 0, at)


def finished(session: str, at: float) -> RequestFinished:
    return RequestFinished(session, 2, 80, 1080, False, 0, 1000, at)


def returning_sessions() -> list[SessionEvent]:
    """``RETURNING_SESSIONS`` sessions, the even ones back 30 s after they finished and
    the odd ones never; an hour later every horizon has passed, so each is labelled at
    every horizon with both labels seen (every AUC defined), and a probe session goes
    idle after all labels are known."""
    events: list[SessionEvent] = []
    for i in range(RETURNING_SESSIONS):
        at = T0 + 10 * i
        events += [started(f"s{i}", at), finished(f"s{i}", at + 5)]
        if i % 2 == 0:
            events.append(started(f"s{i}", at + 35))
    events.sort(key=lambda event: event.time)
    return events + [started("probe", T0 + 4000), finished("probe", T0 + 4010)]


def stats(client: httpx.Client, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``/v1/stats`` once ``until(predictor part)`` holds (the queue is worked off)."""
    deadline = time.monotonic() + 20.0
    while True:
        body = client.get("/v1/stats").json()
        if until(body["predictor"]) or time.monotonic() > deadline:
            assert until(body["predictor"]), body["predictor"]
            return body
        time.sleep(0.05)


def processed(count: int) -> Callable[[dict[str, Any]], bool]:
    return lambda predictor: predictor["events_processed"] >= count

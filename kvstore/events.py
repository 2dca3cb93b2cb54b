"""Session events: what an engine tells the store about each request (``POST /v1/events``).

One schema for the client that sends them, the daemon that checks and keeps
them, and the return-time predictor that learns from them; the daemon's
token counters (``kvstore_client_tokens_total``) count them too. A client
reports::

    request_started   session, trigger (user | tool), prompt_tokens, cached_tokens
    request_finished  session, steps, output_tokens, context_tokens, tool_running,
                      loaded_tokens, recomputed_tokens

each with an optional ``time`` (Unix seconds; the daemon's clock if absent).
Unknown fields are refused, so a typo in a client is a 400, not a silently
missing feature. Events are advisory: a client drops one (and counts it)
rather than delay the engine.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.wire import ErrorCode, WireError

MAX_SESSION_CHARS = 256
_MAX_COUNT = 1 << 53  # JSON numbers stay exact below this


class EventKind(enum.Enum):
    REQUEST_STARTED = "request_started"
    REQUEST_FINISHED = "request_finished"


class Trigger(enum.Enum):
    """What started an engine request: a person, or a tool call returning."""

    USER = "user"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class RequestStarted:
    session: str
    trigger: Trigger
    prompt_tokens: int
    cached_tokens: int
    time: float

    kind = EventKind.REQUEST_STARTED

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.kind.value,
            "session": self.session,
            "trigger": self.trigger.value,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "time": self.time,
        }


@dataclass(frozen=True, slots=True)
class RequestFinished:
    session: str
    steps: int
    output_tokens: int
    context_tokens: int
    tool_running: bool
    loaded_tokens: int
    recomputed_tokens: int
    time: float

    kind = EventKind.REQUEST_FINISHED

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.kind.value,
            "session": self.session,
            "steps": self.steps,
            "output_tokens": self.output_tokens,
            "context_tokens": self.context_tokens,
            "tool_running": self.tool_running,
            "loaded_tokens": self.loaded_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "time": self.time,
        }


SessionEvent = RequestStarted | RequestFinished

_COUNTS = {
    EventKind.REQUEST_STARTED: ("prompt_tokens", "cached_tokens"),
    EventKind.REQUEST_FINISHED: (
        "steps",
        "output_tokens",
        "context_tokens",
        "loaded_tokens",
        "recomputed_tokens",
    ),
}
_OTHER_FIELDS = {
    EventKind.REQUEST_STARTED: {"event", "session", "time", "trigger"},
    EventKind.REQUEST_FINISHED: {"event", "session", "time", "tool_running"},
}


def parse_event(data: Any) -> SessionEvent:
    """Validate one event body; any problem is ``bad_request``."""
    if not isinstance(data, Mapping):
        raise _bad("an event must be a JSON object")
    try:
        kind = EventKind(data.get("event"))
    except ValueError:
        raise _bad(f"event must be one of {[k.value for k in EventKind]}") from None
    unknown = set(data) - _OTHER_FIELDS[kind] - set(_COUNTS[kind])
    if unknown:
        raise _bad(f"unknown field(s) for {kind.value}: {sorted(unknown)}")
    session = data.get("session")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS:
        raise _bad(f"session must be a string of 1 to {MAX_SESSION_CHARS} characters")
    counts = {name: _count(data, name) for name in _COUNTS[kind]}
    when = _time(data.get("time"))
    if kind is EventKind.REQUEST_STARTED:
        try:
            trigger = Trigger(data.get("trigger"))
        except ValueError:
            raise _bad("trigger must be 'user' or 'tool'") from None
        return RequestStarted(session=session, trigger=trigger, time=when, **counts)
    tool_running = data.get("tool_running")
    if not isinstance(tool_running, bool):
        raise _bad("tool_running must be true or false")
    return RequestFinished(session=session, tool_running=tool_running, time=when, **counts)


def _count(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
        raise _bad(f"{name} must be a non-negative integer")
    return value


def _time(value: Any) -> float:
    if value is None:
        return time.time()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad("time must be a finite number of Unix seconds")
    return float(value)


def _bad(message: str) -> WireError:
    return WireError(ErrorCode.BAD_REQUEST, message)

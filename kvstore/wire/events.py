"""Session events: what an engine tells the store about each request (``POST /v1/events``).

One schema for the client that sends them, the daemon that checks and keeps
them, and the return-time predictor that learns from them; the daemon's
token counters (``kvstore_client_tokens_total``) count them too. A client
reports::

    request_started   session, trigger (user | tool), prompt_tokens, cached_tokens,
                      idle_since (optional), user (optional)
    request_finished  session, steps, output_tokens, context_tokens, tool_running,
                      loaded_tokens, recomputed_tokens

each with an optional ``time`` (Unix seconds; the daemon's clock if absent, and
refused by the daemon if too far from its clock: ``DaemonConfig.event_time_*``)
and an optional chain: ``namespace`` (hex digest) and ``keys`` (hex chunk
keys, head first) of the request's prompt (started) or of prompt plus output
(finished). The chain is what lets the daemon's placement policy move a
session's KV (``kvstore.predictor.service``); without it the daemon uses the
chain of the session's latest put. ``session`` may be left out of an event
that carries keys: the daemon then infers the session from the chain (a
request whose keys extend an earlier request's keys continues its session),
and the event's ``session`` reads ``UNNAMED``.

``idle_since`` (Unix seconds, at most ``time`` and at most ``MAX_IDLE_S`` before it)
says when the session's previous request finished, on whichever host ran it: a
session an engine moved to this daemon from another keeps its last gap in its
history, and an idle period that began here but ended on another host is not
labelled here as if this daemon had seen its end (``learning.sessions``).

``user`` (a string of 1 to ``MAX_SESSION_CHARS`` characters: an account, a
tenant's user id, a terminal) names who drives the session. It sticks to the
session once given. The predictor reads the user's earlier waits as features,
and when a user starts a new session it forecasts that user's other idle
sessions again: a person who opened a new conversation is less often back at
the old one soon (``learning.online``).

An event with a chain may also travel as ``EVENT_CONTENT_TYPE``: its JSON
object without ``keys``, a newline, then the keys back to back, 16 bytes each
(``event_to_bytes``). A 119K-token context in 16-token blocks is 7,438 keys:
encoding them as hex JSON held an engine's interpreter (and so its
scheduler's thread) for milliseconds per event; joining them costs a
fraction of one.

Unknown fields are refused, so a typo in a client is a 400, not a silently
missing feature. Events are advisory: a client drops one (and counts it)
rather than delay the engine.
"""

from __future__ import annotations

import enum
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.keys import ChunkKey
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.messages import (
    digest_from_hex,
    keys_from_bytes,
    keys_from_json,
    keys_to_bytes,
    keys_to_json,
)

MAX_SESSION_CHARS = 256
MAX_EVENT_KEYS = 1 << 16
"""Keys one event may carry: a 16M-token context in 256-token chunks."""
EVENT_CONTENT_TYPE = "application/x-kvstore-event"
"""An event as its JSON object (``keys`` left out), a newline, then its raw keys."""
UNNAMED = ""
"""``session`` of an event that named none: the daemon infers it from the event's keys."""
_MAX_COUNT = 1 << 53  # JSON numbers stay exact below this
MAX_IDLE_S = 30 * 86400.0
"""How long before its request a session's ``idle_since`` may lie."""


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
    namespace: bytes | None = None
    keys: tuple[ChunkKey, ...] = ()
    idle_since: float | None = None
    user: str | None = None

    kind = EventKind.REQUEST_STARTED

    def to_json(self) -> dict[str, Any]:
        body = {
            "event": self.kind.value,
            "session": self.session,
            "trigger": self.trigger.value,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "time": self.time,
        }
        if self.idle_since is not None:
            body["idle_since"] = self.idle_since
        if self.user is not None:
            body["user"] = self.user
        return _with_chain(self, body)


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
    namespace: bytes | None = None
    keys: tuple[ChunkKey, ...] = ()

    kind = EventKind.REQUEST_FINISHED

    def to_json(self) -> dict[str, Any]:
        return _with_chain(
            self,
            {
                "event": self.kind.value,
                "session": self.session,
                "steps": self.steps,
                "output_tokens": self.output_tokens,
                "context_tokens": self.context_tokens,
                "tool_running": self.tool_running,
                "loaded_tokens": self.loaded_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "time": self.time,
            },
        )


SessionEvent = RequestStarted | RequestFinished


def _with_chain(event: SessionEvent, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` plus the event's chain, if it has one; an unnamed session is left out."""
    if event.session == UNNAMED:
        del body["session"]
    if event.keys:
        assert event.namespace is not None, "keys belong to a namespace"
        body["namespace"] = event.namespace.hex()
        body["keys"] = keys_to_json(event.keys)
    return body


def event_to_bytes(event: SessionEvent) -> bytes:
    """``event`` as ``EVENT_CONTENT_TYPE``: its JSON object, a newline, its raw keys."""
    body = event.to_json()
    body.pop("keys", None)
    return json.dumps(body).encode() + b"\n" + keys_to_bytes(event.keys)


def parse_event_bytes(body: bytes) -> SessionEvent:
    """Validate one ``EVENT_CONTENT_TYPE`` body; any problem is ``bad_request``."""
    head, newline, keys = body.partition(b"\n")
    if not newline:
        raise _bad("an event's JSON object ends with a newline, then come its keys")
    try:
        data = json.loads(head)
    except ValueError:
        raise _bad("an event must be a JSON object") from None
    if isinstance(data, Mapping) and "keys" in data:
        raise _bad("this form carries its keys after the JSON object, not in it")
    return parse_event(data, tuple(keys_from_bytes(keys, MAX_EVENT_KEYS)))


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
_CHAIN_FIELDS = {"namespace", "keys"}
_OTHER_FIELDS = {
    EventKind.REQUEST_STARTED: {
        "event",
        "session",
        "time",
        "trigger",
        "idle_since",
        "user",
        *_CHAIN_FIELDS,
    },
    EventKind.REQUEST_FINISHED: {"event", "session", "time", "tool_running", *_CHAIN_FIELDS},
}


def parse_event(data: Any, raw_keys: tuple[ChunkKey, ...] | None = None) -> SessionEvent:
    """Validate one event body; any problem is ``bad_request``. ``raw_keys``: the keys
    that came after its JSON object (``parse_event_bytes``)."""
    if not isinstance(data, Mapping):
        raise _bad("an event must be a JSON object")
    try:
        kind = EventKind(data.get("event"))
    except ValueError:
        raise _bad(f"event must be one of {[k.value for k in EventKind]}") from None
    unknown = set(data) - _OTHER_FIELDS[kind] - set(_COUNTS[kind])
    if unknown:
        raise _bad(f"unknown field(s) for {kind.value}: {sorted(unknown)}")
    namespace, keys = _chain(data, raw_keys)
    session = data.get("session", UNNAMED if keys else None)
    named = isinstance(session, str) and 0 < len(session) <= MAX_SESSION_CHARS
    if not named and not (session == UNNAMED and keys):
        raise _bad(
            f"session must be a string of 1 to {MAX_SESSION_CHARS} characters "
            "(it may be left out only when keys are given)"
        )
    counts = {name: _count(data, name) for name in _COUNTS[kind]}
    common = {"session": session, "time": _time(data.get("time")), **counts}
    if kind is EventKind.REQUEST_STARTED:
        try:
            trigger = Trigger(data.get("trigger"))
        except ValueError:
            raise _bad("trigger must be 'user' or 'tool'") from None
        idle_since = _idle_since(data.get("idle_since"), common["time"])
        user = data.get("user")
        if user is not None and not (isinstance(user, str) and 0 < len(user) <= MAX_SESSION_CHARS):
            raise _bad(f"user must be a string of 1 to {MAX_SESSION_CHARS} characters")
        return RequestStarted(
            trigger=trigger,
            namespace=namespace,
            keys=keys,
            idle_since=idle_since,
            user=user,
            **common,
        )
    tool_running = data.get("tool_running")
    if not isinstance(tool_running, bool):
        raise _bad("tool_running must be true or false")
    return RequestFinished(tool_running=tool_running, namespace=namespace, keys=keys, **common)


def _chain(
    data: Mapping[str, Any], raw_keys: tuple[ChunkKey, ...] | None
) -> tuple[bytes | None, tuple[ChunkKey, ...]]:
    """The event's ``namespace`` and keys (``raw_keys`` when they came raw, else the
    JSON ``keys``): both or neither."""
    has_keys = "keys" in data or bool(raw_keys)
    if not has_keys and "namespace" not in data:
        return None, ()
    if not has_keys or "namespace" not in data:
        raise _bad("namespace and keys come together")
    keys = raw_keys or tuple(keys_from_json(data["keys"], MAX_EVENT_KEYS))
    if not keys:
        raise _bad("keys must not be empty (leave out namespace and keys instead)")
    return digest_from_hex(data["namespace"]), keys


def _count(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
        raise _bad(f"{name} must be a non-negative integer")
    return value


def _time(value: Any) -> float:
    if value is None:
        return time.time()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad("time must be a finite number of Unix seconds")
    try:
        seconds = float(value)
    except OverflowError:  # an integer past the largest double
        seconds = math.inf
    if not math.isfinite(seconds):
        raise _bad("time must be a finite number of Unix seconds")
    return seconds


def _idle_since(value: Any, started: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad("idle_since must be a finite number of Unix seconds")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or not started - MAX_IDLE_S <= seconds <= started:
        raise _bad(f"idle_since must lie between {MAX_IDLE_S:g} s before the request's time and it")
    return seconds


def _bad(message: str) -> WireError:
    return WireError(ErrorCode.BAD_REQUEST, message)

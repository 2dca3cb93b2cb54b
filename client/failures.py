"""What goes wrong between a client and the daemon, whether the caller hears of it, and
the counts of what degraded (``ClientStats``).

Two kinds of failure, told apart here and nowhere else:

* **The daemon cannot serve** (down, stopped, too slow, restarting, a 5xx, an
  answer that breaks the format): ``TierUnavailable("daemon", ...)``. The
  engine must never stall or crash on this, so ``lookup``, ``get``, ``put``
  and the session events *degrade* (nothing cached, misses, dropped) and
  count it in ``ClientStats``; ``delete`` and ``stats`` raise it, because
  their caller asked for a fact the client cannot make up.
* **The request is wrong** (a 4xx): the daemon's error code mapped back to the
  exception the embedded store raises (``kvstore.wire.exception_from_body``),
  raised by every method: ``LayoutMismatch``, ``RequestTooLarge``,
  ``CorruptBlock`` (a put block that changed after it was checksummed), and
  ``KVStoreError("unauthorized: ...")`` for a missing or wrong token.
  ``unknown_namespace`` is the exception to the rule: the client re-registers
  and retries once, since it only means the daemon restarted.

httpx's exceptions are translated in ``from_transport``, the one boundary;
nothing above it sees an httpx type.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from kvstore.errors import KVStoreError, TierUnavailable
from kvstore.wire.codes import exception_from_body

T = TypeVar("T")

DAEMON = "daemon"


@dataclass
class ClientStats:
    """Counts since the client was created; mutated by ``ClientProtocol`` under its lock.

    ``*_failed`` / ``*_dropped`` count calls that degraded because the daemon
    could not serve them (down, too slow, 5xx, a malformed answer): a failed
    lookup answered "nothing cached", a failed get answered misses, a dropped
    put or event was not stored. ``events_rejected`` counts session events the
    daemon refused (a time too far from its clock: the engine's clock is off);
    they are dropped, never raised. ``corrupt_blocks`` counts received blocks
    that failed verification and were turned into misses. ``device_fallbacks``
    counts HBM blocks leased for a device copy that were fetched as bytes
    instead (``client.device``: the arena would not open, an ``out=`` tensor on
    another device, a header that did not fit, a generation that moved).
    """

    lookups_failed: int = 0
    gets_failed: int = 0
    puts_dropped: int = 0
    events_dropped: int = 0
    events_rejected: int = 0
    corrupt_blocks: int = 0
    device_fallbacks: int = 0

    def snapshot(self) -> ClientStats:
        return dataclasses.replace(self)


def unavailable(detail: str) -> TierUnavailable:
    return TierUnavailable(DAEMON, detail)


def answer_field(body: Any, name: str, kind: type[T]) -> T:
    """``body[name]``, which must be a ``kind``; a daemon that answers otherwise is broken."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise unavailable(f"malformed response: no {kind.__name__} {name!r} in {body!r:.200}")
    return value


def from_transport(error: httpx.HTTPError) -> TierUnavailable:
    """The daemon could not be reached, or did not answer in time."""
    return unavailable(f"{type(error).__name__}: {error or 'no detail'}")


def from_reply(status: int, content: bytes) -> KVStoreError:
    """The exception an error response stands for (5xx: unavailable; 4xx: the mapped one)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if status >= 500:
        try:
            message = str(body["error"]["message"])
        except (KeyError, TypeError):
            message = "no detail"
        return unavailable(f"HTTP {status}: {message}")
    return exception_from_body(status, body)

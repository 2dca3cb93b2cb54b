"""What goes wrong between a client and the daemon, and whether the caller hears of it.

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

import json

import httpx

from kvstore.errors import KVStoreError, TierUnavailable
from kvstore.wire import exception_from_body

DAEMON = "daemon"


def unavailable(detail: str) -> TierUnavailable:
    return TierUnavailable(DAEMON, detail)


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

"""One HTTP exchange, as the client's operations see it: the ``Call`` an operation
asks for and the ``Reply`` it is resumed with (``protocol`` writes the operations,
the shells send the calls), and reading an answer back into values or errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from kvstore.client.blocks import FramesSink, tier_of
from kvstore.client.failures import from_reply, unavailable
from kvstore.client.put_body import PutBody
from kvstore.store.stats import StoreStats, TierCounters
from kvstore.wire.frames import FRAMES_CONTENT_TYPE
from kvstore.wire.messages import API_PREFIX, KEYS_CONTENT_TYPE

T = TypeVar("T")

# Calls a shell sends in the background at once (``Call.wait=False``); past
# that, it sends the next one in place. Each is a lease the daemon still holds.
MAX_DETACHED_CALLS = 16


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP exchange an operation asks for.

    ``body`` is a frames body, sent piece by piece without joining; ``content``
    raw bytes of ``content_type`` (a lookup's keys, an event with its keys); ``sink``
    receives a ``200`` frames answer as it streams in (any other answer is
    read whole into ``Reply.content``). ``retry``: safe to send again when a
    connection died before any answer (every call but events is idempotent:
    a key names its content). ``wait=False``: nothing depends on the answer
    (a lease release), so the shell may send it in the background, resume
    the operation at once with ``Reply(202)``, and only log how it went.

    ``delay_s`` (``wait=False`` only): the shell holds the call back this long
    before sending it in the background. ``due``: asked just before the call
    is sent, by any shell, however it sends it; ``False`` means what the call
    was for was done another way (a lease released with a get), so it is
    not sent, and answers ``Reply(202)`` if anything waits.
    """

    method: str
    path: str
    json: Any = None
    body: PutBody | None = None
    content: bytes | None = None
    content_type: str = KEYS_CONTENT_TYPE
    sink: FramesSink | None = None
    retry: bool = True
    wait: bool = True
    delay_s: float = 0.0
    due: Callable[[], bool] | None = None

    @property
    def headers(self) -> dict[str, str]:
        if self.content is not None:
            return {"Content-Type": self.content_type}
        if self.body is None:
            return {}
        return {"Content-Type": FRAMES_CONTENT_TYPE, "Content-Length": str(self.body.nbytes)}


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a ``Call``; ``content`` is empty when it streamed into the sink."""

    status: int
    content: bytes = b""


Operation = Generator[Call, Reply, T]


def post(path: str, request: Any = None, **options: Any) -> Call:
    return Call("POST", f"{API_PREFIX}{path}", request, **options)


def checked(reply: Reply) -> Any:
    """The JSON of a ``200`` reply; the mapped error of any other."""
    if reply.status != 200:
        raise from_reply(reply.status, reply.content)
    if not reply.content:
        return None
    try:
        return json.loads(reply.content)
    except ValueError:
        raise unavailable("malformed response: not JSON") from None


def store_stats(data: dict[str, Any]) -> StoreStats:
    """``StoreStats.to_dict()`` parsed back; fields this version does not know are skipped."""
    counters = {spec.name for spec in fields(TierCounters)}
    scalars = {spec.name for spec in fields(StoreStats)} - {"tiers"}
    try:
        return StoreStats(
            **{name: int(value) for name, value in data.items() if name in scalars},
            tiers={
                tier_of(label): TierCounters(
                    **{name: int(value) for name, value in tier.items() if name in counters}
                )
                for label, tier in data.get("tiers", {}).items()
            },
        )
    except (AttributeError, TypeError, ValueError):
        raise unavailable("malformed response: bad store stats") from None

"""The daemon's memory of recent session events (``kvstore.wire.events`` has the schema).

The daemon keeps the most recent ``events_kept`` events in an ``EventLog``
ring, a record for operators and tests; the event loop is its only writer.
The return-time predictor does not read the ring: each event is handed to
``kvstore.predictor.service`` as it arrives, whose own queue keeps them in
order until they are learnt from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvstore.wire.events import SessionEvent


class EventLog:
    """The most recent session events, oldest first (a bounded ring)."""

    def __init__(self, capacity: int) -> None:
        self._events: deque[SessionEvent] = deque(maxlen=capacity)
        self.received = 0

    def append(self, event: SessionEvent) -> None:
        self._events.append(event)
        self.received += 1

    def recent(self, limit: int | None = None) -> list[SessionEvent]:
        events = list(self._events)
        return events if limit is None else events[-limit:]

    def __iter__(self) -> Iterator[SessionEvent]:
        return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)

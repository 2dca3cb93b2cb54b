"""A circuit breaker: after a backend fails, stop calling it until a probe finds it
answering again. One per tier (``kvstore.store.guarded``), and one per master of a
Redis Cluster (``kvstore.tiers.redis_tier``), so that one dead master does not take
the others out with it.

A tier that hangs (a stopped Redis, a dead NFS mount) costs its socket timeout
on every call. Calls that wait on it hold up whatever they hold: the store
lock during a write-back, a worker thread of the daemon, the engine's request.
One timed-out call is the price of learning the tier is down; every later one
is waste. So the first failure opens the breaker: calls are answered at once
as a miss (or a failed write) without touching the backend, and a probe on
its own thread (``Prober``), never on a request's clock, asks the backend
again after a pause that doubles while it stays down (``min_open_s`` to
``max_open_s``). The first probe that succeeds closes the breaker.

What a request pays during an outage is therefore one timeout per breaker
trip, not one per call, and a hit in a faster tier pays nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerConfig:
    """How long a tripped breaker stays open before its first probe, and at most."""

    min_open_s: float = 0.5
    max_open_s: float = 10.0


class CircuitBreaker:
    """Closed (calls go through) or open (calls are refused); thread safe.

    ``probe`` is a cheap call to the backend that raises when it fails; it runs
    on the breaker's own thread while the breaker is open.
    """

    def __init__(
        self,
        name: str,
        probe: Callable[[], object],
        config: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config or BreakerConfig()
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._open = False
        self._open_for = self.config.min_open_s
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.trips = 0  # times it opened
        self.refused = 0  # calls answered without the backend
        self.opened_at: float | None = None

    def probe(self) -> bool:
        """Call the probe once, on the caller's thread (raises as the backend does)."""
        self._probe()
        return True

    @property
    def is_open(self) -> bool:
        return self._open

    def allow(self) -> bool:
        """Whether a call may go to the backend now (counts it as refused if not)."""
        if not self._open:
            return True
        with self._lock:
            self.refused += 1
        return False

    def failed(self) -> None:
        """A call to the backend failed: open, and start probing if not already."""
        with self._lock:
            if self._open or self._closing:
                return
            self._open = True
            self._open_for = self.config.min_open_s
            self.opened_at = self._clock()
            self.trips += 1
            self._wake.clear()
            self._thread = threading.Thread(
                target=self._probe_until_closed, name=f"kvstore-breaker ({self.name})", daemon=True
            )
            thread = self._thread
        logger.warning("%s failed: calls to it are answered as misses until it recovers", self.name)
        thread.start()

    def close(self) -> None:
        """Stop probing (the tier is closing)."""
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _probe_until_closed(self) -> None:
        while True:
            if self._wake.wait(self._open_for):
                return  # closing
            try:
                self._probe()
            except Exception:  # noqa: BLE001 - any failure means still down
                self._open_for = min(2 * self._open_for, self.config.max_open_s)
                continue
            with self._lock:
                down_s = self._clock() - (self.opened_at or self._clock())
                self._open = False
                self._thread = None
            logger.warning("%s answers again after %.1f s", self.name, down_s)
            return

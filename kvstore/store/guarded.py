"""``GuardedTier``: a tier seen through the store's failure policy.

A tier raises ``TierError`` when its backend fails. For the store a failure
is a miss (the engine recomputes), never an exception out of ``lookup`` or
``get``; this wrapper is the one place that turns errors into "nothing",
counts them, and lets ``TierFull`` through, because admission answers it by
evicting. A failure also trips the tier's ``CircuitBreaker``: until a probe
finds the backend answering again, calls are answered as "nothing" at once
(``calls_refused``), so a hung backend costs one timeout, not one per call.
A write the backend answered and refused (``TierRefused``: a full disk) is a
counted failure that trips nothing: the tier still serves reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.block import Block
from kvstore.breaker import BreakerConfig, CircuitBreaker
from kvstore.errors import TierError, TierFull, TierRefused
from kvstore.keys import KEY_BYTES, ChunkKey
from kvstore.store.stats import TierCounters
from kvstore.tiers.base import (
    BlockDestination,
    Buffer,
    ServerMemory,
    ServerOwnedTier,
    StoredBlockInfo,
    Tier,
)

_T = TypeVar("_T")
logger = logging.getLogger(__name__)

# What a probe asks a tripped tier: whether it holds a key nobody stores.
_PROBE_NAMESPACE = bytes(KEY_BYTES)
_PROBE_KEYS = [ChunkKey(bytes(KEY_BYTES))]
# How long an answer of a shared tier's servers about their memory is reused.
_SERVER_MEMORY_MAX_AGE_S = 5.0


class GuardedTier:
    """Wraps a ``Tier``; failed calls return ``None`` (or 0) and count an error."""

    def __init__(
        self,
        tier: Tier,
        counters: TierCounters,
        lock: threading.RLock,
        breaker: BreakerConfig | None = None,
    ) -> None:
        self.tier = tier
        self.kind = tier.kind
        self.verifies_reads = tier.verifies_reads
        self._counters = counters
        self._lock = lock
        self.breaker = CircuitBreaker(
            f"tier {tier.kind.label}",
            lambda: tier.contains_many(_PROBE_NAMESPACE, _PROBE_KEYS),
            breaker,
        )
        self._server_memory: tuple[float, ServerMemory | None] | None = None

    def get_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[Buffer | None] | None:
        return self._guard(lambda: self.tier.get_many(namespace, keys))

    def get_many_into(
        self,
        namespace: bytes,
        keys: Sequence[ChunkKey],
        destinations: Sequence[BlockDestination],
    ) -> list[bool] | None:
        return self._guard(lambda: self.tier.get_many_into(namespace, keys, destinations))

    def contains_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[bool] | None:
        return self._guard(lambda: self.tier.contains_many(namespace, keys))

    def delete_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> int:
        return self._guard(lambda: self.tier.delete_many(namespace, keys)) or 0

    def scan(self) -> list[StoredBlockInfo] | None:
        return self._guard(lambda: list(self.tier.scan()))

    def put_many(self, namespace: bytes, items: Sequence[tuple[ChunkKey, Block]]) -> bool:
        """Store the batch; ``False`` if the tier failed or is down. ``TierFull``
        propagates."""
        if not self._allowed():
            return False
        try:
            self.tier.put_many(namespace, items)
        except TierFull:
            raise
        except TierRefused:
            self._count_error()
            return False
        except TierError:
            self._failed()
            return False
        return True

    def check(self) -> bool:
        """Ask the backend whether it answers (a start-up check); if not, say so and trip
        the breaker, so the store starts on its other tiers and recovers on its own."""
        if self._guard(self.breaker.probe) is not None:
            return True
        logger.warning(
            "tier %s does not answer at start: serving without it until it does",
            self.kind.label,
        )
        return False

    def used_bytes(self) -> int:
        return self._guard(self.tier.used_bytes) or 0

    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes()

    def server_memory(self) -> ServerMemory | None:
        """What a shared tier's servers say of their memory (reused for a few seconds, as a
        scrape asks every time); ``None`` for a tier with no servers, or none answering.
        Call it without the store's lock: it may cost a round trip."""
        if not isinstance(self.tier, ServerOwnedTier):
            return None
        now = time.monotonic()
        cached = self._server_memory
        if cached is not None and now - cached[0] < _SERVER_MEMORY_MAX_AGE_S:
            return cached[1]
        memory = self._guard(self.tier.server_memory)
        self._server_memory = (now, memory)
        return memory

    def close(self) -> None:
        self.breaker.close()
        self.tier.close()

    def _guard(self, call: Callable[[], _T]) -> _T | None:
        if not self._allowed():
            return None
        try:
            return call()
        except TierError:
            self._failed()
            return None

    def _allowed(self) -> bool:
        if self.breaker.allow():
            return True
        with self._lock:
            self._counters.calls_refused += 1
        return False

    def _failed(self) -> None:
        self._count_error()
        self.breaker.failed()

    def _count_error(self) -> None:
        with self._lock:
            self._counters.errors += 1

"""``GuardedTier``: a tier seen through the store's failure policy.

A tier raises ``TierError`` when its backend fails. For the store a failure
is a miss (the engine recomputes), never an exception out of ``lookup`` or
``get``; this wrapper is the one place that turns errors into "nothing",
counts them, and lets ``TierFull`` through, because admission answers it by
evicting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.block import Block
from kvstore.errors import TierError, TierFull
from kvstore.keys import ChunkKey
from kvstore.store.stats import TierCounters
from kvstore.tiers.base import BlockDestination, Buffer, StoredBlockInfo, Tier

_T = TypeVar("_T")


class GuardedTier:
    """Wraps a ``Tier``; failed calls return ``None`` (or 0) and count an error."""

    def __init__(self, tier: Tier, counters: TierCounters, lock: threading.RLock) -> None:
        self.tier = tier
        self.kind = tier.kind
        self.verifies_reads = tier.verifies_reads
        self._counters = counters
        self._lock = lock

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
        """Store the batch; ``False`` if the tier failed. ``TierFull`` propagates."""
        try:
            self.tier.put_many(namespace, items)
        except TierFull:
            raise
        except TierError:
            self._count_error()
            return False
        return True

    def used_bytes(self) -> int:
        return self._guard(self.tier.used_bytes) or 0

    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes()

    def close(self) -> None:
        self.tier.close()

    def _guard(self, call: Callable[[], _T]) -> _T | None:
        try:
            return call()
        except TierError:
            self._count_error()
            return None

    def _count_error(self) -> None:
        with self._lock:
            self._counters.errors += 1

"""The baselines the predictor's policy is measured against: plain LRU, and a fixed
idle timeout (``TTLPolicy``). Both have the session hooks of ``SessionPolicy``, so
the daemon and the replay drive every policy the same way."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.keys import ChunkKey
from kvstore.predictor.placement.hooks import (
    Forecast,
    IdleSession,
    PrefetchStats,
    session_namespace,
)
from kvstore.store.eviction import LRUPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.kinds import TierKind


class LRUBaseline(LRUPolicy):
    """The store's LRU with session hooks that do nothing: the ``lru`` baseline."""

    def __init__(self) -> None:
        super().__init__()
        self.prefetches = PrefetchStats()

    def on_idle(
        self, store: TieredStore, state: IdleSession, forecast: Forecast | None, now: float
    ) -> TierKind | None:
        return None

    def on_resume(self, store: TieredStore, state: IdleSession, now: float) -> None:
        return None

    def tick(self, store: TieredStore, now: float) -> None:
        return None


class TTLPolicy(LRUBaseline):
    """A fixed idle timeout: a session idle ``seconds`` has its blocks demoted out of HBM.

    Only blocks nobody touched for ``seconds`` move, so a prefix that other
    sessions keep using stays hot. Eviction under pressure is LRU.
    """

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self._now = 0.0
        self._touched: dict[ChunkKey, float] = {}  # HBM key -> last access (hook time)
        self._idle: dict[str, tuple[float, IdleSession]] = {}  # session -> (idle since, state)

    def on_access(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None = None
    ) -> None:
        super().on_access(tier, keys, session)
        if tier is TierKind.HBM:
            for key in keys:
                self._touched[key] = self._now

    def on_remove(self, tier: TierKind, key: ChunkKey) -> None:
        super().on_remove(tier, key)
        if tier is TierKind.HBM:
            self._touched.pop(key, None)

    def on_idle(
        self, store: TieredStore, state: IdleSession, forecast: Forecast | None, now: float
    ) -> TierKind | None:
        self._now = now
        self._idle.pop(state.session, None)  # re-inserted last: the dict stays in idle order
        self._idle[state.session] = (now, state)
        return TierKind.HBM

    def on_resume(self, store: TieredStore, state: IdleSession, now: float) -> None:
        self._now = now
        self._idle.pop(state.session, None)

    def tick(self, store: TieredStore, now: float) -> None:
        self._now = now
        expired = []
        for session, (since, _) in self._idle.items():  # oldest idle first
            if now - since < self.seconds:
                break
            expired.append(session)
        for session in expired:
            _, state = self._idle.pop(session)
            namespace = session_namespace(store, state)
            if namespace is None:
                continue
            stale = [
                key
                for key in state.chain
                if key in self._touched and now - self._touched[key] >= self.seconds
            ]
            if stale:
                store.demote(namespace, stale, to=TierKind.DRAM)

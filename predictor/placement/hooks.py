"""What the session policies share: the protocols they read forecasts and sessions
through, the protocol they offer the daemon and the replay, and prefetch accounting.

A policy is two things at once: an ``EvictionPolicy`` (``kvstore.store.eviction``)
plugged into the store, and a session policy with three hooks the daemon or
the replay calls (``on_idle``, ``on_resume``, ``tick``), each taking ``now``.
``placement.policy`` has the predictor's policy, ``placement.baselines`` the
LRU and fixed-TTL baselines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.errors import UnknownNamespace
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import Trigger


class Forecast(Protocol):
    """What a policy reads of a forecast (``online.ReturnForecast`` is one)."""

    @property
    def session(self) -> str: ...

    @property
    def at(self) -> float: ...

    @property
    def horizons(self) -> tuple[float, ...]:
        """Where the forecast is made; ``within`` interpolates between them."""
        ...

    def within(self, seconds: float) -> float:
        """P(the session returns within ``seconds`` of going idle at ``at``)."""
        ...


class IdleSession(Protocol):
    """What a policy reads of a session (``sessions.SessionState`` is one)."""

    @property
    def session(self) -> str: ...

    @property
    def namespace(self) -> bytes | None: ...

    @property
    def chain(self) -> tuple[ChunkKey, ...]: ...

    @property
    def tool_running(self) -> bool: ...

    @property
    def last_trigger(self) -> Trigger | None:
        """What began the session's latest request: a human, or a tool result."""
        ...


class SessionPolicy(EvictionPolicy, Protocol):
    """An eviction policy that also hears about sessions (every policy in this module)."""

    @property
    def prefetches(self) -> PrefetchStats:
        """What became of the policy's prefetches (the replay charges copies in flight)."""
        ...

    def on_idle(
        self, store: TieredStore, state: IdleSession, forecast: Forecast | None, now: float
    ) -> TierKind | None:
        """``state`` went idle; place its chain. Returns the tier it is kept in (None: not
        placed by this policy)."""
        ...

    def on_resume(self, store: TieredStore, state: IdleSession, now: float) -> None:
        """A request of ``state`` began: its lookup comes next."""
        ...

    def on_forecast(
        self, store: TieredStore, state: IdleSession, forecast: Forecast, now: float
    ) -> None:
        """``state``, still idle, was forecast again at ``now`` (``forecast.at``): place it by
        the new forecast from now on."""
        ...

    def tick(self, store: TieredStore, now: float) -> None:
        """Timer: re-place idle sessions as their idle time grows."""
        ...


def perfect_forecast(
    session: str, at: float, gap: float, horizons: Sequence[float]
) -> ReturnForecast:
    """The oracle's forecast of a session that will be back after ``gap`` seconds
    (``math.inf``: never): a perfect classifier, 1 at every horizon the gap falls
    within and 0 at the others, read between horizons as any forecast is."""
    horizons = tuple(float(h) for h in horizons)
    return ReturnForecast(session, at, horizons, tuple(float(gap <= h) for h in horizons))


CopyListener = Callable[[Sequence[tuple[ChunkKey, TierKind]], float], None]
"""Told of each prefetch's copies, (key, source tier) in order, and when they were issued."""


@dataclass
class PrefetchStats:
    """Chunks promoted ahead of a lookup and what became of them.

    The store moves a promoted block at once; the hardware would not: a
    prefetch is a copy over the link of the tier it comes from, sharing it with
    every other read of that tier. The daemon's copies take the time they take;
    the replay, which models time, charges them by listening (``listener``:
    ``replay.links``). ``routes`` counts the chunks issued by (source tier,
    destination tier), so the bytes a policy moved ahead of its reads can be
    told apart from the ones it read on demand.
    """

    issued: int = 0
    used: int = 0  # read from the tier they were promoted to before leaving it
    wasted: int = 0  # left that tier unread
    routes: Counter[tuple[TierKind, TierKind]] = field(default_factory=Counter)
    listener: CopyListener | None = field(default=None, repr=False, compare=False)

    @property
    def pending(self) -> int:
        return self.issued - self.used - self.wasted

    def copied(self, chunks: Sequence[tuple[ChunkKey, TierKind]], to: TierKind, at: float) -> None:
        """Count the copies of prefetched ``chunks`` (key, source tier) into ``to``, issued
        at ``at``, and tell the listener."""
        self.issued += len(chunks)
        self.routes.update((source, to) for _, source in chunks)
        if self.listener is not None and chunks:
            self.listener(chunks, at)

    def to_dict(self) -> dict[str, int]:
        return {
            "issued": self.issued,
            "used": self.used,
            "wasted": self.wasted,
            "pending": self.pending,
        }


def session_namespace(store: TieredStore, state: IdleSession) -> Namespace | None:
    """The namespace ``state``'s chain lives in, if the store knows it."""
    if state.namespace is None:
        return None
    try:
        return store.namespace(state.namespace)
    except UnknownNamespace:
        return None

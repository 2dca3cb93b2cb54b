"""What the session policies share: the protocols they read forecasts and sessions
through, the protocol they offer the daemon and the replay, and prefetch accounting.

A policy is two things at once: an ``EvictionPolicy`` (``kvstore.store.eviction``)
plugged into the store, and a session policy with three hooks the daemon or
the replay calls (``on_idle``, ``on_resume``, ``tick``), each taking ``now``.
``placement.policy`` has the predictor's policy, ``placement.baselines`` the
LRU and fixed-TTL baselines.
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass
class PrefetchStats:
    """Chunks promoted ahead of a lookup, what became of them, and the copies still on
    their way.

    The store moves a promoted block at once; the hardware would not. A prefetch
    is a copy over the link of the tier it comes from, and copies over one link
    run one after another (``transfer`` queues them), so a chunk *arrives*
    ``load_seconds`` after the link is free. A lookup before then finds the
    chunk in the fast tier but must still wait for it: whoever charges the
    request (the replay) asks ``loading(key, now)`` and charges the source tier
    while the copy is in flight. A prefetch earns its keep only if it lands
    before the request that reads it.
    """

    issued: int = 0
    used: int = 0  # read from the tier they were promoted to before leaving it
    wasted: int = 0  # left that tier unread
    in_flight: dict[ChunkKey, tuple[float, TierKind]] = field(default_factory=dict, repr=False)
    """Chunk -> (when its copy lands, the tier it is copied from). Owned by ``transfer``."""
    link_free: dict[TierKind, float] = field(default_factory=dict, repr=False)
    """Source tier -> when its link has finished the copies queued on it."""

    @property
    def pending(self) -> int:
        return self.issued - self.used - self.wasted

    def transfer(
        self,
        chunks: Sequence[tuple[ChunkKey, TierKind]],
        now: float,
        seconds: dict[TierKind, float],
    ) -> None:
        """Queue the copies of prefetched ``chunks`` (key, source tier) in order, each
        taking ``seconds[source]`` on its source tier's link."""
        for key, source in chunks:
            start = max(now, self.link_free.get(source, now))
            self.link_free[source] = done = start + seconds[source]
            self.in_flight[key] = (done, source)
        if len(self.in_flight) > 4 * _IN_FLIGHT_SWEEP:  # drop copies long landed
            self.in_flight = {k: v for k, v in self.in_flight.items() if v[0] > now}

    def loading(self, key: ChunkKey, now: float) -> TierKind | None:
        """The tier ``key`` is still being copied from at ``now`` (None: not in flight)."""
        entry = self.in_flight.get(key)
        if entry is None:
            return None
        if entry[0] <= now:
            del self.in_flight[key]
            return None
        return entry[1]

    def to_dict(self) -> dict[str, int]:
        return {
            "issued": self.issued,
            "used": self.used,
            "wasted": self.wasted,
            "pending": self.pending,
        }


_IN_FLIGHT_SWEEP = 1024


def session_namespace(store: TieredStore, state: IdleSession) -> Namespace | None:
    """The namespace ``state``'s chain lives in, if the store knows it."""
    if state.namespace is None:
        return None
    try:
        return store.namespace(state.namespace)
    except UnknownNamespace:
        return None

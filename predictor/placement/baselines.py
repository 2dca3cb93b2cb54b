"""The baselines the predictor's policy is measured against: what a serving engineer
would deploy without a learned model. Each has the session hooks of
``SessionPolicy``, so the daemon and the replay drive every policy the same way;
eviction under pressure is LRU in all of them.

- ``LRUBaseline``: LRU and nothing else (vLLM's and LMCache's default).
- ``TTLPolicy``: a fixed idle timeout at every tier (TraceLab's sweep; a
  5-minute prompt-cache TTL is common practice): a session idle for the TTL
  has its chain demoted one tier, and one more for every further TTL; from
  the last tier it is dropped.
- ``ToolAwarePolicy``: keep a chain in HBM while a tool runs (the request
  ended asking for one: it is back in seconds), demote it out of HBM the
  moment the agent hands back to its human (Continuum's idea).
- ``PrevGapPolicy``: demote a chain out of HBM at once when the session's last
  human gap exceeded ten minutes; otherwise as ``ToolAwarePolicy``.
- ``LogNormalGaps``: a forecaster, not a policy: one log-normal of the human
  gaps of the whole deployment, learned online (the llm-d proposal). Fed to
  ``PlacementPolicy`` it keeps a chain in a tier while P(back within that
  tier's horizon) is high; every session gets the same curve, shifted only by
  how long it has been idle. A session waiting on its tool is forecast back
  within the first horizon for sure, which the policy reads as "never" once
  that has passed (a subagent's parent, a long build); with ``ToolGaps`` it is
  forecast from how soon tool results came back so far instead, which is all
  the predictor knows of tool waits without its learnt forecast of the human.

Only blocks nobody touched since the session went idle move, so a prefix that
other sessions keep using stays where it is.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.predictor.learning.counting import TOOL_PRIOR
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.placement.hooks import (
    Forecast,
    IdleSession,
    PrefetchStats,
    session_namespace,
)
from kvstore.store.eviction import LRUPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import Trigger

LONG_HUMAN_GAP_S = 600.0
"""``PrevGapPolicy``'s threshold: a human who waited longer than this will again."""


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

    def on_forecast(
        self, store: TieredStore, state: IdleSession, forecast: Forecast, now: float
    ) -> None:
        return None  # the baselines read no forecasts

    def tick(self, store: TieredStore, now: float) -> None:
        return None


@dataclass
class _Idle:
    """A session gone idle: since when, its state, and how many tiers it moved down."""

    since: float
    state: IdleSession
    steps: int = 0


class _IdleBaseline(LRUBaseline):
    """What the rule baselines share: every block's last touch, the idle sessions, each
    session's last human gap, and demoting the blocks of a chain nobody touched since."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._touched: dict[ChunkKey, float] = {}  # key -> last access (hook time)
        self._idle: dict[str, _Idle] = {}  # idle sessions, oldest idle first
        self._human_gap: dict[str, float] = {}  # session -> its last human gap
        self._moving = False  # this policy is demoting: its own writes touch nothing

    def on_access(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None = None
    ) -> None:
        super().on_access(tier, keys, session)
        if not self._moving:
            for key in keys:
                self._touched[key] = self._now

    def on_idle(
        self, store: TieredStore, state: IdleSession, forecast: Forecast | None, now: float
    ) -> TierKind | None:
        self._now = now
        self._idle.pop(state.session, None)  # re-inserted last: the dict stays in idle order
        self._idle[state.session] = _Idle(now, state)
        return self._placed(store, state, now)

    def on_resume(self, store: TieredStore, state: IdleSession, now: float) -> None:
        self._now = now
        idle = self._idle.pop(state.session, None)
        if idle is not None and state.last_trigger is Trigger.USER:
            self._human_gap[state.session] = now - idle.since

    def tick(self, store: TieredStore, now: float) -> None:
        self._now = now

    def _placed(self, store: TieredStore, state: IdleSession, now: float) -> TierKind | None:
        """What the rule does when a session goes idle; where its chain stays."""
        return TierKind.HBM

    def _demote(self, store: TieredStore, idle: _Idle, to: TierKind | None) -> int:
        """Move the chain's blocks nobody touched since the session went idle one tier
        down (``to`` None) or out of every tier faster than ``to``."""
        namespace = session_namespace(store, idle.state)
        if namespace is None:
            return 0
        stale = [
            key for key in idle.state.chain if self._touched.get(key, -math.inf) <= idle.since
        ]
        if not stale:
            return 0
        self._moving = True
        try:
            return store.demote(namespace, stale, to=to)
        finally:
            self._moving = False


class TTLPolicy(_IdleBaseline):
    """A fixed idle timeout at every tier: idle ``seconds`` more, one tier further down."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def tick(self, store: TieredStore, now: float) -> None:
        self._now = now
        expired = []
        for session, idle in self._idle.items():
            if now - idle.since >= (idle.steps + 1) * self.seconds:
                expired.append(session)
        levels = len(store.tier_kinds)
        for session in expired:
            idle = self._idle[session]
            idle.steps += 1
            self._demote(store, idle, None)
            if idle.steps >= levels:  # dropped from the last tier: nothing left to move
                del self._idle[session]


class ToolAwarePolicy(_IdleBaseline):
    """Keep a chain in HBM while a tool runs; demote it out of HBM when the agent hands back
    to its human."""

    def _placed(self, store: TieredStore, state: IdleSession, now: float) -> TierKind | None:
        if state.tool_running:
            return TierKind.HBM
        return self._out_of_hbm(store, state)

    def _out_of_hbm(self, store: TieredStore, state: IdleSession) -> TierKind:
        below = next((kind for kind in store.tier_kinds if kind > TierKind.HBM), None)
        if below is not None:
            self._demote(store, self._idle[state.session], below)
        return below or TierKind.HBM


class PrevGapPolicy(ToolAwarePolicy):
    """Demote a chain out of HBM at once when its session's last human gap exceeded ten
    minutes; keep it otherwise (LRU evicts it under pressure)."""

    def _placed(self, store: TieredStore, state: IdleSession, now: float) -> TierKind | None:
        if state.tool_running:
            return TierKind.HBM
        if self._human_gap.get(state.session, 0.0) > LONG_HUMAN_GAP_S:
            return self._out_of_hbm(store, state)
        return TierKind.HBM


class ToolGaps:
    """How soon tool results came back so far, counted as the predictor's
    ``counting.ToolReturns`` counts them: P(back within h) is the share of the tool
    waits whose outcome at h is known that ended within h, from the same
    ``TOOL_PRIOR``. A wait still open after h counts as not back within h, so waits
    that never end (a conversation that stops at a tool call) pull the chances down
    as they age, as they do the predictor's.
    """

    def __init__(self) -> None:
        self._gaps: list[float] = []  # of the waits that ended, sorted
        self._open: dict[str, float] = {}  # session -> when its wait began
        self._starts: list[float] = []  # the values of ``_open``, sorted

    def waiting(self, session: str, since: float) -> None:
        """``session`` went idle at ``since`` while its tool runs."""
        self._close(session)
        self._open[session] = since
        bisect.insort(self._starts, since)

    def returned(self, session: str, now: float) -> None:
        """``session`` is back at ``now``; nothing if it was not waiting on a tool."""
        since = self._close(session)
        if since is not None:
            bisect.insort(self._gaps, now - since)

    def within(self, horizons: Sequence[float], now: float) -> tuple[float, ...]:
        prior_within, prior_waits = TOOL_PRIOR
        chances = []
        for h in horizons:
            back = bisect.bisect_right(self._gaps, h)
            open_past = bisect.bisect_left(self._starts, now - h)  # open longer than h
            known = len(self._gaps) + open_past
            chances.append((back + prior_within) / (known + prior_waits))
        return tuple(chances)

    def _close(self, session: str) -> float | None:
        """Forget ``session``'s open wait; when it began (None: it had none)."""
        since = self._open.pop(session, None)
        if since is not None:
            del self._starts[bisect.bisect_left(self._starts, since)]
        return since


class LogNormalGaps:
    """One log-normal of every human gap seen so far (Welford on ``log(gap)``), as a
    forecast: P(back within h) = Phi((log h - mu) / sigma). A session that went idle
    asking for a tool is forecast back at once, or, given ``tools``, as soon as tool
    results came back so far. Before ``min_samples`` gaps, a prior of median 2
    minutes and a wide spread (TraceLab's published shape)."""

    def __init__(self, min_samples: int = 20, tools: ToolGaps | None = None) -> None:
        self.min_samples = min_samples
        self.tools = tools
        self._count = 0
        self._mean = 0.0
        self._m2 = 0.0

    def observe(self, gap: float) -> None:
        value = math.log(max(gap, 1.0))
        self._count += 1
        delta = value - self._mean
        self._mean += delta / self._count
        self._m2 += delta * (value - self._mean)

    @property
    def parameters(self) -> tuple[float, float]:
        """(mu, sigma) of log(gap / 1 s)."""
        if self._count < self.min_samples:
            return math.log(120.0), 2.0
        variance = self._m2 / (self._count - 1)
        return self._mean, max(math.sqrt(variance), 0.1)

    def forecast(
        self, session: str, at: float, horizons: Sequence[float], tool_running: bool
    ) -> ReturnForecast:
        if tool_running:
            back = self.tools.within(horizons, at) if self.tools else tuple(1.0 for _ in horizons)
            return ReturnForecast(session, at, tuple(horizons), back)
        mu, sigma = self.parameters
        probabilities = tuple(
            0.5 * (1.0 + math.erf((math.log(h) - mu) / (sigma * math.sqrt(2.0))))
            for h in horizons
        )
        return ReturnForecast(session, at, tuple(horizons), probabilities)

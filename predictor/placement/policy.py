"""Placement policies: where an idle session's chain lives, and which blocks go first.

A policy here is two things at once:

* an ``EvictionPolicy`` (``kvstore.store.eviction``) plugged into the store: told of
  every access and removal per tier, it answers ``victims(tier)`` when
  capacity pressure must evict, and ``destination(tier, key, occupancy)`` from
  how full the tiers are, never asking the store while it evicts;
* a session policy with three hooks the daemon or the replay calls:
  ``on_idle`` when a session's last request finishes, ``on_resume`` when one
  starts, and ``tick`` on a timer. Each takes ``now``; nothing reads a clock.

``PlacementPolicy`` (the predictor's) reads a ``ReturnForecast`` (P(back within
each horizon), made when the session went idle) again as idle time ``e``
passes: P(back within ``H`` more seconds | not back after ``e``) =
(F(e + H) - F(e)) / (1 - F(e)) (``ranking.IdleForecast``). Between its horizons F
is shaped like the idle gaps seen so far (``GapShape``); beyond the last one it
stays flat.

Idle placement. Each tier has a horizon (HBM 1 min, DRAM 10 min, SSD 1 h,
Redis 4 h) and a keep threshold::

    target(e) = the fastest tier t with P(back within H_t | e) >= keep_t
                (none: the chain may be dropped)

A chain whose target is slower than where it lies leaves that tier at once, when the
forecast is made or at a later look, but only under current pressure: a tier with
room (below ``FULL``), or whose next victim ranks below the chain, keeps it, as
freeing the space would buy nothing yet. It moves down to the first tier that keeps
it; the last tier always does, and there ranked eviction decides, so "SSD within
hours, dropped otherwise" is what pressure does to a chain nobody expects back.
Wherever a chain stays, idle placement copies it one tier down (or to its target)
while nobody waits, if that tier has room: the eviction that comes when someone
needs the room then writes nothing on that request's clock (on Mooncake's trace that
write-back was an eighth of the predictor's GPU-seconds). In a full tier the copy
would push out another session's block, and keeping a chain twice costs capacity.
When the target rises above where the chain lies (a step-shaped forecast, a tool
result on its way), the chain is promoted ahead of the return: a prefetch. So is a
chain that a faster tier other than HBM would now keep: one with room, or whose next
victim it outranks by ``promote_margin``. Chances fall at different rates as
sessions idle, and a chain put on SSD at idle can later be likelier back than DRAM's
marginal resident, which it then trades places with before anyone waits for either.
``on_resume`` prefetches too: a request-began event means the lookup is next.
``prefetches`` counts what became of them.

Every placement, demotion, write-down copy and prefetch, and every eviction of
a session's blocks, is logged with its reason and forecast in ``decisions``
(``placement.decisions``), for an operator asking why a chain lies where it does.

A prefetch reads the chain from a slower tier while the hooks hold the store's
lock: with ``defer_prefetches`` a hook only plans it, and the caller runs the plans
(``take_prefetches``, ``prefetch``) after letting go of it (``placement.prefetching``).

Eviction by predicted reuse. Each block belongs to the last session that
touched it. ``victims(tier)`` ranks sessions by the chance that they are back
while a block kept in that tier would stay there (the tier's measured mean
residence before eviction, at most its horizon), ties by the chance that they
come back at all, then least recently touched first; a session's blocks go
tail first. The store takes only leaves of that order (``leaves_only``), so a
system prompt shared by every session outlives the chains that extend it, whoever
touched it last. Blocks of running sessions rank last; blocks no session touched rank
first, LRU. Who owns what, where, in which order, and how long
blocks stay in each tier is kept by ``placement.holdings``; this module ranks.

Ownership, not membership, decides what a session's idle placement moves, and
it moves leaves only (``TieredStore.demote(leaves_only=True)``): the session
that touched a shared prefix last owns it, but going idle it takes down only
what no other chain in the tier extends, so a system prompt stays fast while
any session's chain built on it does.

Overload. While the chains of the sessions started and not finished overflow the
fastest tier by more than the engine drains within SSD's horizon
(``placement.overload``), requests are queueing for admission, and a forecast of
when a session is back says little of when its chain is read. The policy then
evicts as LRU does (any block, least recently used first), prefetches nothing
and places nobody, until the queue has drained.

The baselines are ``placement.baselines``'; the oracle is ``PlacementPolicy``
fed ``perfect_forecast``: the true next arrival read from the trace, a perfect
classifier at the model's horizons.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.placement.decisions import Action, Decision, DecisionLog, Reason, Why
from kvstore.predictor.placement.holdings import Holdings
from kvstore.predictor.placement.hooks import (
    Forecast,
    IdleSession,
    PrefetchStats,
    SessionPolicy,
    perfect_forecast,
    session_namespace,
)
from kvstore.predictor.placement.overload import AdmissionWatch
from kvstore.predictor.placement.prefetching import (
    LinkBudget,
    PlannedPrefetch,
    Prefetcher,
    cached_head,
    copy_seconds,
)
from kvstore.predictor.placement.ranking import GapShape, IdleForecast, Rank
from kvstore.predictor.placement.thresholds import PlacementConfig
from kvstore.store.eviction import LRUPolicy, Occupancy
from kvstore.store.tiered_store import TieredStore

INF = math.inf


@dataclass
class _Session:
    """What ``PlacementPolicy`` knows of one session. Owned by the policy."""

    name: str
    active: bool = False
    idle_since: float = 0.0
    forecast: IdleForecast | None = None  # made at idle, or later again
    state: IdleSession | None = None
    target: TierKind | None = None  # the tier its forecast called for at the last look
    epoch: int = 0  # bumped at every idle and resume, so stale checks are skipped
    touched: int = 0  # recency: a counter bumped at every access
    score: dict[TierKind, tuple[float, float]] = field(default_factory=dict)


# One session's place in a tier's eviction order: (p within horizon, p at all, recency).


FULL = 0.95  # a tier this full is under pressure: a chain must outrank its next victim
_ACTIVE: tuple[float, float] = (INF, INF)
_UNKNOWN: tuple[float, float] = (0.0, 0.0)
_TOOL_RUNNING = Why(Reason.TOOL_RUNNING)
_NO_FORECAST = Why(Reason.NO_FORECAST)
_RESUMED = Why(Reason.RESUMED)


class PlacementPolicy:
    """Idle placement and eviction by forecast return; see the module docstring."""

    def __init__(
        self,
        config: PlacementConfig | None = None,
        *,
        defer_prefetches: bool = False,
        decisions: DecisionLog | None = None,
    ) -> None:
        self.config = config if config is not None else PlacementConfig()
        self.decisions = decisions if decisions is not None else DecisionLog()
        self.gaps = GapShape()
        self.demoted = 0  # chunks moved down by idle placement (not by pressure)
        self._now = 0.0
        self._recency = itertools.count(1)
        self._sessions: dict[str, _Session] = {}
        self._held = Holdings()
        self._lru = LRUPolicy()  # the order it evicts by while the engine is overloaded
        self.watch = AdmissionWatch(self.config.overload)
        self.link_budget = LinkBudget(self.config.speculative_link_share)
        self._prefetcher = Prefetcher(
            self.decisions, lambda kind: self._held.tiers[kind].owner, defer=defer_prefetches
        )
        self._checks: list[tuple[float, int, int, str]] = []  # (when, seq, epoch, session)
        self._sequence = itertools.count()
        # The records of what pressure pushed out at ``_now``, by (session, from, to).
        self._evictions: dict[tuple[str, TierKind, TierKind | None], Decision] = {}
        self._evictions_at = 0.0

    # -- EvictionPolicy ----------------------------------------------------

    @property
    def leaves_only(self) -> bool:
        """Leaves only, except while the engine is overloaded: then it evicts as LRU does."""
        return not self.watch.overloaded

    def on_access(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None = None
    ) -> None:
        self._lru.on_access(tier, keys, session)
        prefetched = self._prefetcher.unread[tier]
        if prefetched:
            for key in keys:
                if key in prefetched:
                    prefetched.discard(key)
                    self.prefetches.used += 1
        ranking = self._held.tiers[tier]
        for owner in self._held.entered(tier, keys, session, self._now):
            state = self._session(owner)
            state.touched = next(self._recency)
            ranking.rank(owner, self._rank(state, tier))

    def touch(self, session: str, keys: Sequence[ChunkKey]) -> None:
        """``session`` used the blocks of ``keys`` though the data path did not say so
        (vLLM's workers load and save blocks knowing no session; its scheduler's events
        carry the chain): it owns those the store holds, as if its own get had touched
        them. Without this no block of such a session is its own to place."""
        state = self._session(session)
        state.touched = next(self._recency)
        self._held.claim(session, keys)
        for tier, ranking in self._held.tiers.items():
            if session in ranking.blocks:
                ranking.rank(session, self._rank(state, tier))

    def owned(self, session: str) -> dict[TierKind, int]:
        """How many blocks ``session`` owns in each tier: what its idle placement moves
        (a chain held there but owned by nobody, or by another session, stays put)."""
        return self._held.owned(session)

    def on_remove(self, tier: TierKind, key: ChunkKey) -> None:
        self._lru.on_remove(tier, key)
        owner = self._held.pushed_out(tier, key)
        if owner is not None:
            self._evicted(tier, key, owner)
        self._held.left(tier, key, self._now)
        prefetched = self._prefetcher.unread[tier]
        if prefetched and key in prefetched:
            prefetched.discard(key)
            self.prefetches.wasted += 1

    def _evicted(self, tier: TierKind, key: ChunkKey, owner: str) -> None:
        """Count ``key`` of session ``owner`` as evicted from ``tier`` to the fastest tier
        still holding it (None: dropped), in one record per session, tier and
        destination at each ``now`` (the daemon's puts evict one block per walk)."""
        to = self._held.fastest_below(tier, key)
        evictions = self._evictions
        if self._evictions_at != self._now:
            evictions.clear()
            self._evictions_at = self._now
        record = evictions.get((owner, tier, to))
        if record is not None:
            record.chunks += 1
            return
        session = self._sessions.get(owner)
        if session is None:
            return
        if session.active:
            why = Why(Reason.PRESSURE_RUNNING, tier)
        else:
            stay = self.stay(tier)
            why = Why(Reason.PRESSURE, tier, self._chance(session, stay, self._now), stay)
        evictions[(owner, tier, to)] = self._decide(session, Action.EVICT, tier, to, 1, why)

    def victims(self, tier: TierKind) -> Iterator[ChunkKey]:
        """Blocks no session touched, then sessions' blocks in rank order
        (``Holdings.victims``), of which the store takes the leaves; while the engine
        is overloaded, any block, least recently used first."""
        if self.watch.overloaded:
            return self._lru.victims(tier)
        return self._held.victims(tier)

    def destination(self, tier: TierKind, key: ChunkKey, occupancy: Occupancy) -> TierKind | None:
        """Where a victim of ``tier`` goes (``kvstore.store.placement`` asks): the first slower
        tier that has room or whose next victim the block's session outranks; the
        last tier if none. ``None`` (the next tier) when the policy has no say, or the
        engine is overloaded."""
        if self.watch.overloaded:
            return None
        owner = self._held.owner(key)
        session = self._sessions.get(owner) if owner is not None else None
        if session is None:
            return None
        slower = [kind for kind in occupancy.kinds if kind > tier]
        chances = {kind: self._rank(session, kind)[:2] for kind in slower}
        for kind in slower[:-1]:
            if self._fits(occupancy, kind, session.name, chances):
                return kind
        return slower[-1] if slower else None

    # -- session hooks -----------------------------------------------------

    def on_idle(
        self, store: TieredStore, state: IdleSession, forecast: Forecast | None, now: float
    ) -> TierKind | None:
        self._now = now
        self.watch.finished(state.session)
        session = self._session(state.session)
        session.active = False
        session.idle_since = now
        self._forecast(session, forecast, now)
        session.state = state
        session.target = None
        if self.watch.overloaded:
            self._hold_back(session, now)
            return None
        return self._place(store, session, now, fresh=True)

    def on_forecast(
        self, store: TieredStore, state: IdleSession, forecast: Forecast, now: float
    ) -> None:
        """Re-place an idle session by a forecast made again, read from ``now`` on."""
        self._now = now
        session = self._sessions.get(state.session)
        if session is None or session.active:
            return
        self._forecast(session, forecast, now)
        if self.watch.overloaded:
            self._hold_back(session, now)
            return
        self._place(store, session, now, fresh=True)

    def _forecast(self, session: _Session, forecast: Forecast | None, now: float) -> None:
        session.forecast = IdleForecast.made(forecast, now) if forecast else None
        session.epoch += 1

    def on_resume(self, store: TieredStore, state: IdleSession, now: float) -> None:
        """Prefetch the session's chain into the fastest tier: its lookup is next (unless
        the engine is overloaded: then its request waits, and the prefetch with it)."""
        self._now = now
        self.watch.started(state.session, len(state.chain))
        session = self._session(state.session)
        if not session.active and session.forecast is not None:
            self.gaps.add(now - session.idle_since)
        session.active = True
        session.state = state
        session.epoch += 1
        self._rerank(session)
        if self.watch.overloaded:
            self.watch.held_back += 1
            return
        self._prefetch(store, session, store.tier_kinds[0], _RESUMED)

    def tick(self, store: TieredStore, now: float) -> None:
        """Re-place the idle sessions whose next look is due, unless the engine is
        overloaded (``placement.overload``): then they wait, due, until it keeps up."""
        self._now = now
        room = self._held.slots(store.occupancy(), store.tier_kinds[0])
        if self.watch.update(now, room):
            return
        while self._checks and self._checks[0][0] <= now:
            _, _, epoch, name = heapq.heappop(self._checks)
            session = self._sessions.get(name)
            if session is not None and session.epoch == epoch and not session.active:
                self._place(store, session, now, fresh=False)

    # -- placement ---------------------------------------------------------

    def _place(self, store: TieredStore, session: _Session, now: float, *, fresh: bool) -> TierKind:
        """Move an idle session's chain where its forecast says for its idle time so far,
        then schedule the next look (sooner while the idle time is short). ``fresh``: a
        new forecast, whose placement is logged even if its target is the one before."""
        order = store.tier_kinds
        state = session.state
        assert state is not None
        chances = {kind: self._returning(session, kind, now) for kind in order}
        self._rerank(session, chances)
        target: TierKind | None
        if state.tool_running:  # a tool result is on its way back
            target = order[0]
        else:
            keep = self.config.keep_at
            target = next((kind for kind in order if chances[kind][0] >= keep(kind)), None)
        # The chain stays in a tier at least as fast as its target, and in a faster one
        # while that has room or the chain outranks its next victim (current pressure):
        # holding it there costs nothing until someone else needs the space.
        placed = order[0]
        while (
            placed != order[-1]
            and (target is None or target > placed)
            and not self._fits(store.occupancy(), placed, session.name, chances)
        ):
            placed = order[order.index(placed) + 1]
        level = self._held.level(session.name)
        namespace = session_namespace(store, state)
        previous, session.target = session.target, target
        if namespace is not None and level is not None:
            why = self._why_target(session, target, order, chances)
            if fresh or target != previous:
                held = len(self._held.tiers[level].blocks[session.name])
                self._decide(session, Action.PLACE, level, target, held, why)
            rising = target is not None and (previous is None or target < previous)
            placed = self._move(store, session, namespace, level, placed, rising, chances, why)
        if self._held.level(session.name) is None:
            del self._sessions[session.name]  # nothing left to place
        else:
            self._look_later(session, now)
        return placed

    def _hold_back(self, session: _Session, now: float) -> None:
        """Place nothing while the engine is overloaded: the session's first look once it
        keeps up does (``placement.overload``)."""
        self.watch.held_back += 1
        self._look_later(session, now)

    def _look_later(self, session: _Session, now: float) -> None:
        """Schedule the idle session's next look: sooner while its idle time is short."""
        elapsed = now - session.idle_since
        wait = min(
            max(self.config.check_fraction * elapsed, self.config.check_min_s),
            self.config.check_max_s,
        )
        check = (now + wait, next(self._sequence), session.epoch, session.name)
        heapq.heappush(self._checks, check)

    def _move(
        self,
        store: TieredStore,
        session: _Session,
        namespace: Namespace,
        level: TierKind,
        placed: TierKind,
        rising: bool,
        chances: dict[TierKind, tuple[float, float]],
        why: Why,
    ) -> TierKind:
        """Move the chain of ``session``, whose fastest block lies in ``level``, to
        ``placed``, or prefetch it to its target (``rising``, ``why``) or to a faster
        tier that now takes it (``_promotion``); copy it down ahead of eviction;
        returns where it is kept."""
        target, name, order = session.target, session.name, store.tier_kinds
        promoted = None if rising else self._promotion(store, name, level, chances)
        if promoted is not None:
            above, why_up = promoted
            self._prefetch(store, session, above, why_up)
            return above
        if (
            rising
            and target is not None
            and target < level
            and self._fits(store.occupancy(), target, name, chances)
        ):
            self._prefetch(store, session, target, why)
            placed = target
        elif placed > level:
            outranked = self._why_not(order[order.index(placed) - 1], name, chances)
            moved = self._held.demote(store, namespace, name, placed)
            self.demoted += moved
            if moved:
                self._decide(session, Action.DEMOTE, level, placed, moved, outranked)
        # Copy the chain down now, while nobody waits, so the eviction that comes when
        # someone needs the room writes nothing on that request's clock: to its target
        # when it is kept faster only for the room; else one tier down (``_copy_ahead``).
        if target is not None and target > placed:
            written = self._held.write_down(store, namespace, name, placed, target)
            if written:
                if self._has_room(store.occupancy(), placed):
                    kept = Why(Reason.KEPT_ROOM, placed)
                else:
                    p, rival = chances[placed][0], self._held.next_in_line(placed, name)[0]
                    kept = Why(Reason.KEPT_OUTRANKS, placed, p, rival=rival)
                self._decide(session, Action.WRITE_DOWN, placed, target, written, kept)
        elif placed != order[-1]:
            below = order[order.index(placed) + 1]
            ahead = self._copy_ahead(store.occupancy(), session, below, chances)
            if ahead is not None:
                written = self._held.write_down(store, namespace, name, placed, below)
                if written:
                    self._decide(session, Action.WRITE_DOWN, placed, below, written, ahead)
        return placed

    def _copy_ahead(
        self,
        occupancy: Occupancy,
        session: _Session,
        below: TierKind,
        chances: dict[TierKind, tuple[float, float]],
    ) -> Why | None:
        """Why the chain, kept where it is, is also copied into ``below`` now; None: it is
        not. Into a tier with room, always. Into a full one, only a chain that outranks
        the next victim there: its eviction would put it there anyway, pushing that
        victim out then, on the clock of the request that needs the room. Not while its
        tool runs: the result is back in seconds and reads the chain where it is, so
        the copy would push someone's block out for nothing. What each half is worth,
        measured: docs/predictor_results.md (Mooncake's trace on 4 GPUs)."""
        if self._has_room(occupancy, below):
            return Why(Reason.COPY_AHEAD, below)
        assert session.state is not None
        rival = self._held.next_in_line(below, session.name)
        if session.state.tool_running or not chances[below] > rival:
            return None
        return Why(Reason.COPY_AHEAD_OUTRANKS, below, chances[below][0], rival=rival[0])

    def _promotion(
        self,
        store: TieredStore,
        name: str,
        level: TierKind,
        chances: dict[TierKind, tuple[float, float]],
    ) -> tuple[TierKind, Why] | None:
        """The tier faster than ``level`` (where session ``name``'s chain lies) that takes
        the chain up now, and why: the fastest with room, or whose next victim the chain
        outranks by the margin; never HBM, which an idle chain reaches only when its
        session is expected back (a rising target). None: none does. Room takes any
        chain, even one read as never back (a forecast is flat past its last horizon;
        such a session may still return, and free room evicts nobody)."""
        order = store.tier_kinds
        for kind in order[: order.index(level)]:
            if kind is TierKind.HBM:
                continue
            p = chances[kind][0]
            if self._has_room(store.occupancy(), kind):
                return kind, Why(Reason.PROMOTED_ROOM, kind, p, self.stay(kind))
            rival = self._held.next_in_line(kind, name)[0]
            if p > (1.0 + self.config.promote_margin) * rival:
                return kind, Why(Reason.PROMOTED, kind, p, self.stay(kind), rival=rival)
        return None

    def _why_target(
        self,
        session: _Session,
        target: TierKind | None,
        order: Sequence[TierKind],
        chances: dict[TierKind, tuple[float, float]],
    ) -> Why:
        """Why the forecast calls for ``target``: the first tier whose keep the chance
        meets, or (None) the slowest one's that it misses."""
        assert session.state is not None
        if session.state.tool_running:
            return _TOOL_RUNNING
        if session.forecast is None:
            return _NO_FORECAST
        kind = target if target is not None else order[-1]
        reason = Reason.LIKELY if target is not None else Reason.UNLIKELY
        return Why(reason, kind, chances[kind][0], self.stay(kind), self.config.keep_at(kind))

    def _why_not(
        self, kind: TierKind, name: str, chances: dict[TierKind, tuple[float, float]]
    ) -> Why:
        """Why session ``name`` does not stay in ``kind``, a tier faster than its target
        that is full: its chance misses the keep, and the next victim there outranks it."""
        p, rival = chances[kind][0], self._held.next_in_line(kind, name)[0]
        horizon, keep = self.stay(kind), self.config.keep_at(kind)
        if rival == INF:
            return Why(Reason.FULL_OF_RUNNING, kind, p, horizon, keep)
        return Why(Reason.OUTRANKED, kind, p, horizon, keep, rival)

    def _decide(
        self,
        session: _Session,
        action: Action,
        source: TierKind | None,
        to: TierKind | None,
        chunks: int,
        why: Why,
    ) -> Decision:
        """Log a decision on ``session``'s chain, with the forecast it was made by."""
        forecast = session.forecast
        levels, forecast_at = (forecast.levels, forecast.at) if forecast else ((), None)
        decision = Decision(
            self._now, session.name, action, source, to, chunks, why, levels, forecast_at
        )
        self.decisions.record(decision)
        return decision

    def _returning(self, session: _Session, kind: TierKind, now: float) -> tuple[float, float]:
        """The session's rank in tier ``kind``: P(back while a block it keeps there would
        stay, given idle so far), then P(back within the longest horizon)."""
        if session.active:
            return _ACTIVE
        if session.forecast is None:
            return _UNKNOWN
        soon = self._chance(session, self.stay(kind), now)
        return (soon, self._chance(session, self.config.longest_horizon, now))

    def _chance(self, session: _Session, seconds: float, now: float) -> float:
        """P(back within ``seconds`` from ``now`` | not back yet), from its forecast."""
        if session.forecast is None:
            return 0.0
        return session.forecast.chance(seconds, now, self.gaps)

    def stay(self, kind: TierKind) -> float:
        """How long a block kept in ``kind`` now is likely to stay: the tier's mean
        residence before eviction (current pressure), at most its horizon."""
        horizon = self.config.horizon(kind)
        residence = self._held.residence(kind)
        if residence is None:
            return horizon
        return min(horizon, max(residence, self.config.check_min_s))

    @property
    def prefetches(self) -> PrefetchStats:
        return self._prefetcher.stats

    @property
    def defer_prefetches(self) -> bool:
        return self._prefetcher.defer

    def take_prefetches(self) -> list[PlannedPrefetch]:
        """The prefetches planned since the last call (``defer_prefetches``), in order.
        Under the store's lock, as every hook."""
        return self._prefetcher.take()

    def prefetch(self, store: TieredStore, plan: PlannedPrefetch) -> None:
        """Run a planned prefetch, without the store's lock (``Prefetcher.run``)."""
        self._prefetcher.run(store, plan, self._now)

    def _prefetch(self, store: TieredStore, session: _Session, to: TierKind, why: Why) -> None:
        """Promote the chunks of the session's chain held slower than ``to`` up to ``to``:
        at once, or, ``defer_prefetches``, once the caller has let go of the lock."""
        state = session.state
        if state is None:
            return
        namespace = session_namespace(store, state)
        if namespace is None:
            return
        # At most half the tier: a longer chain would only push itself, and everyone
        # else, out again.
        chain = state.chain[: self._held.slots(store.occupancy(), to) // 2]
        head, slower = cached_head(chain, self._held.fastest_each(chain), to)
        if not slower:
            return
        if not self._read_in_time(store, to):
            self.watch.late += 1
            return
        speculative = why is not _RESUMED  # within the links' budget
        if speculative and not self.link_budget.spend(
            copy_seconds(store, namespace, slower), self._now
        ):
            return
        source = min(kind for _, kind in slower)
        planned = self._decide(session, Action.PREFETCH_PLANNED, source, to, len(slower), why)
        plan = PlannedPrefetch(namespace, tuple(head), to, tuple(slower), self._now, planned)
        self._prefetcher.submit(store, plan, self._now)

    def _read_in_time(self, store: TieredStore, to: TierKind) -> bool:
        """Whether a chain brought into ``to`` now would still be there when its request is
        admitted: not while admission would keep it waiting longer than a block stays in
        ``to`` (``AdmissionWatch.wait_s``). Such a copy is pushed out unread, and takes its
        link from the loads of requests that are admitted meanwhile."""
        room = self._held.slots(store.occupancy(), store.tier_kinds[0])
        return self.watch.wait_s(room) <= self.stay(to)

    def _fits(
        self,
        occupancy: Occupancy,
        kind: TierKind,
        name: str,
        chances: dict[TierKind, tuple[float, float]],
    ) -> bool:
        """Whether tier ``kind`` has room, or session ``name`` with these chances ranks above
        the session next in line for eviction there."""
        return (
            self._has_room(occupancy, kind)
            or chances[kind] > self._held.next_in_line(kind, name)
        )

    @staticmethod
    def _has_room(occupancy: Occupancy, kind: TierKind) -> bool:
        return occupancy.used_bytes(kind) < FULL * occupancy.capacity_bytes(kind)

    # -- ranking -----------------------------------------------------------

    def _session(self, name: str) -> _Session:
        session = self._sessions.get(name)
        if session is None:
            session = self._sessions[name] = _Session(name)
        return session

    def _rank(self, session: _Session, kind: TierKind) -> Rank:
        chance = session.score.get(kind)
        if chance is None or session.active:
            chance = self._returning(session, kind, self._now)
        return (chance[0], chance[1], session.touched)

    def _rerank(
        self, session: _Session, chances: dict[TierKind, tuple[float, float]] | None = None
    ) -> None:
        session.score = dict(chances) if chances is not None else {}
        for kind, ranking in self._held.tiers.items():
            if session.name in ranking.blocks:
                ranking.rank(session.name, self._rank(session, kind))


__all__ = [
    "Forecast",
    "GapShape",
    "IdleSession",
    "PlacementConfig",
    "PlacementPolicy",
    "PrefetchStats",
    "SessionPolicy",
    "perfect_forecast",
]

"""Prefetches a placement policy decides on: run at once, or later off the store's lock.

A prefetch reads a chain from a slower tier (LMDB, Redis: milliseconds per MiB),
and a policy's hooks run under the store's lock. A ``Prefetcher`` made with
``defer`` only plans one (``PlannedPrefetch``); the caller takes the plans
(``take``) and runs each after letting go of the lock (``run``), so the read holds
up no other request: the store takes its lock only to admit what was read. The
daemon defers; the replay, one thread with nobody to hold up, runs each at once.

What became of them is counted in ``stats`` (``hooks.PrefetchStats``): a chunk a
prefetch brought into a tier is ``unread`` there until a lookup reads it (used)
or it leaves unread (wasted). The policy checks those sets on every access and
removal itself, on its hot path; this module only fills them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass

from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.placement.decisions import Action, Decision, DecisionLog
from kvstore.predictor.placement.hooks import PrefetchStats
from kvstore.store.tiered_store import TieredStore


@dataclass(frozen=True)
class PlannedPrefetch:
    """A prefetch a hook decided on: promote ``keys`` (the cached head of a session's
    chain) to tier ``to``; ``sources`` are the keys held only slower than ``to``
    when it was planned, with their fastest tier; ``planned_at`` the hook's ``now``;
    ``decision`` the record of the plan, which the record of its run repeats."""

    namespace: Namespace
    keys: tuple[ChunkKey, ...]
    to: TierKind
    sources: tuple[tuple[ChunkKey, TierKind], ...]
    planned_at: float
    decision: Decision


class Prefetcher:
    """One policy's prefetches (module docstring). ``held(tier)`` answers which keys
    the policy knows ``tier`` holds: a chunk counts as prefetched only if it landed."""

    def __init__(
        self,
        decisions: DecisionLog,
        held: Callable[[TierKind], Container[ChunkKey]],
        *,
        defer: bool = False,
    ) -> None:
        self.defer = defer
        self.stats = PrefetchStats()
        self.unread: dict[TierKind, set[ChunkKey]] = {kind: set() for kind in TierKind}
        self._decisions = decisions
        self._held = held
        self._planned: list[PlannedPrefetch] = []

    def submit(self, store: TieredStore, plan: PlannedPrefetch, now: float) -> None:
        """From a hook, under the store's lock: run ``plan`` now, or keep it for ``take``."""
        if self.defer:
            self._planned.append(plan)
            return
        store.promote(plan.namespace, list(plan.keys), to=plan.to)
        self._landed(plan, now)

    def take(self) -> list[PlannedPrefetch]:
        """The prefetches planned since the last call, in order. Under the store's lock,
        as every hook."""
        planned, self._planned = self._planned, []
        return planned

    def run(self, store: TieredStore, plan: PlannedPrefetch, now: float) -> None:
        """Run a planned prefetch. Called without the store's lock (it is taken here to
        count what landed), so the read from the slower tier holds up nobody."""
        store.promote(plan.namespace, list(plan.keys), to=plan.to)
        with store.locked():
            self._landed(plan, now)

    def _landed(self, plan: PlannedPrefetch, now: float) -> None:
        """Count the chunks of ``plan`` that arrived in its tier as issued prefetches."""
        held = self._held(plan.to)
        copies = [(key, source) for key, source in plan.sources if key in held]
        self.unread[plan.to].update(key for key, _ in copies)
        self.stats.copied(copies, plan.to, plan.planned_at)
        ran = dataclasses.replace(plan.decision, at=now, action=Action.PREFETCH, chunks=len(copies))
        self._decisions.record(ran)


def cached_head(
    chain: Sequence[ChunkKey], fastest: Iterable[TierKind | None], to: TierKind
) -> tuple[list[ChunkKey], list[tuple[ChunkKey, TierKind]]]:
    """The cached head of ``chain`` (up to its first key no tier holds: a lookup reads no
    further), given the fastest tier holding each key; and the keys of it held only
    slower than ``to``, with that tier. A prefetch promotes the whole head, so the part
    already in ``to`` is protected too, and copies only the slower keys."""
    head: list[ChunkKey] = []
    slower: list[tuple[ChunkKey, TierKind]] = []
    for key, kind in zip(chain, fastest, strict=True):
        if kind is None:
            break
        head.append(key)
        if kind > to:
            slower.append((key, kind))
    return head, slower


class LinkBudget:
    """Link time for speculative copies, per source tier: ``share`` of each second.

    A chain brought up while nobody waits for it (a promotion ahead of a forecast
    return) reads its tier over the link every demand load of that tier uses, and
    a read ahead of time that is never used costs those loads all the same. So such
    copies may take only ``share`` of a link on average: each spends its modeled
    copy time (``CostModel``) from a balance that refills at ``share`` seconds a
    second, up to ``burst_s``; a copy is made while the balance is positive and may
    take it below zero, so a whole chain moves at once and the next waits until the
    debt is paid. A prefetch for a request that has begun is not speculative and
    spends nothing: its lookup is next, and the load would read the same bytes.
    """

    def __init__(self, share: float, burst_s: float = 10.0) -> None:
        self.share = share
        self.burst_s = burst_s
        self.refused = 0  # copies not made for want of link time
        self._balance: dict[TierKind, float] = {}
        self._at: dict[TierKind, float] = {}

    def spend(self, seconds: dict[TierKind, float], now: float) -> bool:
        """Whether a copy taking ``seconds`` of each source tier's link may go now (and,
        if so, spend them)."""
        cap = self.share * self.burst_s
        balances = {}
        for source in seconds:
            last = self._at.get(source, now)
            refill = max(0.0, now - last) * self.share
            balances[source] = min(cap, self._balance.get(source, cap) + refill)
            self._at[source] = max(last, now)
        self._balance.update(balances)
        if any(balance <= 0.0 for balance in balances.values()):
            self.refused += 1
            return False
        for source, taken in seconds.items():
            self._balance[source] -= taken
        return True


def copy_seconds(
    store: TieredStore, namespace: Namespace, sources: Sequence[tuple[ChunkKey, TierKind]]
) -> dict[TierKind, float]:
    """The modeled link time copying ``sources`` (key, tier) takes, per source tier."""
    costs = store.config.costs
    layout = namespace.layout
    per_token = costs.kv_bytes_per_token or layout.chunk_nbytes / layout.chunk_tokens
    chunks = Counter(kind for _, kind in sources)
    return {
        kind: count * costs.load_seconds(kind, layout.chunk_tokens, per_token)
        for kind, count in chunks.items()
    }

"""Eviction policy: which block leaves a tier first under capacity pressure, and where it goes.

The store owns placement mechanics (``kvstore.store.placement``: demote on
pressure, drop only from the last tier, skip pinned and protected blocks, and
take only leaves for a policy that asks); a policy only orders candidates and,
if it wants, names their destination. It is told about every insertion, access
and removal per tier, and answers ``victims(tier)``: keys in the order they
should go, and ``destination(tier, key, occupancy)``: the tier a victim is
written back to, or ``None`` for the next one down, from how full the tiers are
(``Occupancy``: the one thing of the store a policy reads while the store
evicts). The return-time predictor's policy (``kvstore.predictor.placement.policy``)
plugs in here by implementing the same protocol; so does any other.

Prefix awareness: a policy with ``leaves_only`` gets only the leaves of its order
(``BlockIndex.leaves``, the store's prefix tree), so a block with a child in the
same tier stays whatever the order says. ``LRUPolicy`` does without: the store
reports a chain head first (``keys[0]`` is the oldest ancestor) and it records
them tail first, so within one access the head ends up most recent and a chain's
tail goes before its head. Measured, leaves only would cost LRU 11.7% more
GPU-seconds over the 425 kv-cache-tester conversations (``kvstore replay``, 24
users, seed 0), so it is left to the policies that rank whole sessions.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind


class Occupancy(Protocol):
    """How full each configured tier is now, fastest first: all a policy reads of the
    store while the store evicts (it calls the policy with its lock held)."""

    @property
    def kinds(self) -> Sequence[TierKind]: ...

    def used_bytes(self, kind: TierKind) -> int: ...

    def capacity_bytes(self, kind: TierKind) -> int: ...


class EvictionPolicy(Protocol):
    """Orders eviction candidates per tier. Called with the store lock held."""

    @property
    def leaves_only(self) -> bool:
        """Whether the store takes only the leaves of ``victims``' order (module docstring);
        asked at every eviction."""

    def on_access(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None = None
    ) -> None:
        """``keys`` (a chain, head first) were written to or read from ``tier``."""

    def on_remove(self, tier: TierKind, key: ChunkKey) -> None:
        """``key`` left ``tier`` (demoted, dropped, deleted or found corrupt)."""

    def victims(self, tier: TierKind) -> Iterator[ChunkKey]:
        """Keys of ``tier`` in eviction order (the store may skip pinned ones)."""

    def destination(
        self, tier: TierKind, key: ChunkKey, occupancy: Occupancy
    ) -> TierKind | None:
        """Where victim ``key`` of ``tier`` is written back: a slower tier (a block that
        would only be the next victim below may skip it), or ``None`` for the next;
        ``occupancy``: how full the tiers are now."""


class LRUPolicy:
    """Least recently used first; within one access, chain tail before head."""

    leaves_only = False

    def __init__(self) -> None:
        self._order: dict[TierKind, OrderedDict[ChunkKey, None]] = {}

    def on_access(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None = None
    ) -> None:
        order = self._order.setdefault(tier, OrderedDict())
        for key in reversed(keys):
            order[key] = None
            order.move_to_end(key)

    def on_remove(self, tier: TierKind, key: ChunkKey) -> None:
        order = self._order.get(tier)
        if order is not None:
            order.pop(key, None)

    def victims(self, tier: TierKind) -> Iterator[ChunkKey]:
        """Least recent first. Snapshots the head of the queue in batches that double,
        so removals while iterating are safe, a long queue is not copied whole, and
        walking ``n`` victims costs O(n) however many are skipped."""
        order = self._order.get(tier)
        if not order:
            return
        seen: set[ChunkKey] = set()
        size = 32
        while True:
            batch = [key for key in itertools.islice(order, size) if key not in seen]
            if not batch:
                return
            for key in batch:
                seen.add(key)
                if key in order:
                    yield key
            size *= 2

    def destination(
        self, tier: TierKind, key: ChunkKey, occupancy: Occupancy
    ) -> TierKind | None:
        """Always the next tier down."""
        return None

"""What each tier holds, and whose it is: the bookkeeping ``PlacementPolicy`` decides by.

Each block belongs to the last session that touched it; per tier, a ``TierRanking``
files the blocks under their sessions in eviction order (the policy ranks the
sessions) and blocks no session touched go first in LRU order; the store takes
leaves of that order only (``BlockIndex.leaves``), so the structure of the chains
is the store's, and this is ownership and ranking. Per tier it also keeps when each
block came in and the mean stay of the blocks pressure pushed out: how long a block
kept there now is likely to stay.

Moves the policy makes itself (``demote``, ``write_down``) happen inside ``moving``:
those blocks did not leave under pressure, so their stay is not counted, nor is
their leaving logged as an eviction.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.placement.ranking import TierRanking
from kvstore.store.eviction import LRUPolicy, Occupancy
from kvstore.store.tiered_store import TieredStore

_RESIDENCE_WEIGHT = 0.01  # of each eviction in a tier's mean residence (about the last 100)


class Holdings:
    """The blocks each tier holds, by owning session, in eviction order."""

    def __init__(self) -> None:
        self.tiers: dict[TierKind, TierRanking] = {kind: TierRanking() for kind in TierKind}
        self._anonymous = LRUPolicy()  # blocks no session touched
        self._owner: dict[ChunkKey, str] = {}  # last session to touch each held key
        self._entered: dict[TierKind, dict[ChunkKey, float]] = {kind: {} for kind in TierKind}
        self._residence: dict[TierKind, float] = {}  # mean stay before eviction, per tier
        self._moving: set[ChunkKey] = set()  # keys the policy is moving right now
        # The keys the last walk of each tier offered (``victims``): those of them that
        # leave, outside ``moving``, were pushed out by pressure.
        self._offered: dict[TierKind, set[ChunkKey]] = {kind: set() for kind in TierKind}

    def entered(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None, now: float
    ) -> list[str]:
        """Tier ``tier`` was asked for, or given, ``keys`` (by ``session``, if known); the
        sessions that own any of them, in order of first mention. Their ranks there are
        the caller's to set."""
        ranking = self.tiers[tier]
        entered, owners, filed = self._entered[tier], self._owner, ranking.owner
        anonymous: list[ChunkKey] = []
        touched: dict[str, None] = {}
        for key in keys:  # once per block a request reads or writes: kept lean
            if key not in entered:
                entered[key] = now
            if session is not None:
                owners[key] = owner = session
            elif (known := owners.get(key)) is not None:
                owner = known
            else:
                anonymous.append(key)
                continue
            if filed.get(key) != owner:
                ranking.add(key, owner)
            touched[owner] = None
        if anonymous:
            self._anonymous.on_access(tier, anonymous)
        return list(touched)

    def claim(self, session: str, keys: Sequence[ChunkKey]) -> None:
        """``session`` owns every block of ``keys`` any tier holds, as if it had touched
        them; the caller ranks it where it now holds blocks."""
        owners = self._owner
        for tier, ranking in self.tiers.items():
            entered, filed = self._entered[tier], ranking.owner
            # In chain order (a session's blocks leave tail first); most of a growing
            # chain is the session's already, and only the rest is filed again.
            for key in [key for key in keys if key in entered and filed.get(key) != session]:
                owners[key] = session
                ranking.add(key, session)
                self._anonymous.on_remove(tier, key)
        for key in keys:  # also where a tier filed it under the session already
            if key in owners:  # (held somewhere)
                owners[key] = session

    def pushed_out(self, tier: TierKind, key: ChunkKey) -> str | None:
        """The owner of ``key`` if its leaving ``tier`` now is an eviction by pressure (the
        store took it from the last walk of ``victims``, and the policy is not moving it)."""
        if key in self._offered[tier] and key not in self._moving:
            return self.tiers[tier].owner.get(key)
        return None

    def left(self, tier: TierKind, key: ChunkKey, now: float) -> None:
        """``key`` is no longer in ``tier``."""
        self.tiers[tier].remove(key)
        since = self._entered[tier].pop(key, None)
        if since is not None and key not in self._moving:
            stay = now - since
            mean = self._residence.get(tier)
            self._residence[tier] = (
                stay if mean is None else mean + _RESIDENCE_WEIGHT * (stay - mean)
            )
        self._anonymous.on_remove(tier, key)
        if not any(key in entered for entered in self._entered.values()):
            self._owner.pop(key, None)

    def victims(self, tier: TierKind) -> Iterator[ChunkKey]:
        """Blocks no session touched, then sessions' blocks in rank order."""
        walked = self._offered[tier] = set()
        for key in itertools.chain(self._anonymous.victims(tier), self.tiers[tier].victims()):
            walked.add(key)
            yield key

    @contextmanager
    def moving(self, keys: Iterable[ChunkKey]) -> Iterator[None]:
        """The policy itself moves ``keys`` while this lasts."""
        self._moving = set(keys)
        try:
            yield
        finally:
            self._moving = set()

    def demote(self, store: TieredStore, namespace: Namespace, session: str, to: TierKind) -> int:
        """Move the blocks ``session`` owns out of every tier faster than ``to``; how many
        moved. A block it owns that another chain held there extends stays: a session
        that touched a shared prefix last does not take it down with its own chain."""
        owned: dict[ChunkKey, None] = {}
        for kind in self.tiers:
            if kind < to:
                owned.update(dict.fromkeys(self.blocks(kind, session)))
        if not owned:
            return 0
        with self.moving(owned):
            return store.demote(namespace, list(owned), to=to, leaves_only=True)

    def write_down(
        self, store: TieredStore, namespace: Namespace, session: str, held: TierKind, to: TierKind
    ) -> int:
        """Copy the blocks ``session`` owns in ``held`` into ``to``, keeping them; how many
        were written."""
        owned = self.blocks(held, session)
        if not owned:
            return 0
        with self.moving(owned):
            return store.write_back(namespace, owned, to=to)

    def owner(self, key: ChunkKey) -> str | None:
        return self._owner.get(key)

    def blocks(self, kind: TierKind, session: str) -> list[ChunkKey]:
        """The blocks ``session`` owns in ``kind``, head first."""
        return list(self.tiers[kind].blocks.get(session, ()))

    def owned(self, session: str) -> dict[TierKind, int]:
        """How many blocks ``session`` owns in each tier that holds any."""
        return {
            kind: len(ranking.blocks[session])
            for kind, ranking in self.tiers.items()
            if session in ranking.blocks
        }

    def held(self, kind: TierKind) -> int:
        """How many blocks tier ``kind`` holds."""
        return len(self._entered[kind])

    def slots(self, occupancy: Occupancy, kind: TierKind) -> int:
        """About how many blocks tier ``kind`` holds when full (from its mean block size)."""
        held = self.held(kind)
        used = occupancy.used_bytes(kind)
        if not held or not used:
            return 1 << 30  # empty: no size to go by yet, and no one to push out
        return int(occupancy.capacity_bytes(kind) * held / used)

    def residence(self, kind: TierKind) -> float | None:
        """The mean stay of the blocks pressure pushed out of ``kind`` (None: none yet)."""
        return self._residence.get(kind)

    def fastest_each(self, keys: Iterable[ChunkKey]) -> Iterator[TierKind | None]:
        """The fastest tier holding each key (``None``: none), in turn. A session's chain
        is thousands of keys, each asked of every tier: one loop, no generator per key."""
        owners = [(kind, ranking.owner) for kind, ranking in self.tiers.items()]
        for key in keys:
            for kind, owner in owners:
                if key in owner:
                    yield kind
                    break
            else:
                yield None

    def fastest_below(self, tier: TierKind, key: ChunkKey) -> TierKind | None:
        """The fastest tier slower than ``tier`` holding ``key``."""
        return next(
            (kind for kind, held in self._entered.items() if kind > tier and key in held), None
        )

    def level(self, session: str) -> TierKind | None:
        """The fastest tier holding a block ``session`` owns."""
        return next((kind for kind, r in self.tiers.items() if session in r.blocks), None)

    def next_in_line(self, kind: TierKind, session: str) -> tuple[float, float]:
        """The chances of the session other than ``session`` next in line for eviction
        from ``kind`` (as of its last ranking); (0, 0) when unowned blocks go first."""
        if next(iter(self._anonymous.victims(kind)), None) is not None:
            return (0.0, 0.0)
        ranking = self.tiers[kind]
        ranking.drop_stale()
        for entry in ranking.entries:
            if entry[1] != session and ranking.live.get(entry[1]) is entry:
                return (entry[0][0], entry[0][1])
        return (0.0, 0.0)

"""The prefix tree of the blocks each tier holds: eviction there takes leaves only.

A chunk key names its whole prefix, so a block's parent never changes: ``PrefixTree``
learns parents from the chains of the sessions it is shown, and counts, per tier, the
children each held block has in that tier. ``leaves`` filters a tier's eviction order
down to blocks without a child left there. A cached prefix thereby stays a prefix,
and a system prompt every session shares outlives the chains that extend it, whoever
touched it last.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence

from kvstore.keys import ChunkKey
from kvstore.tiers.kinds import TierKind


class PrefixTree:
    """Parent links of the blocks held in each tier; see the module docstring."""

    def __init__(self) -> None:
        self._parent: dict[ChunkKey, ChunkKey] = {}  # from the chains learnt
        self._linked: dict[TierKind, dict[ChunkKey, ChunkKey]] = {k: {} for k in TierKind}
        self._children: dict[TierKind, dict[ChunkKey, int]] = {k: {} for k in TierKind}

    def learn(
        self, chain: Sequence[ChunkKey], held: Mapping[TierKind, Container[ChunkKey]]
    ) -> None:
        """Learn the parent of every key of ``chain``, and count the key as a child in
        each tier of ``held`` that holds it already."""
        for parent, key in itertools.pairwise(chain):
            if key in self._parent:
                continue
            self._parent[key] = parent
            for tier, keys in held.items():
                if key in keys:
                    self.entered(tier, key)

    def entered(self, tier: TierKind, key: ChunkKey) -> None:
        """``key`` is held in ``tier`` now: a child of its parent there."""
        parent = self._parent.get(key)
        linked = self._linked[tier]
        if parent is not None and key not in linked:
            linked[key] = parent
            children = self._children[tier]
            children[parent] = children.get(parent, 0) + 1

    def left(self, tier: TierKind, key: ChunkKey) -> None:
        """``key`` left ``tier``."""
        parent = self._linked[tier].pop(key, None)
        if parent is not None:
            children = self._children[tier]
            children[parent] -= 1
            if not children[parent]:
                del children[parent]

    def forget(self, key: ChunkKey) -> None:
        """``key`` is held in no tier any more."""
        self._parent.pop(key, None)

    def leaves(self, tier: TierKind, order: Iterable[ChunkKey]) -> Iterator[ChunkKey]:
        """The blocks of ``order`` that have no child in ``tier``. A block whose children
        were all yielded earlier in the same walk counts as a leaf: a chain goes tail
        first, so one walk can free a whole chain, not only its tail (the store skips a
        pinned block, and a request pins its whole prefix with it)."""
        children, parents = self._children[tier], self._linked[tier]
        offered: dict[ChunkKey, int] = {}  # children of each block yielded in this walk
        for key in order:
            if children.get(key, 0) > offered.get(key, 0):
                continue
            parent = parents.get(key)
            if parent is not None:
                offered[parent] = offered.get(parent, 0) + 1
            yield key

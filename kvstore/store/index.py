"""The store's index: for every chunk, which tiers hold a copy, its parent, its pins.

The index is the store's memory of placement, and its prefix tree: a chunk key
names its whole prefix, so a block's parent never changes, and the index counts,
per tier, the children each block has there. For a policy that asks
(``EvictionPolicy.leaves_only``) eviction takes leaves only (``leaves``): a system
prompt every session shares outlives the chains that extend it, whoever touched
it last.

The index is authoritative for the process-local tiers (HBM, DRAM, LMDB, whose
contents are rebuilt from a scan after a restart) and advisory for shared tiers
(Redis), which other processes write to and the server may evict from: a key the
index does not know may still be found there. ``RecentMisses`` remembers, for a
moment, the keys a shared tier said it lacks, so a lookup that misses again and
again (an engine asking for a prefix nobody has cached) costs that tier one round
trip, not one per lookup.

The store's lock guards every call that changes it. One read needs no lock:
``fastest``, a lookup's only question of the index, reads one dictionary entry
and one attribute per key, each a single step under the GIL, so a lookup never
waits for the lock that predictor work, an eviction or a long put holds
(``TieredStore.lookup_nowait``). A lookup that overlaps a move may see a block
in the tier it is leaving or not yet in the one it goes to: a lookup is
advice, and the get that follows verifies what it reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind


@dataclass(slots=True)
class BlockMeta:
    """Index entry of one chunk.

    ``sizes`` maps each tier holding a copy to the stored size there (codecs
    differ per tier). ``pins`` counts reads in progress plus explicit pins; a
    pinned block is never an eviction victim. ``fastest``: the fastest of
    ``sizes``, kept as each copy is recorded or dropped, so that a lookup reads it
    without the store's lock (module docstring). ``session`` is the last session
    that wrote the chunk, for placement policies that reason about sessions.
    ``deleted``: a delete came while it was pinned; it goes when the last pin
    does (``Placement.unpin``), not under a reader copying it out.
    """

    namespace: bytes
    parent: ChunkKey | None
    sizes: dict[TierKind, int] = field(default_factory=dict)
    pins: int = 0
    session: str | None = None
    deleted: bool = False
    fastest: TierKind | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        self.fastest = min(self.sizes, default=None)


class BlockIndex:
    """Chunk key -> ``BlockMeta``."""

    def __init__(self) -> None:
        self._entries: dict[ChunkKey, BlockMeta] = {}
        # Per tier: how many children each block has held there (the prefix tree).
        self._children: dict[TierKind, dict[ChunkKey, int]] = {kind: {} for kind in TierKind}

    def get(self, key: ChunkKey) -> BlockMeta | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def lineage(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """``keys`` after the indexed ancestors of ``keys[0]``, head first: the whole
        prefix of a chain that names only its tail (a put from the parent of the first
        new block on). The walk stops at the first ancestor no tier holds."""
        entries = self._entries
        ancestors: list[ChunkKey] = []
        meta = entries.get(keys[0]) if keys else None
        while meta is not None and meta.parent is not None and len(ancestors) < len(entries):
            parent, meta = meta.parent, entries.get(meta.parent)
            if meta is not None:
                ancestors.append(parent)
        ancestors.reverse()
        return [*ancestors, *keys]

    def fastest(self, keys: Iterable[ChunkKey]) -> list[TierKind | None]:
        """The fastest tier known to hold each key, or ``None``; safe without the
        store's lock (module docstring)."""
        entries = self._entries
        return [meta.fastest if (meta := entries.get(key)) else None for key in keys]

    def record(
        self,
        kind: TierKind,
        key: ChunkKey,
        namespace: bytes,
        parent: ChunkKey | None,
        nbytes: int,
        session: str | None = None,
    ) -> BlockMeta:
        """Note that tier ``kind`` now holds ``key`` in ``nbytes`` stored bytes. A parent
        named for a block indexed without one (found in a shared tier, say) makes it a
        child in every tier holding it."""
        meta = self._entries.get(key)
        if meta is None:
            meta = self._entries[key] = BlockMeta(namespace, parent)
        elif meta.parent is None and parent is not None:
            meta.parent = parent
            for held in meta.sizes:
                self._adopt(held, parent)
        if kind not in meta.sizes and meta.parent is not None:
            self._adopt(kind, meta.parent)
        meta.sizes[kind] = nbytes
        if meta.fastest is None or kind < meta.fastest:
            meta.fastest = kind
        if session is not None:
            meta.session = session
        return meta

    def drop(self, kind: TierKind, key: ChunkKey) -> bool:
        """Forget ``kind``'s copy of ``key``; return whether ``kind`` held one."""
        meta = self._entries.get(key)
        if meta is None or kind not in meta.sizes:
            return False
        del meta.sizes[kind]
        if meta.parent is not None:
            children = self._children[kind]
            children[meta.parent] -= 1
            if not children[meta.parent]:
                del children[meta.parent]
        if not meta.sizes:
            del self._entries[key]
        meta.fastest = min(meta.sizes, default=None)
        return True

    def _adopt(self, kind: TierKind, parent: ChunkKey) -> None:
        children = self._children[kind]
        children[parent] = children.get(parent, 0) + 1

    def leaves(self, kind: TierKind, order: Iterable[ChunkKey]) -> Iterator[ChunkKey]:
        """The blocks of ``order`` without a child in tier ``kind``: the ones eviction
        may take. A block whose children were all yielded earlier in the same walk
        counts as a leaf: a chain goes tail first, so one walk can free a whole chain,
        not only its tail (the store skips a pinned block, and a request pins its whole
        prefix with it)."""
        children, entries = self._children[kind], self._entries
        offered: dict[ChunkKey, int] = {}  # children of each block yielded in this walk
        for key in order:
            if children.get(key, 0) > offered.get(key, 0):
                continue
            meta = entries.get(key)
            if meta is not None and meta.parent is not None and kind in meta.sizes:
                offered[meta.parent] = offered.get(meta.parent, 0) + 1
            yield key

    def extended(self, kind: TierKind, keys: Iterable[ChunkKey]) -> set[ChunkKey]:
        """The blocks of ``keys`` held in ``kind`` that a block held there extends, other
        than those of ``keys`` that are free to go themselves: the prefixes a move of
        ``keys`` out of ``kind`` must leave behind, whatever order ``keys`` come in."""
        entries, children = self._entries, self._children[kind]
        batch = {key for key in keys if self.holds(kind, key)}
        going: dict[ChunkKey, int] = {}  # children of each block that are in the batch
        for key in batch:
            parent = entries[key].parent
            if parent is not None:
                going[parent] = going.get(parent, 0) + 1
        kept: set[ChunkKey] = set()
        for key in batch:
            while key in batch and key not in kept and children.get(key, 0) > going.get(key, 0):
                kept.add(key)  # and its whole prefix in the batch: it stays with it
                parent = entries[key].parent
                if parent is None:
                    break
                going[parent] -= 1
                key = parent
        return kept

    def holds(self, kind: TierKind, key: ChunkKey) -> bool:
        meta = self._entries.get(key)
        return meta is not None and kind in meta.sizes

    def may_hold(self, kind: TierKind, key: ChunkKey) -> bool:
        """Whether ``kind`` is worth asking for ``key``: the index says it holds a
        copy, or the tier is shared and the index knows nothing of the key."""
        meta = self._entries.get(key)
        return kind.shared if meta is None else kind in meta.sizes

    def pin(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Pin every known key; return the keys pinned (to hand back to ``unpin``)."""
        pinned = []
        for key in keys:
            meta = self._entries.get(key)
            if meta is not None:
                meta.pins += 1
                pinned.append(key)
        return pinned

    def unpin(self, keys: Iterable[ChunkKey]) -> list[tuple[bytes, ChunkKey]]:
        """Unpin ``keys``; return (namespace, key) of those now unpinned that a delete
        was waiting for (``BlockMeta.deleted``)."""
        released = []
        for key in keys:
            meta = self._entries.get(key)
            if meta is not None and meta.pins > 0:
                meta.pins -= 1
                if meta.deleted and not meta.pins:
                    released.append((meta.namespace, key))
        return released

    def held_by(self, kind: TierKind) -> list[tuple[bytes, ChunkKey]]:
        """(namespace, key) of every block ``kind`` holds, as a snapshot."""
        return [(meta.namespace, key) for key, meta in self._entries.items() if kind in meta.sizes]

    def count(self, kind: TierKind) -> int:
        return sum(1 for meta in self._entries.values() if kind in meta.sizes)

    def of_namespace(self, namespace: bytes) -> list[tuple[ChunkKey, BlockMeta]]:
        """Every block of ``namespace`` the index knows, as a snapshot."""
        return [(key, meta) for key, meta in self._entries.items() if meta.namespace == namespace]

    def usage(self) -> dict[bytes, dict[TierKind, tuple[int, int]]]:
        """(blocks, stored bytes) of each tier, per namespace: one pass over the index,
        for an operator's question, not for a request path."""
        usage: dict[bytes, dict[TierKind, tuple[int, int]]] = {}
        for meta in self._entries.values():
            tiers = usage.setdefault(meta.namespace, {})
            for kind, nbytes in meta.sizes.items():
                blocks, total = tiers.get(kind, (0, 0))
                tiers[kind] = (blocks + 1, total + nbytes)
        return usage

    def by_tier(self, keys: Sequence[ChunkKey]) -> dict[TierKind, list[ChunkKey]]:
        """``keys`` grouped by each tier holding them, in the order given."""
        grouped: dict[TierKind, list[ChunkKey]] = {}
        for key in keys:
            meta = self._entries.get(key)
            if meta is not None:
                for kind in meta.sizes:
                    grouped.setdefault(kind, []).append(key)
        return grouped


class RecentMisses:
    """Keys a shared tier answered it does not hold, each forgotten ``ttl_s`` later.

    The window is what another host's put may stay unseen by a lookup here (its
    write-through plus this), so it is short; ``ttl_s`` 0 remembers nothing. At
    most ``limit`` keys, the oldest forgotten first.
    """

    def __init__(self, ttl_s: float, limit: int = 1 << 16) -> None:
        self.ttl_s = ttl_s
        self._limit = limit
        self._until: OrderedDict[tuple[TierKind, ChunkKey], float] = OrderedDict()

    def missed(self, kind: TierKind, key: ChunkKey, now: float) -> bool:
        """Whether ``kind`` said it lacks ``key`` less than ``ttl_s`` before ``now``."""
        until = self._until.get((kind, key))
        if until is None:
            return False
        if until > now:
            return True
        del self._until[(kind, key)]
        return False

    def add(self, kind: TierKind, keys: Iterable[ChunkKey], now: float) -> None:
        if self.ttl_s <= 0:
            return
        until = now + self.ttl_s
        for key in keys:
            self._until[(kind, key)] = until
            self._until.move_to_end((kind, key))
        while len(self._until) > self._limit:
            self._until.popitem(last=False)

    def forget(self, keys: Iterable[ChunkKey]) -> None:
        """Drop ``keys`` (stored here just now: a shared tier may hold them soon)."""
        if not self._until:
            return
        for key in keys:
            for kind in TierKind:
                self._until.pop((kind, key), None)

"""Moving blocks between tiers: admission, write-back eviction, promotion, codecs.

::

    admit(tier) ──► room? ──no──► evict_one(tier): the policy's first unpinned,
        │                           unprotected victim is written back to the
        │                           next tier down (or where the policy says),
        │                           unless that tier holds it already, then
        │                           removed here; only the last tier drops
        │                           blocks for good; a victim whose write-back
        │                           fails stays, and the new block does not fit
        ▼
    put_many(batch) ──TierFull──► evict one more, retry with half the batch
        │
        └─ blocks that still do not fit spill to the next tier down

Invariants kept here:

* ``used_bytes <= capacity_bytes`` for every tier after every admission, except a
  shared tier whose servers own its capacity (``server_owned``): the store never
  evicts there, as its account of what other hosts wrote is not the servers'.
* A chain being written (``protect``) never evicts itself: a chain longer
  than a tier keeps its head there and spills its tail down.
* A block the store acknowledged leaves a tier only for a copy below, or at
  the last tier: when the write-back fails (a full disk, a tier that is down)
  the victim stays where it is and the block that wanted its room is refused
  (``puts_dropped``), since the engine still has that one and can put it again.
* The index records a copy only after the tier accepted the write, so a
  reader never finds a key whose bytes are not all there.
* A reserved extent (``reserve``: the daemon writes a block straight into
  the arena as it arrives, ``kvstore.store.reservation``) counts against capacity
  from the moment it is reserved, and is in the index only once ``publish``ed.

Every method expects the store lock to be held (the store owns it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import Block, Codec, encode_block, frame_block, parse_header, stored_block
from kvstore.codec import CodecSpec, decode_payload, encode_payload
from kvstore.errors import CorruptBlock, TierError, TierFull
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.guarded import GuardedTier
from kvstore.store.index import BlockIndex, BlockMeta
from kvstore.store.reservation import Filled, Reservation
from kvstore.store.stats import StoreStats
from kvstore.throttled_log import ThrottledLog
from kvstore.tiers.arena_tier import ArenaTier

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Admission:
    """One block on its way into a tier, with its parent in the chain."""

    key: ChunkKey
    block: Block
    parent: ChunkKey | None


@dataclass(frozen=True, slots=True)
class CopiedDown:
    """What a copy down did: the keys now held below, and those whose write failed
    (their only good copy is still the one being copied)."""

    stored: set[ChunkKey]
    failed: set[ChunkKey]


class TierOccupancy:
    """How full each tier is now (``eviction.Occupancy``), read from the tiers on each
    call: what the policy is shown when it names a victim's destination."""

    def __init__(self, tiers: dict[TierKind, GuardedTier]) -> None:
        self._tiers = tiers
        self.kinds = tuple(sorted(tiers))

    def used_bytes(self, kind: TierKind) -> int:
        return self._tiers[kind].used_bytes()

    def capacity_bytes(self, kind: TierKind) -> int:
        return self._tiers[kind].capacity_bytes()


class Placement:
    """The mechanics of the hierarchy; the policy only orders victims."""

    def __init__(
        self,
        tiers: dict[TierKind, GuardedTier],
        codecs: dict[TierKind, CodecSpec],
        index: BlockIndex,
        policy: EvictionPolicy,
        stats: StoreStats,
        server_owned: frozenset[TierKind] = frozenset(),
    ) -> None:
        self.tiers = tiers
        self.order = sorted(tiers)
        # Shared tiers whose servers own their capacity (``maxmemory``): the store never
        # evicts there, whatever its own accounting of them says.
        self.server_owned = server_owned
        self._codecs = codecs
        self._index = index
        self._policy = policy
        self._stats = stats
        self._failed_writebacks = ThrottledLog(logger, every_s=10.0)
        self.occupancy = TierOccupancy(tiers)

    @property
    def fastest(self) -> TierKind:
        return self.order[0]

    def below(self, kind: TierKind) -> TierKind | None:
        position = self.order.index(kind)
        return self.order[position + 1] if position + 1 < len(self.order) else None

    # -- admission ------------------------------------------------------------

    def admit(
        self,
        kind: TierKind,
        namespace: bytes,
        admissions: Sequence[Admission],
        *,
        session: str | None = None,
        protect: frozenset[ChunkKey] = frozenset(),
    ) -> set[ChunkKey]:
        """Write blocks into tier ``kind``, evicting from it first as needed.

        ``protect`` (the chain being written; it always includes
        ``admissions``) is never evicted to make room for itself. Blocks that
        do not fit even after evicting every other unpinned block spill to the
        next tier down, or are dropped at the last. Returns the keys now held
        somewhere.
        """
        if not admissions:
            return set()
        protect = protect | {a.key for a in admissions}
        tier = self.tiers[kind]
        capacity = tier.capacity_bytes()
        stored: set[ChunkKey] = set()
        spill: list[Admission] = []
        pending = list(admissions)
        limit = len(pending)
        server_owned = kind in self.server_owned
        # Once a walk of the victims frees nothing, none will until this call ends: its
        # own blocks are protected and nothing else is unpinned meanwhile. The rest then
        # takes free space only, instead of walking every pinned block again per block.
        evictable = True
        while pending:
            if server_owned:
                batch = pending[:limit]
            else:
                batch, evictable = self._fill_batch(
                    kind, pending[:limit], capacity, protect, evictable
                )
            if not batch:
                spill.append(pending.pop(0))
                continue
            try:
                written = tier.put_many(namespace, [(a.key, a.block) for a in batch])
            except TierFull:
                if server_owned:  # full by the server's account, which evicts for itself
                    del pending[: len(batch)]
                    spill.extend(batch)
                    continue
                # The backend disagrees with our accounting (fragmentation, LMDB
                # page overhead): evict one more and retry with a smaller batch.
                evicted = self.evict_one(kind, protect)
                if len(batch) > 1:
                    limit = max(1, len(batch) // 2)
                elif not evicted:
                    spill.append(pending.pop(0))
                continue
            del pending[: len(batch)]
            if not written:
                spill.extend(batch)
                continue
            counters = self._stats.tier(kind)
            for admission in batch:
                self._index.record(
                    kind,
                    admission.key,
                    namespace,
                    admission.parent,
                    admission.block.nbytes,
                    session,
                )
                counters.bytes_written += admission.block.nbytes
                stored.add(admission.key)
            self._policy.on_access(kind, [a.key for a in batch], session)
        return stored | self._spill(kind, namespace, spill, session, protect)

    def _spill(
        self,
        kind: TierKind,
        namespace: bytes,
        spill: list[Admission],
        session: str | None,
        protect: frozenset[ChunkKey],
    ) -> set[ChunkKey]:
        """Admit what did not fit into ``kind`` to the next tier down."""
        lower = self.below(kind)
        if not spill or lower is None:
            return set()
        already: set[ChunkKey] = set()
        moving: list[Admission] = []
        for admission in spill:
            meta = self._index.get(admission.key)
            if meta is not None and any(other >= lower for other in meta.sizes):
                already.add(admission.key)  # a copy is already held lower down
            else:
                moving.append(
                    Admission(
                        admission.key, self.reencode(admission.block, lower), admission.parent
                    )
                )
        return already | self.admit(lower, namespace, moving, session=session, protect=protect)

    def _fill_batch(
        self,
        kind: TierKind,
        pending: list[Admission],
        capacity: int,
        protect: frozenset[ChunkKey],
        evictable: bool,
    ) -> tuple[list[Admission], bool]:
        """The longest head of ``pending`` that fits ``kind`` after evicting for it (only
        into free space unless ``evictable``), and whether eviction may still free more."""
        tier = self.tiers[kind]
        batch: list[Admission] = []
        need = 0
        for admission in pending:
            if need + admission.block.nbytes > capacity:
                break
            batch.append(admission)
            need += admission.block.nbytes
        while batch and tier.used_bytes() + need > capacity:
            if not (
                evictable and self.make_room(kind, tier.used_bytes() + need - capacity, protect)
            ):
                evictable = False  # nothing left to evict: shrink to what fits now
                while batch and tier.used_bytes() + need > capacity:
                    need -= batch.pop().block.nbytes
        return batch, evictable

    # -- reservations (blocks written in place) ----------------------------------

    def reserve(self, kind: TierKind, nbytes: int, protect: frozenset[ChunkKey]) -> int | None:
        """Reserve an extent of ``nbytes`` in arena tier ``kind``, evicting for it as an
        admission would (never ``protect``); ``None`` if it cannot be made to fit or
        ``kind`` is not an arena (the caller then admits the block the usual way).

        The block is not verified yet, so eviction here only demotes: with no
        tier below ``kind`` to write victims back to, only free space is used,
        and a put that then fails has lost nobody's blocks.
        """
        guarded = self.tiers[kind]
        tier = guarded.tier
        if not isinstance(tier, ArenaTier) or nbytes > guarded.capacity_bytes():
            return None
        may_evict = self.below(kind) is not None
        try:
            while guarded.used_bytes() + nbytes > guarded.capacity_bytes():
                if not (may_evict and self.evict_one(kind, protect)):
                    return None
            while (offset := tier.reserve(nbytes)) is None:  # fragmented: one more
                if not (may_evict and self.evict_one(kind, protect)):
                    return None
        except TierError:
            return None
        return offset

    def publish(
        self, kind: TierKind, namespace: bytes, filled: Sequence[Filled], session: str | None
    ) -> set[ChunkKey]:
        """Make blocks written and verified in reservations visible: in the tier's index,
        then in the store's (the order ``admit`` keeps); the reservations end. Returns
        their keys."""
        if not filled:
            return set()
        tier = self.tiers[kind].tier
        assert isinstance(tier, ArenaTier), "only arena tiers hand out reservations"
        spans = [(e.key, e.reservation.offset, e.reservation.nbytes) for e in filled]
        tier.publish(namespace, spans)
        for entry in filled:
            entry.reservation.open = False
        self.record_stored(
            kind,
            namespace,
            [(entry.key, entry.parent, entry.reservation.nbytes) for entry in filled],
            session,
        )
        return {entry.key for entry in filled}

    def record_stored(
        self,
        kind: TierKind,
        namespace: bytes,
        stored: Sequence[tuple[ChunkKey, ChunkKey | None, int]],
        session: str | None = None,
    ) -> None:
        """Index blocks (key, parent, stored bytes) that tier ``kind`` accepted from a writer
        other than ``admit`` (a published reservation, a write-through), count their bytes
        and tell the policy."""
        counters = self._stats.tier(kind)
        for key, parent, nbytes in stored:
            self._index.record(kind, key, namespace, parent, nbytes, session)
            counters.bytes_written += nbytes
        self._policy.on_access(kind, [key for key, _, _ in stored], session)

    def unreserve(self, kind: TierKind, reservations: Sequence[Reservation]) -> None:
        """End the reservations still open without publishing them: their space goes
        back."""
        offsets = []
        for reservation in reservations:
            if reservation.open:
                reservation.open = False
                offsets.append(reservation.offset)
        if offsets:
            tier = self.tiers[kind].tier
            assert isinstance(tier, ArenaTier), "only arena tiers hand out reservations"
            tier.unreserve(offsets)

    # -- eviction -------------------------------------------------------------

    def evict_one(self, kind: TierKind, protect: frozenset[ChunkKey] = frozenset()) -> bool:
        """Evict the policy's first unpinned, unprotected victim from ``kind``."""
        return self.make_room(kind, 1, protect)

    def make_room(self, kind: TierKind, nbytes: int, protect: frozenset[ChunkKey]) -> bool:
        """Evict the policy's first unpinned, unprotected victims from ``kind`` (only
        leaves there if the policy asks: ``BlockIndex.leaves``) until they held at
        least ``nbytes`` (as the index counts them; an arena's page rounding may leave
        the caller a little short); whether any victim left (none does when every
        write-back failed)."""
        victims: list[tuple[ChunkKey, BlockMeta]] = []
        freed = 0
        order = self._policy.victims(kind)
        if self._policy.leaves_only:
            order = self._index.leaves(kind, order)
        for key in order:
            meta = self._index.get(key)
            if meta is None or kind not in meta.sizes:
                self._policy.on_remove(kind, key)
                continue
            if meta.pins or key in protect:
                continue
            victims.append((key, meta))
            freed += meta.sizes[kind]
            if freed >= nbytes:
                break
        return self.evict_many(kind, victims) > 0

    def _destination(self, kind: TierKind, key: ChunkKey) -> TierKind | None:
        """Where a victim of ``kind`` is written back: the tier the policy names if it is
        a configured, slower one; else the next tier down (``None`` below the last)."""
        target = self._policy.destination(kind, key, self.occupancy)
        if target is not None and target > kind and target in self.tiers:
            return target
        return self.below(kind)

    def evict(
        self,
        kind: TierKind,
        key: ChunkKey,
        meta: BlockMeta,
        *,
        to: TierKind | None = None,
        drop: bool = False,
    ) -> bool:
        """``evict_many`` for one block; whether it left."""
        return self.evict_many(kind, [(key, meta)], to=to, drop=drop) > 0

    def evict_many(
        self,
        kind: TierKind,
        victims: Sequence[tuple[ChunkKey, BlockMeta]],
        *,
        to: TierKind | None = None,
        drop: bool = False,
    ) -> int:
        """Write each victim back into its destination (``to`` if given, else where the
        policy says or the next tier down) unless that tier holds it already, then
        drop it from ``kind``; ``drop`` skips the write-back. A block that cannot be
        read back is dropped, not moved; one whose write-back failed stays (counted in
        ``writebacks_failed``, logged). Victims going to one tier move in one batch.
        Returns how many left ``kind``.

        A copy further down (SSD, say, for a block leaving HBM) does not stand in
        for the write-back: the block would then be served from the slowest copy
        for as long as it is used, where one write puts it a tier faster."""
        moving: dict[tuple[TierKind, bytes], list[tuple[ChunkKey, BlockMeta]]] = {}
        for key, meta in victims:
            lower = None if drop else (to if to is not None else self._destination(kind, key))
            if lower is not None and lower not in meta.sizes:
                moving.setdefault((lower, meta.namespace), []).append((key, meta))
        kept: set[ChunkKey] = set()
        for (lower, namespace), items in moving.items():
            kept |= self.copy_down(kind, lower, namespace, items).failed
        counters = self._stats.tier(kind)
        if kept:
            counters.writebacks_failed += len(kept)
            self._failed_writebacks.warning(
                "%d block(s) kept in %s: their write-back to a slower tier failed "
                "(full disk or tier down); new blocks are refused until it succeeds",
                len(kept),
                kind.label,
            )
        leaving: dict[bytes, list[ChunkKey]] = {}
        for key, meta in victims:
            if key not in kept:
                leaving.setdefault(meta.namespace, []).append(key)
        for namespace, keys in leaving.items():
            self.tiers[kind].delete_many(namespace, keys)
        for key, _ in victims:
            if key in kept:
                continue
            self._index.drop(kind, key)
            self._policy.on_remove(kind, key)
            if self._index.get(key) is not None:
                counters.demotions += 1
            else:
                counters.evictions += 1
        return len(victims) - len(kept)

    def copy_down(
        self,
        kind: TierKind,
        lower: TierKind,
        namespace: bytes,
        items: Sequence[tuple[ChunkKey, BlockMeta]],
    ) -> CopiedDown:
        """Copy ``items`` of tier ``kind`` into tier ``lower``, framed for its codec (the
        copy in ``kind`` stays: an eviction's write-back, or an early one)."""
        keys = [key for key, _ in items]
        buffers = self.tiers[kind].get_many(namespace, keys) or [None] * len(keys)
        admissions = []
        for (key, meta), buffer in zip(items, buffers, strict=True):
            if buffer is None:
                continue
            try:
                block = self.reencode(stored_block(buffer), lower)
            except CorruptBlock:
                self._stats.tier(kind).corrupt_blocks += 1
                continue
            admissions.append(Admission(key, block, meta.parent))
        stored = self.admit(lower, namespace, admissions, protect=frozenset(keys))
        return CopiedDown(stored, {a.key for a in admissions} - stored)

    def forget(self, kind: TierKind, namespace: bytes, key: ChunkKey) -> int:
        """Delete ``kind``'s copy of ``key`` (bad or unwanted) and forget it; returns how
        many the tier deleted."""
        deleted = self.tiers[kind].delete_many(namespace, [key])
        self.unindex(kind, key)
        return deleted

    def unindex(self, kind: TierKind, key: ChunkKey) -> None:
        """Forget ``kind``'s copy of ``key`` without asking the tier to delete it: the
        tier answered that it has none (evicted, expired, or behind a master that is
        down, which may still hold it: a delete sent there would only wait on it)."""
        if self._index.drop(kind, key):
            self._policy.on_remove(kind, key)

    def forget_everywhere(self, namespace: bytes, key: ChunkKey) -> bool:
        """Delete every copy of ``key`` (and any a shared tier may hold without this
        index knowing); whether any tier held one."""
        meta = self._index.get(key)
        held = set(meta.sizes) if meta is not None else set()
        found = bool(held)
        for kind in self.order:
            if kind in held or kind.shared:
                found = self.forget(kind, namespace, key) > 0 or found
        return found

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Unpin ``keys``, deleting those a delete was waiting on (``TieredStore.delete``)."""
        for namespace, key in self._index.unpin(keys):
            self.forget_everywhere(namespace, key)

    def touch(self, keys: Sequence[ChunkKey], session: str | None = None) -> None:
        """Tell the policy a chain was used, per tier holding it, head first."""
        for kind, chain in self._index.by_tier(keys).items():
            self._policy.on_access(kind, chain, session)

    def count_promotions(self, admissions: Sequence[Admission], target: TierKind) -> int:
        """Count admissions that reached ``target``, per tier they came from."""
        promoted = 0
        for admission in admissions:
            meta = self._index.get(admission.key)
            if meta is not None and target in meta.sizes:
                source = min((kind for kind in meta.sizes if kind > target), default=target)
                self._stats.tier(source).promotions += 1
                promoted += 1
        return promoted

    # -- codecs -----------------------------------------------------------------

    def encode(
        self,
        namespace: Namespace,
        key: ChunkKey,
        parent: ChunkKey | None,
        raw: memoryview,
        kind: TierKind,
    ) -> Block:
        """Frame raw chunk bytes for tier ``kind`` (its codec applied)."""
        spec = self._codecs[kind]
        payload = memoryview(encode_payload(raw, namespace.layout.dtype, spec.codec, spec.level))
        return encode_block(namespace, key, parent, payload, codec=spec.codec, raw_len=raw.nbytes)

    def codec(self, kind: TierKind) -> Codec:
        """The codec tier ``kind`` stores payloads in."""
        return self._codecs[kind].codec

    def reencode(self, block: Block, kind: TierKind) -> Block:
        """``block`` framed for tier ``kind``'s codec (itself if the codec matches)."""
        header = parse_header(block.header)
        spec = self._codecs[kind]
        if header.codec is spec.codec:
            return block
        raw = decode_payload(block.payload, header.dtype, header.codec, header.raw_len)
        payload = memoryview(encode_payload(raw, header.dtype, spec.codec, spec.level))
        return frame_block(dataclasses.replace(header, codec=spec.codec), payload)

    # -- restart --------------------------------------------------------------

    def rebuild_index(self) -> None:
        """Index the blocks persistent tiers already hold (after a restart).

        Only headers are read. A header that does not parse or does not match
        the key it is stored under is deleted and counted as corrupt; payloads
        are verified when read, as always. A server-owned shared tier is not
        scanned: it holds every host's blocks (a scan of a cluster's millions of
        keys would hold up the start for minutes), its servers evict them behind
        our back, and a lookup asks it about any key the index does not know.
        """
        for kind in self.order:
            if kind in self.server_owned:
                continue
            infos = self.tiers[kind].scan()
            for info in infos or ():
                try:
                    header = parse_header(info.header)
                    if header.key != info.key or header.namespace_digest != info.namespace:
                        raise CorruptBlock("header does not match the key it is stored under")
                except CorruptBlock:
                    self.tiers[kind].delete_many(info.namespace, [info.key])
                    self._stats.tier(kind).corrupt_blocks += 1
                    continue
                self._index.record(kind, info.key, info.namespace, header.parent, info.nbytes)
                self._policy.on_access(kind, [info.key])

"""``StoreCore``: one store's state, and the steps its faces share.

::

    TieredStore ──┐                       ┌── index      which tiers hold each chunk
    AsyncTiered ──┼──► StoreCore ── state ┼── placement  admission, eviction, promotion
    SharedServing ┤    (one per store)    ├── stats      the counters
    Maintenance ──┘                       └── lock       guarding the three
                       + reader (verified reads out of a tier), write-through

The faces (``TieredStore``, and through it ``AsyncTieredStore``; ``SharedServing``,
what other processes may do through a daemon; ``Maintenance``) work through
this object's methods and its ``state`` (``kvstore.store.state``: who owns what,
and the rule that nothing outside ``kvstore/store`` touches it). What a face
adds is its method's shape (arguments, validation, what it returns and
counts); the steps more than one of them needs (locate, read, store a chain,
record hits) are here, once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.block import HEADER_BYTES, Block
from kvstore.breaker import BreakerConfig
from kvstore.codec import CodecSpec
from kvstore.errors import KVStoreError, LayoutMismatch, RequestTooLarge, UnknownNamespace
from kvstore.keys import ChunkKey, Namespace, TokensOrKeys, keys_of
from kvstore.kinds import TierKind
from kvstore.store.chunk import KVChunk
from kvstore.store.config import StoreConfig
from kvstore.store.eviction import EvictionPolicy, LRUPolicy
from kvstore.store.guarded import GuardedTier
from kvstore.store.index import BlockIndex, RecentMisses
from kvstore.store.placement import Admission, Placement
from kvstore.store.reader import BlockReader
from kvstore.store.state import StoreState
from kvstore.store.stats import StoreStats
from kvstore.store.write_through import WriteThrough
from kvstore.tiers.registry import open_tier

logger = logging.getLogger(__name__)


class StoreCore:
    """One store's lock, index, placement, reader and counters (module docstring)."""

    def __init__(self, config: StoreConfig, policy: EvictionPolicy | None = None) -> None:
        self.config = config
        # Guards everything below; re-entrant, as policies call back into the store.
        self._lock = threading.RLock()
        # Mutated with ``lock`` held (the lookup counters with ``_lookup_counts_lock``, as
        # a lookup takes no other: ``count_lookup``); ``snapshot`` copies them for readers.
        self._stats = StoreStats()
        self._lookup_counts_lock = threading.Lock()
        # Mutated only by ``placement`` and this class, with ``lock`` held; a lookup reads
        # it without (``BlockIndex.fastest``).
        self._index = BlockIndex()
        # Keys a shared tier said it lacks, for ``config.shared_miss_ttl_s``; under ``lock``.
        self._shared_misses = RecentMisses(config.shared_miss_ttl_s)
        # Owns the checksum worker thread; safe to call without the lock.
        self._reader = BlockReader()
        self._namespaces: dict[bytes, Namespace] = {}  # digest -> namespace; under ``lock``
        # digest -> when last named (a tick of ``_uses``); written without the lock, as a
        # dict assignment is atomic, and read under it to pick the namespace to forget.
        self._last_used: dict[bytes, int] = {}
        self._uses = itertools.count()
        self._closed = False  # set once, under ``lock``, by ``close``
        tiers: dict[TierKind, GuardedTier] = {}
        codecs: dict[TierKind, CodecSpec] = {}
        breaker = BreakerConfig(config.breaker_min_open_s, config.breaker_max_open_s)
        try:
            for tier_config in config.tiers:
                counters = self._stats.tier(tier_config.kind)
                codecs[tier_config.kind] = CodecSpec.parse(tier_config.codec)
                tier = open_tier(tier_config)
                counters.capacity_bytes = tier.capacity_bytes()  # a tier may size down
                tiers[tier_config.kind] = GuardedTier(tier, counters, self._lock, breaker)
        except BaseException:
            for opened in tiers.values():
                opened.close()
            raise
        # Only a shared tier may write through (``TierConfig``): its servers own its capacity.
        server_owned = frozenset(t.kind for t in config.tiers if t.writes_through)
        self._placement = Placement(
            tiers,
            codecs,
            self._index,
            policy if policy is not None else LRUPolicy(),
            self._stats,
            server_owned,
        )
        self.has_shared_tier = any(kind.shared for kind in tiers)
        for kind, guarded in tiers.items():
            if kind.shared and guarded.check() and kind in server_owned:  # remote: is it there?
                _check_eviction(guarded)
        self.state = StoreState(self._lock, self._index, self._placement, self._stats)
        if config.scan_on_open:
            with self._lock:
                self._placement.rebuild_index()
        # Shared tiers a put is copied to (``kvstore.store.write_through``), each by its
        # own thread; never the fastest tier, which a put writes itself.
        self._write_through = [
            WriteThrough(t.kind, self.state, t.write_queue)
            for t in config.tiers
            if t.kind in server_owned and t.kind != self._placement.fastest
        ]

    # -- namespaces and keys ----------------------------------------------------

    def register(self, namespace: Namespace, limit: int | None = None) -> Namespace | None:
        """Make ``namespace`` known (every call that takes one does this first). With
        ``limit``, a table that holds that many already forgets the namespace named least
        recently, which is returned: its blocks stay where they are, and a client that
        names it again is told it is unknown and registers it again (``kvstore.client``)."""
        with self._lock:
            self._last_used[namespace.digest] = next(self._uses)
            if namespace.digest in self._namespaces:
                return None
            forgotten = None
            if limit is not None and len(self._namespaces) >= limit:
                digest = min(self._namespaces, key=lambda d: self._last_used.get(d, -1))
                forgotten = self._namespaces.pop(digest)
                self._last_used.pop(digest, None)
                self._stats.namespaces_forgotten += 1
            self._namespaces[namespace.digest] = namespace
            return forgotten

    def namespace(self, digest: bytes) -> Namespace:
        """The registered namespace with this digest; ``UnknownNamespace`` otherwise."""
        try:
            namespace = self._namespaces[digest]
        except KeyError:
            raise UnknownNamespace(f"namespace {digest.hex()} is not registered") from None
        self._last_used[digest] = next(self._uses)
        return namespace

    def registered_namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    def chain(
        self, namespace: Namespace, tokens_or_keys: TokensOrKeys, count: int
    ) -> list[ChunkKey]:
        """The keys of the first ``count`` chunks, which a put of ``count`` chunks writes."""
        keys = keys_of(namespace, tokens_or_keys)
        if count > len(keys):
            raise LayoutMismatch(f"{count} chunks given for {len(keys)} full chunks of tokens")
        self.check_batch(count)
        return keys[:count]

    def bytes_per_token(self, namespace: Namespace) -> float:
        """KV bytes per token for the cost model: configured, else the namespace layout's."""
        configured = self.config.costs.kv_bytes_per_token
        return configured or namespace.layout.chunk_nbytes / namespace.chunk_tokens

    # -- checks -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise KVStoreError("the store is closed")

    def check_batch(self, count: int) -> None:
        if count > self.config.max_batch_chunks:
            raise RequestTooLarge(
                f"{count} chunks in one request; the limit is {self.config.max_batch_chunks}"
            )

    def check_lookup(self, count: int) -> None:
        if count > self.config.max_lookup_chunks:
            raise RequestTooLarge(
                f"{count} keys in one lookup; the limit is {self.config.max_lookup_chunks}"
            )

    # -- where blocks are -------------------------------------------------------

    def locate(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> list[TierKind | None]:
        """The fastest tier holding each key, or ``None``: every key, not only the
        leading run, and nothing counted as a lookup."""
        self.register(namespace)
        keys = list(keys)
        self.check_lookup(len(keys))
        with self._lock:
            self.check_open()
            located = self._index.fastest(keys)
        for kind in self._placement.order:
            if kind.shared:
                self._confirm_shared(kind, namespace, keys, located)
        return located

    def locate_local(
        self, namespace: Namespace, keys: Sequence[ChunkKey]
    ) -> list[TierKind | None] | None:
        """``locate`` from the index alone and without the store's lock
        (``BlockIndex.fastest``), or ``None`` where that cannot answer: a shared
        tier must be asked (the index only vouches for local tiers), or the
        namespace is not registered yet (``register`` takes the lock)."""
        digest = namespace.digest
        if self.has_shared_tier or digest not in self._namespaces:
            return None
        self._last_used[digest] = next(self._uses)
        self.check_lookup(len(keys))
        self.check_open()
        return self._index.fastest(keys)

    def count_lookup(self, namespace: Namespace, keys: int, hits: int) -> None:
        """Count a lookup of ``keys`` keys whose leading ``hits`` are cached (under a lock
        of its own: a lookup does not take the store's)."""
        with self._lookup_counts_lock:
            self._stats.lookups += 1
            self._stats.lookup_tokens += keys * namespace.chunk_tokens
            self._stats.lookup_hit_tokens += hits * namespace.chunk_tokens

    def _confirm_shared(
        self,
        kind: TierKind,
        namespace: Namespace,
        keys: list[ChunkKey],
        located: list[TierKind | None],
    ) -> None:
        """Ask shared tier ``kind`` about every key the index cannot place faster.

        The index cannot vouch for a shared tier: other processes add blocks and
        the server may evict, expire or lose them (a restart without
        persistence). So keys unknown locally, and keys whose fastest copy is in
        this tier, are confirmed with one batched round trip, except the keys it
        said it lacks a moment ago (``shared_misses``). A tier that does not answer
        confirms nothing: its keys count as not cached.
        """
        now = time.monotonic()
        with self._lock:
            asked = [
                i
                for i, tier in enumerate(located)
                if tier is kind
                or (tier is None and not self._shared_misses.missed(kind, keys[i], now))
            ]
        if not asked:
            return
        tier = self._placement.tiers[kind]
        present = tier.contains_many(namespace.digest, [keys[i] for i in asked])
        lost: list[ChunkKey] = []
        absent: list[ChunkKey] = []
        for position, index in enumerate(asked):
            if present is not None and present[position]:
                located[index] = kind
                continue
            if located[index] is kind:
                located[index] = None
                if present is not None:
                    lost.append(keys[index])
            if present is not None:
                absent.append(keys[index])
        if lost or absent:
            with self._lock:
                for key in lost:
                    self._placement.unindex(kind, key)
                self._shared_misses.add(kind, absent, now)

    # -- writing ----------------------------------------------------------------

    def needs_storing(self, namespace: Namespace, key: ChunkKey) -> bool:
        """Whether a put writes ``key``: it is not held, or held only in tiers that
        reload slower than recomputing. Lock held.

        A delete waiting on the key's pins (``TieredStore.delete``) is called off:
        the put wants the block kept, and the copy held is the same content."""
        meta = self._index.get(key)
        if meta is not None:
            meta.deleted = False
        fastest = meta.fastest if meta is not None else None
        if fastest is None:
            return True
        return not self.config.costs.worth_loading(fastest, self.bytes_per_token(namespace))

    def store_chain(
        self,
        namespace: Namespace,
        chain: list[ChunkKey],
        present: list[int],
        frame: Callable[[int, ChunkKey | None], Block],
        session: str | None,
    ) -> int:
        """Admit chunk ``i`` of ``chain`` for each ``i`` in ``present`` (``frame(i, parent)``
        makes its block) unless already held; return how many were stored.

        ``chain`` may start mid-way, at the parent of its first new block: what is
        touched and kept from eviction is its whole prefix (``BlockIndex.lineage``),
        so a parent stays at least as recent as its child either way."""
        placement = self._placement
        with self._lock:
            self.check_open()
            admissions = []
            for index in present:
                if not self.needs_storing(namespace, chain[index]):
                    continue
                parent = chain[index - 1] if index else None
                admissions.append(Admission(chain[index], frame(index, parent), parent))
            prefix = self._index.lineage(chain)
            # Touch the cached part of the chain first so its blocks are the
            # most recent while the new blocks make room.
            placement.touch(prefix, session)
            stored = placement.admit(
                placement.fastest,
                namespace.digest,
                admissions,
                session=session,
                protect=frozenset(prefix),
            )
            placement.touch(prefix, session)
            self._stats.puts += 1
            self._stats.chunks_stored += len(stored)
            self._stats.puts_dropped += len(admissions) - len(stored)
            self._shared_misses.forget(stored)
        self.stored(namespace, [a.key for a in admissions if a.key in stored])
        return len(stored)

    def stored(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> None:
        """A put stored ``keys`` (in chain order): queue their write-through copies."""
        for writer in self._write_through:
            writer.offer(namespace.digest, keys)

    def write_through_pending(self, kind: TierKind) -> int | None:
        """Copies queued for shared tier ``kind`` (``None``: it is not written through)."""
        writer = next((w for w in self._write_through if w.kind is kind), None)
        return None if writer is None else writer.pending

    def drain_write_through(self, deadline: float | None = None) -> bool:
        """Wait until every queued write-through copy is made, or until ``deadline``
        (``time.monotonic``); whether they all were."""
        return all([writer.drain(deadline) for writer in self._write_through])

    # -- reading ----------------------------------------------------------------

    def read(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        payloads: Sequence[np.ndarray] | None = None,
    ) -> list[KVChunk | None]:
        """Read each key from the fastest tier that serves a good copy, pinned meanwhile
        (into ``payloads`` when given). Counts tier hits, not the get."""
        results: list[KVChunk | None] = [None] * len(keys)
        with self._lock:
            self.check_open()
            pinned = self._index.pin(keys)
        try:
            for kind in self._placement.order:
                self._read_from(kind, namespace, keys, results, payloads)
        finally:
            with self._lock:
                self._placement.unpin(pinned)
        return results

    def _read_from(
        self,
        kind: TierKind,
        namespace: Namespace,
        keys: list[ChunkKey],
        results: list[KVChunk | None],
        payloads: Sequence[np.ndarray] | None,
    ) -> None:
        """Fill the still-missing ``results`` that tier ``kind`` can serve."""
        with self._lock:
            wanted = [
                i
                for i, key in enumerate(keys)
                if results[i] is None and self._index.may_hold(kind, key)
            ]
        if not wanted:
            return
        tier = self._placement.tiers[kind]
        if payloads is None:
            outcome = self._reader.read(tier, namespace, keys, wanted)
        else:
            targets = [payloads[i] for i in wanted]
            outcome = self._reader.read_into(tier, namespace, keys, wanted, targets)
        for index, chunk in outcome.chunks:
            results[index] = chunk
        with self._lock:
            counters = self._stats.tier(kind)
            counters.hits += len(outcome.chunks)
            counters.bytes_read += outcome.bytes_read
            counters.corrupt_blocks += len(outcome.bad)
            for key in outcome.bad:
                self._placement.forget(kind, namespace.digest, key)
            for key in outcome.absent:
                if self._index.holds(kind, key):  # vanished: nothing there to delete
                    self._placement.unindex(kind, key)

    def after_hits(
        self, namespace: Namespace, keys: list[ChunkKey], results: Sequence[KVChunk | None]
    ) -> None:
        """Index blocks found in a shared tier, promote lower-tier hits, update recency.
        Lock held."""
        placement = self._placement
        top = placement.fastest
        promotions: list[Admission] = []
        hits: list[ChunkKey] = []
        for key, chunk in zip(keys, results, strict=True):
            if chunk is None:
                continue
            hits.append(key)
            meta = self._index.get(key)
            if meta is None:
                meta = self._index.record(
                    chunk.tier, key, namespace.digest, None, HEADER_BYTES + chunk.payload.nbytes
                )
            if self.config.promote_on_hit and chunk.tier != top and top not in meta.sizes:
                block = placement.encode(namespace, key, meta.parent, chunk.payload, top)
                promotions.append(Admission(key, block, meta.parent))
        placement.touch(hits)
        if promotions:
            placement.admit(top, namespace.digest, promotions, protect=frozenset(hits))
            placement.count_promotions(promotions, top)
            placement.touch(hits)

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Close the reader and every tier (idempotent)."""
        for writer in self._write_through:
            writer.close(deadline=time.monotonic())  # what is queued still has local copies
        with self._lock:
            if not self._closed:
                self._closed = True
                self._reader.close()
                for tier in self._placement.tiers.values():
                    tier.close()


_EVICTING_POLICIES = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})


def _check_eviction(tier: GuardedTier) -> None:
    """Warn when a shared tier's servers will not evict for themselves: the store leaves
    that tier's capacity to them (``maxmemory``, an ``allkeys-*`` policy)."""
    memory = tier.server_memory()
    if memory is None:
        return
    label = tier.kind.label
    if memory.max_bytes == 0:
        logger.warning(
            "tier %s: maxmemory is not set on every master (%d answered of %d); the store "
            "leaves this shared tier's capacity to its servers, so it will grow until they "
            "run out of memory: set maxmemory and maxmemory-policy allkeys-lru",
            label,
            memory.answered,
            memory.masters,
        )
    if not memory.policies <= _EVICTING_POLICIES:
        logger.warning(
            "tier %s: maxmemory-policy %s: a full server refuses writes (noeviction) or "
            "keeps blocks without a TTL (volatile-*); set maxmemory-policy allkeys-lru",
            label,
            ", ".join(sorted(memory.policies - _EVICTING_POLICIES)),
        )

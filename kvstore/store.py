"""``TieredStore``: the embedded store, one facade over every configured tier.

Placement, in one picture (fastest tier first)::

    put ─► [HBM] ──demote──► [DRAM] ──demote──► [SSD/LMDB] ──demote──► [Redis] ──► dropped
             ▲                  │                   │                     │
             └──────────── promote on hit (copy up; the lower copy stays) ┘

* New chunks enter the fastest configured tier; under capacity pressure the
  policy's victims are written back down (``kvstore.placement``).
* A hit in a lower tier is copied up to the fastest tier (``promote_on_hit``).
* A block is never returned unless it verifies: every read from a tier whose
  reads cross a trust boundary (LMDB, Redis) is checked against its checksum,
  and every read is checked against the key and namespace asked for. A block
  that fails is deleted from that tier, counted, and the next tier holding a
  copy is tried; failing all, it is a miss.
* A tier that is down costs a miss, never an exception out of ``lookup`` or
  ``get`` (``kvstore.guarded``).

Concurrency: one re-entrant lock guards the index, the policy and the
counters, and serialises the paths that move blocks (admission, eviction,
promotion, delete). Reads take the lock only to pin what they read and to
record the outcome; the bytes are copied out with the lock released, and a
pinned block is never an eviction victim, so a read in progress cannot have
its block demoted from under it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType

import numpy as np

from kvstore.block import (
    HEADER_BYTES,
    Block,
)
from kvstore.chunk import CachedPrefix, ChunkData, KVChunk, chunk_bytes, destination_bytes
from kvstore.codec import CodecSpec
from kvstore.config import StoreConfig
from kvstore.errors import (
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    UnknownNamespace,
)
from kvstore.guarded import GuardedTier
from kvstore.index import BlockIndex
from kvstore.keys import ChunkKey, Namespace, TokensOrKeys, keys_of
from kvstore.maintenance import Maintenance
from kvstore.placement import Admission, Placement
from kvstore.policy import EvictionPolicy, LRUPolicy
from kvstore.reader import BlockReader
from kvstore.serving import SharedServing
from kvstore.stats import StoreStats
from kvstore.tiers.base import Tier, TierKind
from kvstore.tiers.factory import open_tier


class TieredStore:
    """The embedded, thread-safe tiered KV store. See the module docstring."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
    ) -> None:
        self.config = config if config is not None else StoreConfig.from_env()
        self._lock = threading.RLock()
        self._stats = StoreStats()
        self._index = BlockIndex()
        self._namespaces: dict[bytes, Namespace] = {}
        self._closed = False
        self._reader = BlockReader()
        tiers: dict[TierKind, GuardedTier] = {}
        codecs: dict[TierKind, CodecSpec] = {}
        try:
            for tier_config in self.config.tiers:
                counters = self._stats.tier(tier_config.kind)
                counters.capacity_bytes = tier_config.capacity_bytes
                codecs[tier_config.kind] = CodecSpec.parse(tier_config.codec)
                tiers[tier_config.kind] = GuardedTier(open_tier(tier_config), counters, self._lock)
        except BaseException:
            for opened in tiers.values():
                opened.close()
            raise
        self._placement = Placement(
            tiers, codecs, self._index, policy if policy is not None else LRUPolicy(), self._stats
        )
        self._has_shared_tier = any(kind.shared for kind in tiers)
        if self.config.scan_on_open:
            with self._lock:
                self._placement.rebuild_index()
        self._maintenance = Maintenance(
            self._lock,
            self._index,
            self._placement,
            self._stats,
            self._check_open,
            self.config.scrub_interval_s,
        )
        self.serving = SharedServing(self)  # the daemon's shared-memory paths

    # -- namespaces -------------------------------------------------------

    def register(self, namespace: Namespace) -> None:
        """Make ``namespace`` known (done implicitly by every call that takes one)."""
        with self._lock:
            self._namespaces.setdefault(namespace.digest, namespace)

    def namespace(self, digest: bytes) -> Namespace:
        """The registered namespace with this digest; ``UnknownNamespace`` otherwise."""
        try:
            return self._namespaces[digest]
        except KeyError:
            raise UnknownNamespace(f"namespace {digest.hex()} is not registered") from None

    def registered_namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    def keys_for(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> list[ChunkKey]:
        """Chunk keys of a token sequence, or the given keys checked (``keys.keys_of``)."""
        return keys_of(namespace, tokens_or_keys)

    # -- lookup -----------------------------------------------------------

    def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        """How many leading chunks are cached, the fastest tier holding each, and how
        many of them are worth loading rather than recomputing (``config.costs``)."""
        self.register(namespace)
        keys = self.keys_for(namespace, tokens_or_keys)
        located = self.locate(namespace, keys)
        run = next((i for i, tier in enumerate(located) if tier is None), len(keys))
        with self._lock:
            self._stats.lookups += 1
            self._stats.lookup_tokens += len(keys) * namespace.chunk_tokens
            self._stats.lookup_hit_tokens += run * namespace.chunk_tokens
        tiers = tuple(tier for tier in located[:run] if tier is not None)
        return CachedPrefix(
            chunk_tokens=namespace.chunk_tokens,
            keys=tuple(keys[:run]),
            tiers=tiers,
            total_chunks=len(keys),
            load_chunks=self.config.costs.load_run(
                tiers, namespace.chunk_tokens, self._bytes_per_token(namespace)
            ),
        )

    def _bytes_per_token(self, namespace: Namespace) -> float:
        """KV bytes per token for the cost model: configured, else the namespace layout's."""
        configured = self.config.costs.kv_bytes_per_token
        return configured or namespace.layout.chunk_nbytes / namespace.chunk_tokens

    def lookup_nowait(
        self, namespace: Namespace, tokens_or_keys: TokensOrKeys
    ) -> CachedPrefix | None:
        """``lookup`` if it can be answered at once from memory, else ``None``.

        It can when no shared tier must be asked (the index is authoritative
        for every other tier) and no other thread holds the store's lock. An
        event loop calls this first and falls back to ``lookup`` on a worker
        thread: it saves the thread hop without ever waiting for the lock a
        long put or eviction may hold.
        """
        if self._has_shared_tier or not self._lock.acquire(blocking=False):
            return None
        try:
            return self.lookup(namespace, tokens_or_keys)
        finally:
            self._lock.release()

    def locate(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> list[TierKind | None]:
        """The fastest tier holding each key, or ``None``: every key, not only the
        leading run, and nothing counted as a lookup (the daemon uses it to tell a
        block that is elsewhere from one that is missing)."""
        self.register(namespace)
        keys = list(keys)
        self._check_batch(len(keys))
        with self._lock:
            self._check_open()
            located = self._index.fastest(keys)
        for kind in self._placement.order:
            if kind.shared:
                self._confirm_shared(kind, namespace, keys, located)
        return located

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
        this tier, are confirmed with one batched round trip. A tier that does
        not answer confirms nothing: its keys count as not cached.
        """
        asked = [i for i, tier in enumerate(located) if tier is None or tier is kind]
        if not asked:
            return
        tier = self._placement.tiers[kind]
        present = tier.contains_many(namespace.digest, [keys[i] for i in asked])
        lost: list[ChunkKey] = []
        for position, index in enumerate(asked):
            if present is not None and present[position]:
                located[index] = kind
            elif located[index] is kind:
                located[index] = None
                if present is not None:
                    lost.append(keys[index])
        if lost:
            with self._lock:
                for key in lost:
                    self._placement.forget(kind, namespace.digest, key)

    # -- put --------------------------------------------------------------

    def put(
        self,
        namespace: Namespace,
        tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None],
        *,
        session: str | None = None,
    ) -> int:
        """Store chunk ``i`` of ``kv_chunks`` under the ``i``-th chunk key; return how many
        were newly stored.

        ``kv_chunks[i]`` may be ``None`` for a chunk the caller knows is cached.
        Every chunk is validated before any is stored. Chunks already held are
        not rewritten (a key names its content), only marked as used, unless
        they are held only where reloading is slower than recomputing
        (``config.costs``): the engine recomputed those, and storing them again
        puts them where loading pays.
        """
        self.register(namespace)
        chain = self._chain(namespace, tokens_or_keys, len(kv_chunks))
        payloads = {
            index: chunk_bytes(chunk, namespace.layout)
            for index, chunk in enumerate(kv_chunks)
            if chunk is not None
        }
        placement = self._placement

        def frame(index: int, parent: ChunkKey | None) -> Block:
            return placement.encode(
                namespace, chain[index], parent, payloads[index], placement.fastest
            )

        return self._store_chain(namespace, chain, list(payloads), frame, session)

    def _needs_storing(self, namespace: Namespace, key: ChunkKey) -> bool:
        """Whether a put writes ``key``: it is not held, or held only in tiers that
        reload slower than recomputing. Lock held.

        A delete waiting on the key's pins (``delete``) is called off: the put
        wants the block kept, and the copy held is the same content."""
        meta = self._index.get(key)
        if meta is not None:
            meta.deleted = False
        fastest = meta.fastest if meta is not None else None
        if fastest is None:
            return True
        return not self.config.costs.worth_loading(fastest, self._bytes_per_token(namespace))

    def _chain(
        self, namespace: Namespace, tokens_or_keys: TokensOrKeys, count: int
    ) -> list[ChunkKey]:
        """The keys of the first ``count`` chunks, which a put of ``count`` chunks writes."""
        keys = self.keys_for(namespace, tokens_or_keys)
        if count > len(keys):
            raise LayoutMismatch(f"{count} chunks given for {len(keys)} full chunks of tokens")
        self._check_batch(count)
        return keys[:count]

    def _store_chain(
        self,
        namespace: Namespace,
        chain: list[ChunkKey],
        present: list[int],
        frame: Callable[[int, ChunkKey | None], Block],
        session: str | None,
    ) -> int:
        """Admit chunk ``i`` of ``chain`` for each ``i`` in ``present`` (``frame(i, parent)``
        makes its block) unless already held; return how many were stored."""
        placement = self._placement
        with self._lock:
            self._check_open()
            admissions = []
            for index in present:
                if not self._needs_storing(namespace, chain[index]):
                    continue
                parent = chain[index - 1] if index else None
                admissions.append(Admission(chain[index], frame(index, parent), parent))
            # Touch the cached part of the chain first so its blocks are the
            # most recent while the new blocks make room.
            placement.touch(chain, session)
            stored = placement.admit(
                placement.fastest,
                namespace.digest,
                admissions,
                session=session,
                protect=frozenset(chain),
            )
            placement.touch(chain, session)
            self._stats.puts += 1
            self._stats.chunks_stored += len(stored)
            self._stats.puts_dropped += len(admissions) - len(stored)
        return len(stored)

    # -- get --------------------------------------------------------------

    def get(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        *,
        out: Sequence[ChunkData] | None = None,
    ) -> list[KVChunk | None]:
        """The verified chunk for each key, or ``None`` (a miss). Never raises for a
        tier that is down or a block that is corrupt: both are misses.

        With ``out`` (one host buffer per key, see ``chunk.destination_bytes``)
        each payload is copied straight into the caller's buffer and the
        returned chunks are views of it: no allocation, one copy. The content
        of ``out[i]`` is unspecified where ``None`` is returned.
        """
        self.register(namespace)
        keys = list(keys)
        self._check_batch(len(keys))
        payloads = None
        if out is not None:
            if len(out) != len(keys):
                raise LayoutMismatch(f"{len(out)} destinations for {len(keys)} keys")
            payloads = [destination_bytes(buffer, namespace.layout) for buffer in out]
        results = self._read(namespace, keys, payloads)
        with self._lock:
            self._stats.gets += 1
            self._stats.get_misses += sum(1 for chunk in results if chunk is None)
            self._after_hits(namespace, keys, results)
        return results

    def _read(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        payloads: Sequence[np.ndarray] | None = None,
    ) -> list[KVChunk | None]:
        """Read each key from the fastest tier that serves a good copy, pinned meanwhile
        (into ``payloads`` when given)."""
        results: list[KVChunk | None] = [None] * len(keys)
        with self._lock:
            self._check_open()
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
            vanished = [key for key in outcome.absent if self._index.holds(kind, key)]
            for key in outcome.bad + vanished:
                self._placement.forget(kind, namespace.digest, key)

    def _after_hits(
        self, namespace: Namespace, keys: list[ChunkKey], results: list[KVChunk | None]
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

    # -- explicit movement ------------------------------------------------

    def demote(
        self, namespace: Namespace, keys: Sequence[ChunkKey], to: TierKind | None = None
    ) -> int:
        """Move each unpinned key out of its fastest tier one level down (write-back).
        Returns how many moved; a key held only by the last tier is dropped.

        With ``to``, move each key out of every tier faster than ``to``, writing
        it back into ``to`` (or the first configured tier below it) unless a copy
        is already held there or lower; a key already no faster than ``to`` does
        not count. A ``to`` below every configured tier drops the keys.
        """
        placement = self._placement
        target = None if to is None else next((k for k in placement.order if k >= to), None)
        moved = 0
        with self._lock:
            self._check_open()
            for key in keys:
                meta = self._index.get(key)
                if meta is None or meta.namespace != namespace.digest or meta.pins:
                    continue
                fastest = meta.fastest
                assert fastest is not None, "an indexed block is held somewhere"
                if to is None:
                    placement.evict(fastest, key, meta)
                    moved += 1
                    continue
                faster = [kind for kind in sorted(meta.sizes) if target is None or kind < target]
                for kind in faster:
                    placement.evict(kind, key, meta, to=target, drop=target is None)
                moved += bool(faster)
        return moved

    def promote(
        self, namespace: Namespace, keys: Sequence[ChunkKey], to: TierKind | None = None
    ) -> int:
        """Copy each key up to tier ``to`` (default: the fastest). Returns how many moved."""
        placement = self._placement
        target = to if to is not None else placement.fastest
        keys = list(keys)
        chunks = self._read(namespace, keys)
        admissions: list[Admission] = []
        with self._lock:
            for key, chunk in zip(keys, chunks, strict=True):
                meta = self._index.get(key)
                if chunk is None or meta is None or target in meta.sizes or chunk.tier < target:
                    continue
                block = placement.encode(namespace, key, meta.parent, chunk.payload, target)
                admissions.append(Admission(key, block, meta.parent))
            placement.admit(target, namespace.digest, admissions, protect=frozenset(keys))
            return placement.count_promotions(admissions, target)

    def pin(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Protect keys from eviction until ``unpin``; returns how many were found."""
        with self._lock:
            return len(self._index.pin(keys))

    def unpin(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            self._placement.unpin(keys)

    def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Remove keys from every tier; returns how many were held anywhere.

        A pinned key (a read in progress, a shared-memory lease) is deleted when
        its last pin goes, so no reader's bytes are freed and reused under it;
        until then it stays readable, which serves nothing stale: a key names
        its content.
        """
        deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                meta = self._index.get(key)
                if meta is not None and meta.pins:
                    meta.deleted = True
                    deleted += 1
                    continue
                deleted += self._placement.forget_everywhere(namespace.digest, key)
        return deleted

    def scrub(self, batch: int = 64) -> int:
        """Re-verify the blocks of the memory tiers; how many failed (``Maintenance.scrub``)."""
        return self._maintenance.scrub(batch)

    def flush(self, *, deadline: float | None = None, batch: int = 64) -> int:
        """Copy blocks only a volatile tier holds into the first persistent tier;
        how many were written (``Maintenance.flush``)."""
        return self._maintenance.flush(deadline=deadline, batch=batch)

    # -- stats and lifecycle ------------------------------------------------

    def stats(self) -> StoreStats:
        """A snapshot of the counters, with each tier's current usage."""
        with self._lock:
            snapshot = self._stats.snapshot()
            for kind, tier in self._placement.tiers.items():
                counters = snapshot.tier(kind)
                counters.used_bytes = tier.used_bytes()
                counters.blocks = self._index.count(kind)
            return snapshot

    def tier(self, kind: TierKind) -> Tier:
        """The tier object of ``kind`` (for tools and tests)."""
        return self._placement.tiers[kind].tier

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock, which guards the eviction policy as well as the index.

        A caller that drives a session policy's own hooks (``on_idle``,
        ``on_resume``, ``tick``; ``kvstore.predictor.driver``) from a thread of
        its own holds it meanwhile, so those hooks never interleave with the
        eviction hooks the store calls. Re-entrant: the store's methods may be
        called inside (a policy demotes and promotes through them).
        """
        with self._lock:
            yield

    @property
    def tier_kinds(self) -> list[TierKind]:
        return list(self._placement.order)

    def close(self) -> None:
        """Stop the scrubber and close every tier (idempotent)."""
        self._maintenance.stop()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._reader.close()
                for tier in self._placement.tiers.values():
                    tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_batch(self, count: int) -> None:
        if count > self.config.max_batch_chunks:
            raise RequestTooLarge(
                f"{count} chunks in one request; the limit is {self.config.max_batch_chunks}"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("the store is closed")

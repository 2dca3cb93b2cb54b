"""``TieredStore``: the embedded store, one facade over every configured tier.

Placement, in one picture (fastest tier first)::

    put ─► [HBM] ──demote──► [DRAM] ──demote──► [SSD/LMDB] ──demote──► [Redis] ──► dropped
             ▲                  │                   │                     │
             └──────────── promote on hit (copy up; the lower copy stays) ┘

* New chunks enter the fastest configured tier; under capacity pressure the
  policy's victims are written back down (``kvstore.store.placement``).
* A hit in a lower tier is copied up to the fastest tier (``promote_on_hit``).
* A block is never returned unless it verifies: every read from a tier whose
  reads cross a trust boundary (LMDB, Redis) is checked against its checksum,
  and every read is checked against the key and namespace asked for. A block
  that fails is deleted from that tier, counted, and the next tier holding a
  copy is tried; failing all, it is a miss.
* A tier that is down costs a miss, never an exception out of ``lookup`` or
  ``get`` (``kvstore.store.guarded``).

Concurrency: one re-entrant lock (``StoreState.lock``) guards the index, the
policy and the counters, and serialises the paths that move blocks
(admission, eviction, promotion, delete). Reads take the lock only to pin
what they read and to record the outcome; the bytes are copied out with the
lock released, and a pinned block is never an eviction victim, so a read in
progress cannot have its block demoted from under it. The core and its state
are this face's, shared with the store's other faces (``serving``: what other
processes may do through a daemon) and with nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence

from kvstore.block import Block
from kvstore.errors import ConfigError, UnknownNamespace
from kvstore.keys import ChunkKey, Namespace, TokensOrKeys, keys_of
from kvstore.kinds import TierKind
from kvstore.store.chunk import CachedPrefix, ChunkData, KVChunk, OutData, chunk_bytes
from kvstore.store.closing import Closing
from kvstore.store.config import StoreConfig
from kvstore.store.core import StoreCore
from kvstore.store.eviction import EvictionPolicy, Occupancy
from kvstore.store.index import BlockMeta
from kvstore.store.maintenance import Maintenance
from kvstore.store.out_buffers import OutBuffers, host_arrays
from kvstore.store.placement import Admission
from kvstore.store.shared import SharedServing
from kvstore.store.stats import NamespaceEviction, NamespaceUsage, StoreStats, TierCounters
from kvstore.tiers.base import Tier

logger = logging.getLogger(__name__)


class TieredStore(Closing):
    """The embedded, thread-safe tiered KV store. See the module docstring."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
    ) -> None:
        self._core = StoreCore(config if config is not None else StoreConfig.from_env(), policy)
        self._state = self._core.state
        self._maintenance = Maintenance(self._core, self._core.config.scrub_interval_s)

    @property
    def config(self) -> StoreConfig:
        return self._core.config

    # -- namespaces -------------------------------------------------------

    def register(self, namespace: Namespace, *, limit: int | None = None) -> Namespace | None:
        """Make ``namespace`` known (done implicitly by every call that takes one); with
        ``limit``, forget the least recently named one first when that many are known, and
        return it (``StoreCore.register``)."""
        return self._core.register(namespace, limit)

    def namespace(self, digest: bytes) -> Namespace:
        """The registered namespace with this digest; ``UnknownNamespace`` otherwise."""
        return self._core.namespace(digest)

    def registered_namespaces(self) -> list[Namespace]:
        return self._core.registered_namespaces()

    def keys_for(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> list[ChunkKey]:
        """Chunk keys of a token sequence, or the given keys checked (``keys.keys_of``)."""
        return keys_of(namespace, tokens_or_keys)

    # -- lookup -----------------------------------------------------------

    def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        """How many leading chunks are cached, the fastest tier holding each, and how
        many of them are worth loading rather than recomputing (``config.costs``)."""
        self.register(namespace)
        keys = self.keys_for(namespace, tokens_or_keys)
        return self._prefix(namespace, keys, self.locate(namespace, keys))

    def _prefix(
        self, namespace: Namespace, keys: list[ChunkKey], located: list[TierKind | None]
    ) -> CachedPrefix:
        """The lookup's answer from where each key is (``locate``), counted."""
        run = next((i for i, tier in enumerate(located) if tier is None), len(keys))
        self._core.count_lookup(namespace, len(keys), run)
        tiers = tuple(tier for tier in located[:run] if tier is not None)
        return CachedPrefix(
            chunk_tokens=namespace.chunk_tokens,
            keys=tuple(keys[:run]),
            tiers=tiers,
            total_chunks=len(keys),
            load_chunks=self.config.costs.load_run(
                tiers, namespace.chunk_tokens, self._core.bytes_per_token(namespace)
            ),
        )

    def locate(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> list[TierKind | None]:
        """The fastest tier holding each key, or ``None``: every key, not only the
        leading run, and nothing counted as a lookup (the daemon uses it to tell a
        block that is elsewhere from one that is missing)."""
        return self._core.locate(namespace, keys)

    def lookup_nowait(
        self, namespace: Namespace, tokens_or_keys: TokensOrKeys
    ) -> CachedPrefix | None:
        """``lookup`` answered from the index alone, without the store's lock, else
        ``None`` (``StoreCore.locate_local`` says when it cannot).

        An event loop calls this first and falls back to ``lookup`` on a worker
        thread. A lookup is on the path of every new request an engine
        schedules, so it never waits for the lock that predictor work, an
        eviction or a long put holds, nor for a thread to run it on.
        """
        keys = self.keys_for(namespace, tokens_or_keys)
        located = self._core.locate_local(namespace, keys)
        return None if located is None else self._prefix(namespace, keys, located)

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
        chain = self._core.chain(namespace, tokens_or_keys, len(kv_chunks))
        payloads = {
            index: chunk_bytes(chunk, namespace.layout)
            for index, chunk in enumerate(kv_chunks)
            if chunk is not None
        }
        placement = self._state.placement

        def frame(index: int, parent: ChunkKey | None) -> Block:
            return placement.encode(
                namespace, chain[index], parent, payloads[index], placement.fastest
            )

        return self._core.store_chain(namespace, chain, list(payloads), frame, session)

    # -- get --------------------------------------------------------------

    def get(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        *,
        out: Sequence[OutData] | None = None,
    ) -> list[KVChunk | None]:
        """The verified chunk for each key, or ``None`` (a miss). Never raises for a
        tier that is down or a block that is corrupt: both are misses.

        With ``out`` (one buffer per key, in host memory or on a CUDA device, or
        ``ChunkPages``; ``out_buffers.OutBuffers``) each payload is copied
        straight into the caller's host buffer, or verified in host memory and
        then copied to its device tensor or pages, and the returned chunks are
        views of it: no allocation for host buffers, one copy. The content of a
        host ``out[i]`` is unspecified where ``None`` is returned; a device
        tensor or pages keep what they held.
        """
        self.register(namespace)
        keys = list(keys)
        self._core.check_batch(len(keys))
        buffers = None if out is None else OutBuffers.of(out, namespace.layout, len(keys))
        results = self._core.read(namespace, keys, host_arrays(buffers))
        with self._state.lock:
            self._state.stats.gets += 1
            self._state.stats.get_misses += sum(1 for chunk in results if chunk is None)
            self._core.after_hits(namespace, keys, results)
        return results if buffers is None else buffers.deliver(results)

    # -- explicit movement ------------------------------------------------

    def demote(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        to: TierKind | None = None,
        *,
        leaves_only: bool = False,
    ) -> int:
        """Move each unpinned key out of its fastest tier one level down (write-back).
        Returns how many moved; a key held only by the last tier is dropped, and one
        whose write-back fails stays where it is.

        With ``to``, move each key out of every tier faster than ``to``, writing
        it back into ``to`` (or the first configured tier below it) unless a copy
        is already held there; a key already no faster than ``to`` does not
        count. A ``to`` below every configured tier drops the keys.

        ``leaves_only``: a key that a block not among ``keys`` extends in a tier it
        would leave stays (``BlockIndex.extended``), as eviction leaves it for a
        policy that asks: a session's chain moves, the prefix another chain in that
        tier extends (a shared system prompt) stays with that chain.
        """
        placement = self._state.placement
        target = None if to is None else next((k for k in placement.order if k >= to), None)
        moved = 0
        with self._state.lock:
            self._core.check_open()
            index = self._state.index
            kept: set[ChunkKey] = set()
            if leaves_only:
                for kind in placement.order:
                    if target is None or kind < target:  # a tier the keys would leave
                        kept |= index.extended(kind, keys)
            for key in keys:
                meta = index.get(key)
                if meta is None or meta.namespace != namespace.digest or meta.pins or key in kept:
                    continue
                fastest = meta.fastest
                assert fastest is not None, "an indexed block is held somewhere"
                if to is None:
                    moved += placement.evict(fastest, key, meta)
                    continue
                faster = [kind for kind in sorted(meta.sizes) if target is None or kind < target]
                left = [
                    placement.evict(kind, key, meta, to=target, drop=target is None)
                    for kind in faster
                ]
                moved += bool(left) and all(left)
        return moved

    def promote(
        self, namespace: Namespace, keys: Sequence[ChunkKey], to: TierKind | None = None
    ) -> int:
        """Copy each key up to tier ``to`` (default: the fastest). Returns how many moved."""
        placement = self._state.placement
        target = to if to is not None else placement.fastest
        keys = list(keys)
        chunks = self._core.read(namespace, keys)
        admissions: list[Admission] = []
        with self._state.lock:
            for key, chunk in zip(keys, chunks, strict=True):
                meta = self._state.index.get(key)
                if chunk is None or meta is None or target in meta.sizes or chunk.tier < target:
                    continue
                block = placement.encode(namespace, key, meta.parent, chunk.payload, target)
                admissions.append(Admission(key, block, meta.parent))
            placement.admit(target, namespace.digest, admissions, protect=frozenset(keys))
            return placement.count_promotions(admissions, target)

    def write_back(self, namespace: Namespace, keys: Sequence[ChunkKey], to: TierKind) -> int:
        """Copy each key held only in tiers faster than ``to`` into ``to`` (or the first
        configured tier below it), keeping the fast copy; how many were written.

        A block copied down early leaves its fast tier without a write when it is
        evicted: a policy that expects to give a tier up soon does this while nobody
        waits, rather than on the clock of the request that needs the room."""
        placement = self._state.placement
        target = next((kind for kind in placement.order if kind >= to), None)
        if target is None:
            return 0
        keys = list(keys)
        with self._state.lock:
            self._core.check_open()
            by_tier: dict[TierKind, list[tuple[ChunkKey, BlockMeta]]] = {}
            for key in keys:
                meta = self._state.index.get(key)
                if meta is None or meta.namespace != namespace.digest or target in meta.sizes:
                    continue
                fastest = meta.fastest
                if fastest is not None and fastest < target:
                    by_tier.setdefault(fastest, []).append((key, meta))
            for kind, items in by_tier.items():
                placement.copy_down(kind, target, namespace.digest, items)
            return sum(1 for items in by_tier.values() for _, meta in items if target in meta.sizes)

    def pin(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Protect keys from eviction until ``unpin``; returns how many were found."""
        with self._state.lock:
            return len(self._state.index.pin(keys))

    def unpin(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> None:
        with self._state.lock:
            self._state.placement.unpin(keys)

    def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Remove keys from every tier; returns how many were held anywhere.

        A pinned key (a read in progress, a shared-memory lease) is deleted when
        its last pin goes, so no reader's bytes are freed and reused under it;
        until then it stays readable, which serves nothing stale: a key names
        its content.
        """
        with self._state.lock:
            self._core.check_open()
            return self._delete(namespace.digest, keys)

    def _delete(self, digest: bytes, keys: Sequence[ChunkKey]) -> int:
        deleted = 0
        for key in keys:
            meta = self._state.index.get(key)
            if meta is not None and meta.pins:
                meta.deleted = True
                deleted += 1
                continue
            deleted += self._state.placement.forget_everywhere(digest, key)
        return deleted

    # -- whole namespaces (an operator's commands) ------------------------

    def namespace_usage(self) -> list[NamespaceUsage]:
        """Every namespace the store holds blocks of or has registered, with its blocks
        and bytes per tier, largest first."""
        with self._state.lock:
            usage = self._state.index.usage()
            registered = {ns.digest: ns for ns in self._core.registered_namespaces()}
        digests = set(usage) | set(registered)
        rows = [NamespaceUsage(d, registered.get(d), usage.get(d, {})) for d in digests]
        return sorted(rows, key=lambda row: (-sum(b for _, b in row.tiers.values()), row.digest))

    def evict_namespace(self, digest: bytes, tier: TierKind) -> NamespaceEviction:
        """Move every unpinned block of namespace ``digest`` out of ``tier`` as pressure
        would (written back where the policy says, dropped from the last tier). A shared
        tier whose servers own its capacity is refused: other hosts read those blocks,
        and ``delete_namespace`` is the explicit way to remove them."""
        placement = self._state.placement
        if tier not in placement.tiers:
            raise ConfigError(f"no {tier.label} tier is configured")
        if tier in placement.server_owned:
            raise ConfigError(
                f"the {tier.label} servers own that tier's capacity: blocks there are "
                "evicted by them, or removed with delete"
            )
        with self._state.lock:
            self._core.check_open()
            blocks = self._namespace_blocks(digest)
            held = [(key, meta) for key, meta in blocks if tier in meta.sizes]
            victims = [(key, meta) for key, meta in held if not meta.pins]
            evicted = placement.evict_many(tier, victims) if victims else 0
            return NamespaceEviction(evicted, len(held) - len(victims))

    def delete_namespace(self, digest: bytes) -> int:
        """Delete every block of namespace ``digest`` this store knows of, from every tier
        (pinned ones when their last pin goes, as ``delete``); how many. Blocks other
        hosts put in a shared tier and this store never saw stay, to the servers'
        eviction."""
        with self._state.lock:
            self._core.check_open()
            keys = [key for key, _ in self._namespace_blocks(digest)]
            return self._delete(digest, keys)

    def _namespace_blocks(self, digest: bytes) -> list[tuple[ChunkKey, BlockMeta]]:
        """The blocks of namespace ``digest``; ``UnknownNamespace`` if it has none and
        is not registered (a mistyped digest is an error, not "nothing to do")."""
        blocks = self._state.index.of_namespace(digest)
        if not blocks and digest not in {ns.digest for ns in self._core.registered_namespaces()}:
            raise UnknownNamespace(f"namespace {digest.hex()} holds nothing here")
        return blocks

    def scrub(self, batch: int = 64) -> int:
        """Re-verify the blocks of the memory tiers; how many failed (``Maintenance.scrub``)."""
        return self._maintenance.scrub(batch)

    def drain_write_through(self, deadline: float | None = None) -> bool:
        """Wait until every write-through copy queued so far is made, or until ``deadline``
        (``time.monotonic``); whether they all were."""
        return self._core.drain_write_through(deadline)

    def flush(self, *, deadline: float | None = None, batch: int = 64) -> int:
        """Make every queued write-through copy, then copy blocks only a volatile tier holds
        into the first persistent tier; how many were written (``Maintenance.flush``)."""
        self.drain_write_through(deadline)
        return self._maintenance.flush(deadline=deadline, batch=batch)

    # -- stats and lifecycle ------------------------------------------------

    def stats(self) -> StoreStats:
        """A snapshot of the counters, with each tier's current usage: for a shared tier
        whose servers own its capacity, theirs (every host's blocks), as they report it."""
        placement = self._state.placement
        servers = {kind: placement.tiers[kind].server_memory() for kind in placement.server_owned}
        with self._state.lock:
            snapshot = self._state.stats.snapshot()
            for kind, tier in placement.tiers.items():
                counters = snapshot.tier(kind)
                counters.used_bytes = tier.used_bytes()
                counters.blocks = self._state.index.count(kind)
                counters.breaker_trips = tier.breaker.trips
                counters.down = int(tier.breaker.is_open)
                pending = self._core.write_through_pending(kind)
                if pending is not None:
                    counters.write_through_pending = pending
                memory = servers.get(kind)
                if memory is not None:
                    counters.used_bytes = memory.used_bytes
                    counters.capacity_bytes = memory.max_bytes or counters.capacity_bytes
            return snapshot

    def counters(self, kind: TierKind) -> TierCounters:
        """A copy of tier ``kind``'s counters as they stand: ``stats`` without the usage
        figures it gathers (a walk of the index), for a caller that asks often."""
        with self._state.lock:
            return dataclasses.replace(self._state.stats.tier(kind))

    def serving(self) -> SharedServing:
        """This store's shared-memory gets and landed puts, for a daemon that serves it
        to other processes (``kvstore.store.shared``)."""
        return SharedServing(self._core)

    def occupancy(self) -> Occupancy:
        """How full each tier is now, fastest first (read on each call)."""
        return self._state.placement.occupancy

    def tier(self, kind: TierKind) -> Tier:
        """The tier object of ``kind`` (for tools and tests)."""
        return self._state.placement.tiers[kind].tier

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock, which guards the eviction policy as well as the index.

        A caller that drives a session policy's own hooks (``on_idle``,
        ``on_resume``, ``tick``; ``kvstore.predictor.driver``) from a thread of
        its own holds it meanwhile, so those hooks never interleave with the
        eviction hooks the store calls. Re-entrant: the store's methods may be
        called inside (a policy demotes and promotes through them).
        """
        with self._state.lock:
            yield

    @property
    def tier_kinds(self) -> list[TierKind]:
        return list(self._state.placement.order)

    def close(self) -> None:
        """Copy what only the memory tiers hold into the first persistent tier
        (``config.flush_on_close``: a store opened again then has it), stop the scrubber
        and close every tier (idempotent)."""
        if self.config.flush_on_close and not self._core.closed:
            written = self.flush()
            if written:
                logger.info("wrote %d block(s) held only in memory down at close", written)
        self._maintenance.stop()
        self._core.close()

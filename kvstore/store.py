"""``TieredStore``: the embedded store, one facade over every configured tier.

Placement, in one picture (fastest tier first)::

    put ─► [HBM] ──demote──► [DRAM] ──demote──► [SSD/LMDB] ──demote──► [Redis] ──► dropped
             ▲                  │                   │                     │
             └──────────── promote on hit (copy up; the lower copy stays) ┘

* New chunks enter the fastest configured tier. When a tier is over capacity
  the policy names victims; a victim is written back to the next tier down
  (unless a lower tier already holds it) and then removed. Only the last tier
  drops blocks for good.
* A hit in a lower tier is copied up to the fastest tier (``promote_on_hit``).
* A block is never returned unless it verifies: every read from a tier whose
  reads cross a trust boundary (LMDB, Redis) is checked against its checksum,
  and every read is checked against the key and namespace asked for. A block
  that fails is deleted from that tier, counted, and the next tier holding a
  copy is tried; failing all, it is a miss.
* A tier that is down (``TierUnavailable``) costs a miss, never an exception
  out of ``lookup`` or ``get``.

Concurrency: one re-entrant lock guards the index (``_meta``), the policy and
the counters, and serialises the mutating paths (admission, demotion,
promotion, delete). Reads take the lock only to pin what they read and to
record the outcome; the bytes are copied out with the lock released, and a
pinned block is never chosen as an eviction victim, so a read in progress
cannot have its block demoted from under it.

Index: ``_meta`` knows every block held by a process-local tier (HBM, DRAM,
LMDB; rebuilt from a scan of LMDB and Redis at open). Redis is shared by
several processes, so a key not in the index is also looked for there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

import numpy as np
import torch

from kvstore.block import (
    HEADER_BYTES,
    Block,
    BlockHeader,
    check_identity,
    frame_block,
    parse_header,
    stored_block,
    verify_block,
)
from kvstore.chunk import CachedPrefix, ChunkData, KVChunk, chunk_bytes
from kvstore.codec import CodecSpec, decode_payload, encode_payload
from kvstore.config import StoreConfig
from kvstore.errors import (
    CorruptBlock,
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    TierError,
    TierFull,
    UnknownNamespace,
)
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.policy import EvictionPolicy, LRUPolicy
from kvstore.stats import StoreStats
from kvstore.tiers.base import Tier, TierKind
from kvstore.tiers.factory import open_tier

_T = TypeVar("_T")
TokensOrKeys = Sequence[int] | np.ndarray | torch.Tensor | Sequence[ChunkKey]

# Tiers shared with other processes: the index is not authoritative for them.
SHARED_TIERS = frozenset({TierKind.REDIS})


@dataclass(slots=True)
class _BlockMeta:
    """Index entry of one chunk. Owned by ``TieredStore``; mutated under its lock.

    ``sizes`` maps each tier holding a copy to the stored size there (codecs
    differ per tier). ``pins`` counts reads in progress plus explicit pins.
    """

    namespace: bytes
    parent: ChunkKey | None
    sizes: dict[TierKind, int] = field(default_factory=dict)
    pins: int = 0
    session: str | None = None

    @property
    def top(self) -> TierKind | None:
        return min(self.sizes) if self.sizes else None


@dataclass(slots=True)
class _Admission:
    """One block on its way into a tier: what to write and the chain it belongs to."""

    key: ChunkKey
    block: Block
    parent: ChunkKey | None


class TieredStore:
    """The embedded, thread-safe tiered KV store. See the module docstring."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
    ) -> None:
        self.config = config if config is not None else StoreConfig.from_env()
        self._policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self._lock = threading.RLock()
        self._stats = StoreStats()
        self._meta: dict[ChunkKey, _BlockMeta] = {}
        self._namespaces: dict[bytes, Namespace] = {}
        self._tiers: dict[TierKind, Tier] = {}
        self._codecs: dict[TierKind, CodecSpec] = {}
        try:
            for tier_config in self.config.tiers:
                self._codecs[tier_config.kind] = CodecSpec.parse(tier_config.codec)
                self._tiers[tier_config.kind] = open_tier(tier_config)
                self._stats.tier(tier_config.kind).capacity_bytes = tier_config.capacity_bytes
        except BaseException:
            self.close()
            raise
        self._order = sorted(self._tiers)
        self._closed = False
        if self.config.scan_on_open:
            self._rebuild_index()

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

    def keys_for(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> list[ChunkKey]:
        """Chunk keys of a token sequence, or the given keys checked to be ``ChunkKey``."""
        if isinstance(tokens_or_keys, torch.Tensor):
            return chunk_keys(namespace, tokens_or_keys.detach().cpu().numpy())
        if len(tokens_or_keys) and isinstance(tokens_or_keys[0], bytes):
            if not all(isinstance(key, ChunkKey) for key in tokens_or_keys):
                raise LayoutMismatch("keys must all be ChunkKey (see kvstore.keys)")
            return list(tokens_or_keys)  # type: ignore[arg-type]
        return chunk_keys(namespace, tokens_or_keys)  # type: ignore[arg-type]

    # -- lookup -----------------------------------------------------------

    def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        """How many leading chunks are cached, and the fastest tier holding each."""
        self.register(namespace)
        keys = self.keys_for(namespace, tokens_or_keys)
        self._check_batch(len(keys))
        with self._lock:
            located: list[TierKind | None] = [
                meta.top if (meta := self._meta.get(key)) is not None else None for key in keys
            ]
        for kind in self._order:
            if kind in SHARED_TIERS:
                self._confirm_shared(kind, namespace, keys, located)
        first_gap = next((i for i, tier in enumerate(located) if tier is None), len(keys))
        run = first_gap
        with self._lock:
            self._stats.lookups += 1
            self._stats.lookup_tokens += len(keys) * namespace.chunk_tokens
            self._stats.lookup_hit_tokens += run * namespace.chunk_tokens
        return CachedPrefix(
            chunk_tokens=namespace.chunk_tokens,
            keys=tuple(keys[:run]),
            tiers=tuple(tier for tier in located[:run] if tier is not None),
            total_chunks=len(keys),
        )

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
        present = self._call_tier(
            kind, lambda t: t.contains_many(namespace.digest, [keys[i] for i in asked])
        )
        lost: list[ChunkKey] = []
        for position, index in enumerate(asked):
            found = present is not None and present[position]
            if found:
                located[index] = kind
            elif located[index] is kind:
                located[index] = None
                if present is not None:
                    lost.append(keys[index])
        if lost:
            with self._lock:
                for key in lost:
                    meta = self._meta.get(key)
                    if meta is not None and kind in meta.sizes:
                        meta.sizes.pop(kind)
                        self._policy.on_remove(kind, key)
                        if not meta.sizes:
                            del self._meta[key]

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
        not rewritten (a key names its content), only marked as used.
        """
        self.register(namespace)
        keys = self.keys_for(namespace, tokens_or_keys)
        if len(kv_chunks) > len(keys):
            raise LayoutMismatch(
                f"{len(kv_chunks)} chunks given for {len(keys)} full chunks of tokens"
            )
        self._check_batch(len(kv_chunks))
        payloads = [
            (index, chunk_bytes(chunk, namespace.layout))
            for index, chunk in enumerate(kv_chunks)
            if chunk is not None
        ]
        top = self._order[0]
        with self._lock:
            self._check_open()
            fresh = [(i, p) for i, p in payloads if keys[i] not in self._meta]
            admissions = [
                _Admission(
                    keys[i],
                    self._encode(namespace, keys[i], keys[i - 1] if i else None, payload, top),
                    keys[i - 1] if i else None,
                )
                for i, payload in fresh
            ]
            chain = keys[: len(kv_chunks)]
            self._touch_chain(chain, session)
            stored = self._admit(
                top, namespace.digest, admissions, session=session, protect=frozenset(chain)
            )
            self._touch_chain(chain, session)
            self._stats.puts += 1
            self._stats.chunks_stored += len(stored)
            self._stats.puts_dropped += len(admissions) - len(stored)
        return len(stored)

    # -- get --------------------------------------------------------------

    def get(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> list[KVChunk | None]:
        """The verified chunk for each key, or ``None`` (a miss). Never raises for a
        tier that is down or a block that is corrupt: both are misses."""
        self.register(namespace)
        keys = list(keys)
        self._check_batch(len(keys))
        results: list[KVChunk | None] = [None] * len(keys)
        pinned: list[ChunkKey] = []
        with self._lock:
            self._check_open()
            for key in keys:
                meta = self._meta.get(key)
                if meta is not None:
                    meta.pins += 1
                    pinned.append(key)
        try:
            for kind in self._order:
                self._read_from(kind, namespace, keys, results)
        finally:
            with self._lock:
                for key in pinned:
                    meta = self._meta.get(key)
                    if meta is not None:
                        meta.pins -= 1
        with self._lock:
            self._stats.gets += 1
            self._stats.get_misses += sum(1 for chunk in results if chunk is None)
            self._after_hits(namespace, keys, results)
        return results

    def _read_from(
        self,
        kind: TierKind,
        namespace: Namespace,
        keys: list[ChunkKey],
        results: list[KVChunk | None],
    ) -> None:
        """Fill the still-missing ``results`` that tier ``kind`` can serve."""
        with self._lock:
            wanted = [
                i for i, key in enumerate(keys) if results[i] is None and self._may_hold(kind, key)
            ]
        if not wanted:
            return
        tier = self._tiers[kind]
        buffers = self._call_tier(
            kind, lambda t: t.get_many(namespace.digest, [keys[i] for i in wanted])
        )
        if buffers is None:
            return
        corrupt: list[ChunkKey] = []
        bytes_read = 0
        for index, buffer in zip(wanted, buffers, strict=True):
            if buffer is None:
                continue
            try:
                header = verify_block(buffer, check_payload=tier.verifies_reads)
                check_identity(header, namespace, keys[index])
                raw = decode_payload(
                    memoryview(buffer)[HEADER_BYTES:], header.dtype, header.codec, header.raw_len
                )
            except (CorruptBlock, LayoutMismatch):
                corrupt.append(keys[index])
                continue
            bytes_read += len(buffer)
            results[index] = KVChunk(keys[index], kind, namespace.layout, raw)
        with self._lock:
            counters = self._stats.tier(kind)
            counters.hits += len(wanted) - len(corrupt) - sum(1 for b in buffers if b is None)
            counters.bytes_read += bytes_read
            counters.corrupt_blocks += len(corrupt)
            for key in corrupt:
                self._forget(kind, namespace.digest, key)

    def _may_hold(self, kind: TierKind, key: ChunkKey) -> bool:
        """Whether tier ``kind`` is worth asking for ``key``: the index says it holds
        a copy, or the tier is shared and the index knows nothing of the key."""
        meta = self._meta.get(key)
        if meta is None:
            return kind in SHARED_TIERS
        return kind in meta.sizes

    def _after_hits(
        self, namespace: Namespace, keys: list[ChunkKey], results: list[KVChunk | None]
    ) -> None:
        """Index blocks found in a shared tier, promote lower-tier hits, update recency."""
        top = self._order[0]
        promotions: list[_Admission] = []
        for key, chunk in zip(keys, results, strict=True):
            if chunk is None:
                continue
            meta = self._meta.get(key)
            if meta is None:
                meta = self._meta[key] = _BlockMeta(namespace.digest, None)
                meta.sizes[chunk.tier] = HEADER_BYTES + namespace.layout.chunk_nbytes
            if self.config.promote_on_hit and chunk.tier != top and top not in meta.sizes:
                promotions.append(
                    _Admission(
                        key,
                        self._encode(namespace, key, meta.parent, chunk.payload, top),
                        meta.parent,
                    )
                )
        hits = [key for key, chunk in zip(keys, results, strict=True) if chunk is not None]
        self._touch_chain(hits, None)
        if promotions:
            self._admit(top, namespace.digest, promotions, protect=frozenset(hits))
            self._count_promotions(promotions, top)
        self._touch_chain(hits, None)

    # -- explicit movement ------------------------------------------------

    def demote(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Move each key out of its fastest tier one level down (write-back); unpinned only.
        Returns how many moved. A key in the last tier only is dropped."""
        moved = 0
        with self._lock:
            self._check_open()
            for key in keys:
                meta = self._meta.get(key)
                if meta is not None and meta.namespace == namespace.digest and meta.pins == 0:
                    top = meta.top
                    assert top is not None
                    self._evict_block(top, key, meta)
                    moved += 1
        return moved

    def promote(
        self, namespace: Namespace, keys: Sequence[ChunkKey], to: TierKind | None = None
    ) -> int:
        """Copy each key up to tier ``to`` (default: the fastest). Returns how many moved."""
        target = to if to is not None else self._order[0]
        chunks = self.get_without_promotion(namespace, keys)
        admissions: list[_Admission] = []
        with self._lock:
            for key, chunk in zip(keys, chunks, strict=True):
                meta = self._meta.get(key)
                if chunk is None or meta is None or target in meta.sizes or chunk.tier < target:
                    continue
                block = self._encode(namespace, key, meta.parent, chunk.payload, target)
                admissions.append(_Admission(key, block, meta.parent))
            self._admit(target, namespace.digest, admissions, protect=frozenset(keys))
            return self._count_promotions(admissions, target)

    def get_without_promotion(
        self, namespace: Namespace, keys: Sequence[ChunkKey]
    ) -> list[KVChunk | None]:
        """``get`` that leaves placement alone (used by ``promote`` and by tests)."""
        results: list[KVChunk | None] = [None] * len(keys)
        for kind in self._order:
            self._read_from(kind, namespace, list(keys), results)
        return results

    def pin(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Protect keys from eviction until ``unpin``; returns how many were found."""
        with self._lock:
            metas = [self._meta.get(key) for key in keys]
            for meta in metas:
                if meta is not None:
                    meta.pins += 1
            return sum(meta is not None for meta in metas)

    def unpin(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                meta = self._meta.get(key)
                if meta is not None and meta.pins > 0:
                    meta.pins -= 1

    def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Remove keys from every tier; returns how many were held anywhere."""
        deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                meta = self._meta.get(key)
                kinds = set(meta.sizes) if meta is not None else set()
                kinds |= {kind for kind in self._order if kind in SHARED_TIERS}
                found = False
                for kind in sorted(kinds):
                    count = self._call_tier(
                        kind, lambda t, k=key: t.delete_many(namespace.digest, [k])
                    )
                    found = found or bool(count) or (meta is not None and kind in meta.sizes)
                    if meta is not None and kind in meta.sizes:
                        self._policy.on_remove(kind, key)
                self._meta.pop(key, None)
                deleted += found
        return deleted

    # -- stats and lifecycle ------------------------------------------------

    def stats(self) -> StoreStats:
        """A snapshot of the counters, with each tier's current usage."""
        with self._lock:
            snapshot = self._stats.snapshot()
            for kind, tier in self._tiers.items():
                counters = snapshot.tier(kind)
                counters.used_bytes = tier.used_bytes()
                counters.blocks = sum(1 for meta in self._meta.values() if kind in meta.sizes)
            return snapshot

    def tier(self, kind: TierKind) -> Tier:
        """The tier object of ``kind`` (for tools and tests)."""
        return self._tiers[kind]

    @property
    def tier_kinds(self) -> list[TierKind]:
        return list(self._order)

    def close(self) -> None:
        """Close every tier (idempotent)."""
        with self._lock:
            for tier in getattr(self, "_tiers", {}).values():
                tier.close()
            self._closed = True

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals: placement ------------------------------------------------

    def _admit(
        self,
        kind: TierKind,
        namespace: bytes,
        admissions: Sequence[_Admission],
        *,
        session: str | None = None,
        protect: frozenset[ChunkKey] = frozenset(),
    ) -> set[ChunkKey]:
        """Write blocks into tier ``kind``, evicting from it first as needed.

        ``protect`` (the chain being written, which includes ``admissions``) is
        never evicted to make room for itself: when a chain is longer than the
        tier, its head stays and the rest spills to the next tier down, rather
        than the tail pushing the head out. Blocks that do not fit even after
        evicting every other unpinned block spill too (or are dropped at the
        last tier). Returns the keys now held somewhere. Lock held.
        """
        if not admissions:
            return set()
        protect = protect | {a.key for a in admissions}
        tier = self._tiers[kind]
        capacity = tier.capacity_bytes()
        stored: set[ChunkKey] = set()
        spill: list[_Admission] = []
        pending = list(admissions)
        limit = len(pending)
        while pending:
            batch = self._fill_batch(kind, pending[:limit], capacity, protect)
            if not batch:
                spill.append(pending.pop(0))
                continue
            try:
                self._call_tier(
                    kind,
                    lambda t, b=batch: t.put_many(namespace, [(a.key, a.block) for a in b]),
                    raise_full=True,
                )
            except TierFull:
                # The backend disagrees with our accounting (fragmentation, LMDB
                # page overhead): evict one more and retry with a smaller batch.
                evicted = self._evict_one(kind, protect)
                if len(batch) > 1:
                    limit = max(1, len(batch) // 2)
                elif not evicted:
                    spill.append(pending.pop(0))
                continue
            except TierError:
                spill.extend(batch)
                del pending[: len(batch)]
                continue
            del pending[: len(batch)]
            counters = self._stats.tier(kind)
            for admission in batch:
                meta = self._meta.get(admission.key)
                if meta is None:
                    meta = self._meta[admission.key] = _BlockMeta(namespace, admission.parent)
                meta.sizes[kind] = admission.block.nbytes
                if session is not None:
                    meta.session = session
                counters.bytes_written += admission.block.nbytes
                stored.add(admission.key)
            self._policy.on_access(kind, [a.key for a in batch], session)
        lower = self._below(kind)
        if spill and lower is not None:
            reframed: list[_Admission] = []
            for admission in spill:
                meta = self._meta.get(admission.key)
                if meta is not None and any(other >= lower for other in meta.sizes):
                    stored.add(admission.key)  # a copy is already held lower down
                else:
                    reframed.append(
                        _Admission(
                            admission.key, self._reencode(admission.block, lower), admission.parent
                        )
                    )
            stored |= self._admit(lower, namespace, reframed, session=session, protect=protect)
        return stored

    def _fill_batch(
        self,
        kind: TierKind,
        pending: list[_Admission],
        capacity: int,
        protect: frozenset[ChunkKey],
    ) -> list[_Admission]:
        """The longest head of ``pending`` that fits ``kind`` after evicting for it."""
        tier = self._tiers[kind]
        batch: list[_Admission] = []
        need = 0
        for admission in pending:
            if admission.block.nbytes > capacity:
                break
            if need + admission.block.nbytes > capacity:
                break
            batch.append(admission)
            need += admission.block.nbytes
        while batch and tier.used_bytes() + need > capacity:
            if not self._evict_one(kind, protect):
                # Nothing left to evict: shrink the batch to what fits now.
                while batch and tier.used_bytes() + need > capacity:
                    need -= batch.pop().block.nbytes
        return batch

    def _evict_one(self, kind: TierKind, protect: frozenset[ChunkKey] = frozenset()) -> bool:
        """Evict the policy's first unpinned, unprotected victim from ``kind``. Lock held."""
        for key in self._policy.victims(kind):
            meta = self._meta.get(key)
            if meta is None or kind not in meta.sizes:
                self._policy.on_remove(kind, key)
                continue
            if meta.pins or key in protect:
                continue
            self._evict_block(kind, key, meta)
            return True
        return False

    def _evict_block(self, kind: TierKind, key: ChunkKey, meta: _BlockMeta) -> None:
        """Write ``key`` back below ``kind`` unless a lower tier has it, then drop it
        from ``kind``. Lock held."""
        lower = self._below(kind)
        held_below = any(other > kind for other in meta.sizes)
        counters = self._stats.tier(kind)
        if lower is not None and not held_below:
            buffers = self._call_tier(kind, lambda t: t.get_many(meta.namespace, [key]))
            buffer = buffers[0] if buffers else None
            if buffer is not None:
                block = self._reencode(stored_block(buffer), lower)
                self._admit(lower, meta.namespace, [_Admission(key, block, meta.parent)])
        self._call_tier(kind, lambda t: t.delete_many(meta.namespace, [key]))
        meta.sizes.pop(kind, None)
        self._policy.on_remove(kind, key)
        if meta.sizes:
            counters.demotions += 1
        else:
            counters.evictions += 1
            del self._meta[key]

    def _forget(self, kind: TierKind, namespace: bytes, key: ChunkKey) -> None:
        """Drop a bad copy of ``key`` from ``kind`` (it failed verification). Lock held."""
        self._call_tier(kind, lambda t: t.delete_many(namespace, [key]))
        meta = self._meta.get(key)
        if meta is not None:
            meta.sizes.pop(kind, None)
            self._policy.on_remove(kind, key)
            if not meta.sizes:
                del self._meta[key]

    def _count_promotions(self, admissions: Sequence[_Admission], target: TierKind) -> int:
        """Count admissions that reached ``target``, per tier they came from. Lock held."""
        promoted = 0
        for admission in admissions:
            meta = self._meta.get(admission.key)
            if meta is not None and target in meta.sizes:
                source = min((kind for kind in meta.sizes if kind > target), default=target)
                self._stats.tier(source).promotions += 1
                promoted += 1
        return promoted

    def _touch_chain(self, keys: Sequence[ChunkKey], session: str | None) -> None:
        """Tell the policy a chain was used, per tier, head first. Lock held."""
        by_tier: dict[TierKind, list[ChunkKey]] = {}
        for key in keys:
            meta = self._meta.get(key)
            if meta is not None:
                for kind in meta.sizes:
                    by_tier.setdefault(kind, []).append(key)
        for kind, chain in by_tier.items():
            self._policy.on_access(kind, chain, session)

    def _below(self, kind: TierKind) -> TierKind | None:
        position = self._order.index(kind)
        return self._order[position + 1] if position + 1 < len(self._order) else None

    # -- internals: encoding ------------------------------------------------

    def _encode(
        self,
        namespace: Namespace,
        key: ChunkKey,
        parent: ChunkKey | None,
        raw: memoryview,
        kind: TierKind,
    ) -> Block:
        spec = self._codecs[kind]
        layout = namespace.layout
        payload = memoryview(encode_payload(raw, layout.dtype, spec.codec, spec.level))
        header = BlockHeader(
            codec=spec.codec,
            dtype=layout.dtype,
            namespace_digest=namespace.digest,
            key=key,
            parent=parent,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            chunk_tokens=layout.chunk_tokens,
            raw_len=raw.nbytes,
            payload_len=payload.nbytes,
        )
        return frame_block(header, payload)

    def _reencode(self, block: Block, kind: TierKind) -> Block:
        """``block`` framed for tier ``kind``'s codec (unchanged if the codec matches)."""
        header = parse_header(block.header)
        spec = self._codecs[kind]
        if header.codec is spec.codec:
            return block
        raw = decode_payload(block.payload, header.dtype, header.codec, header.raw_len)
        payload = memoryview(encode_payload(raw, header.dtype, spec.codec, spec.level))
        return frame_block(
            BlockHeader(
                codec=spec.codec,
                dtype=header.dtype,
                namespace_digest=header.namespace_digest,
                key=header.key,
                parent=header.parent,
                num_layers=header.num_layers,
                num_kv_heads=header.num_kv_heads,
                head_dim=header.head_dim,
                chunk_tokens=header.chunk_tokens,
                raw_len=header.raw_len,
                payload_len=payload.nbytes,
            ),
            payload,
        )

    # -- internals: plumbing ------------------------------------------------

    def _call_tier(
        self, kind: TierKind, operation: Callable[[Tier], _T], *, raise_full: bool = False
    ) -> _T | None:
        """Run ``operation(tier)``; a ``TierError`` is counted and becomes ``None``
        (a miss), except ``TierFull`` when the caller handles it."""
        try:
            return operation(self._tiers[kind])
        except TierFull:
            if raise_full:
                raise
            with self._lock:
                self._stats.tier(kind).errors += 1
            return None
        except TierError:
            with self._lock:
                self._stats.tier(kind).errors += 1
            if raise_full:
                raise
            return None

    def _rebuild_index(self) -> None:
        """Index the blocks persistent tiers already hold (after a restart)."""
        for kind in self._order:
            tier = self._tiers[kind]
            bad: list[tuple[bytes, ChunkKey]] = []
            try:
                infos = list(tier.scan())
            except KVStoreError:
                self._stats.tier(kind).errors += 1
                continue
            for info in infos:
                try:
                    header = parse_header(info.header)
                    if header.key != info.key or header.namespace_digest != info.namespace:
                        raise CorruptBlock("header does not match its key")
                except CorruptBlock:
                    bad.append((info.namespace, info.key))
                    continue
                meta = self._meta.setdefault(info.key, _BlockMeta(info.namespace, header.parent))
                meta.sizes[kind] = info.nbytes
                self._policy.on_access(kind, [info.key])
            for namespace, key in bad:
                self._call_tier(kind, lambda t, n=namespace, k=key: t.delete_many(n, [k]))
                self._stats.tier(kind).corrupt_blocks += 1

    def _check_batch(self, count: int) -> None:
        if count > self.config.max_batch_chunks:
            raise RequestTooLarge(
                f"{count} chunks in one request; the limit is {self.config.max_batch_chunks}"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("the store is closed")

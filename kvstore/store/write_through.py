"""Write-through to a shared tier: every block a put stores is copied to Redis soon after.

A shared tier (Redis, Redis Cluster) is how several hosts share one cache. With
write-back alone a block reaches it only once every local tier has pushed it
out, which with DRAM + LMDB in front practically never happens: host B would
not find what host A put minutes ago. So a store with a shared tier in
``write = "through"`` mode (the default for a shared tier) hands the keys of
every block a put stored to a ``WriteThrough``, whose own thread copies them::

    put ──► store_chain / publish ──► offer(keys) ──► bounded queue
                                                        │ worker thread
                 lock: pin, note the fastest copy  ◄────┘
                 no lock: read it, re-encode, put_many into the shared tier
                 lock: unpin, index the shared copy

Never on the put's critical path: ``offer`` appends keys and returns; a full
queue drops the newest keys and counts them (``write_through_dropped``), as a
put that outruns the shared tier must not wait for it. The queue holds keys,
not bytes: the worker reads each block from wherever the store holds it when
its turn comes, so a long queue costs memory for keys only, and a block that
was deleted meanwhile is skipped. A block whose local copies were all evicted
before its turn went down by write-back, so nothing is lost either way.

The Redis round trip is made with the store's lock released, so a slow or
hung shared tier delays only this thread (and its breaker answers for it at
once while it is down); the blocks it holds pinned meanwhile stay readable.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import Block, stored_block
from kvstore.errors import CorruptBlock, KVStoreError, TierFull
from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.store.state import StoreState

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_BLOCKS = 8192
_BATCH = 32  # blocks per shared-tier round trip


_Framed = tuple[ChunkKey, Block, ChunkKey | None]  # key, block framed for the tier, parent


@dataclass(frozen=True, slots=True)
class _Copy:
    namespace: bytes
    key: ChunkKey
    source: TierKind
    parent: ChunkKey | None


class WriteThrough:
    """The queue and thread that copy newly stored blocks into shared tier ``kind``."""

    def __init__(
        self,
        kind: TierKind,
        state: StoreState,
        queue_blocks: int = DEFAULT_QUEUE_BLOCKS,
    ) -> None:
        self.kind = kind
        self._lock = state.lock
        self._index = state.index
        self._placement = state.placement
        self._counters = state.stats.tier(kind)
        self._limit = queue_blocks
        self._queue: collections.deque[tuple[bytes, ChunkKey]] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._busy = 0  # keys taken off the queue and not yet settled
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"kvstore-write-through-{kind.label}", daemon=True
        )
        self._thread.start()

    def offer(self, namespace: bytes, keys: Sequence[ChunkKey]) -> None:
        """Queue ``keys`` (just stored in ``namespace``) for a copy; drop what does not fit."""
        if not keys:
            return
        with self._ready:
            room = max(0, self._limit - len(self._queue))
            self._queue.extend((namespace, key) for key in keys[:room])
            dropped = len(keys) - min(room, len(keys))
            self._ready.notify()
        with self._lock:
            self._counters.write_through_queued += len(keys) - dropped
            self._counters.write_through_dropped += dropped

    @property
    def pending(self) -> int:
        """Keys queued or being copied."""
        with self._ready:
            return len(self._queue) + self._busy

    def drain(self, deadline: float | None = None) -> bool:
        """Wait until every queued key is settled, or until ``deadline``
        (``time.monotonic``); whether the queue emptied."""
        with self._ready:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._ready.wait(left if left is None else min(left, 0.05))
            return True

    def close(self, deadline: float | None = None) -> None:
        """Copy what is queued until ``deadline``, then stop the thread (idempotent)."""
        self.drain(deadline)
        with self._ready:
            self._stopping = True
            left = len(self._queue)
            self._queue.clear()
            self._ready.notify_all()
        self._thread.join()
        if left:
            logger.warning(
                "%d block(s) not written through to %s at close: their local copies remain",
                left,
                self.kind.label,
            )

    # -- the worker ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
                self._busy = len(batch)
            try:
                self._copy(batch)
            except KVStoreError:  # the store closed under us
                logger.debug("write-through stopped: the store is closed")
            except Exception:  # a bug must not kill the thread and stall the queue
                logger.exception("write-through batch failed")
            finally:
                with self._ready:
                    self._busy = 0
                    self._ready.notify_all()

    def _copy(self, batch: list[tuple[bytes, ChunkKey]]) -> None:
        copies, pinned = self._claim(batch)
        stored: dict[bytes, list[tuple[ChunkKey, ChunkKey | None, int]]] = {}
        failed = 0
        skipped = len(batch) - len(copies)
        try:
            shared = self._placement.tiers[self.kind]
            framed = self._read(copies)
            skipped += len(copies) - sum(len(items) for items in framed.values())
            for namespace, items in framed.items():
                try:
                    written = shared.put_many(namespace, [(key, block) for key, block, _ in items])
                except TierFull:  # the server's maxmemory with noeviction: it owns capacity
                    written = False
                if written:
                    stored[namespace] = [(key, parent, b.nbytes) for key, b, parent in items]
                else:
                    failed += len(items)
        finally:
            with self._lock:
                # Indexed before the pins go: a delete that waited on them then deletes
                # the shared copy too.
                for namespace, entries in stored.items():
                    self._placement.record_stored(self.kind, namespace, entries)
                    self._counters.write_through_written += len(entries)
                self._counters.write_through_failed += failed
                self._counters.write_through_skipped += skipped
                self._placement.unpin(pinned)

    def _claim(self, batch: list[tuple[bytes, ChunkKey]]) -> tuple[list[_Copy], list[ChunkKey]]:
        """Pin the keys that still need a shared copy, and note where each is read from."""
        copies: list[_Copy] = []
        with self._lock:
            for namespace, key in batch:
                meta = self._index.get(key)
                if meta is None or meta.deleted or self.kind in meta.sizes:
                    continue
                source = meta.fastest
                if source is None or source.shared:
                    continue
                copies.append(_Copy(namespace, key, source, meta.parent))
            pinned = self._index.pin([copy.key for copy in copies])
        return copies, pinned

    def _read(self, copies: list[_Copy]) -> dict[bytes, list[_Framed]]:
        """Each pinned block, framed for the shared tier's codec, by namespace: one read
        per source tier and namespace."""
        placement = self._placement
        by_source: dict[tuple[TierKind, bytes], list[_Copy]] = {}
        for copy in copies:
            by_source.setdefault((copy.source, copy.namespace), []).append(copy)
        out: dict[bytes, list[_Framed]] = {}
        for (source, namespace), group in by_source.items():
            buffers = placement.tiers[source].get_many(namespace, [c.key for c in group])
            for copy, buffer in zip(group, buffers or [None] * len(group), strict=True):
                if buffer is None:
                    continue
                try:
                    block = placement.reencode(stored_block(buffer), self.kind)
                except CorruptBlock:
                    continue  # the scrubber or the next read deals with it
                out.setdefault(namespace, []).append((copy.key, block, copy.parent))
        return out

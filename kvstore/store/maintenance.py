"""Background upkeep of a ``TieredStore``'s tiers: scrubbing and flushing.

Both walk every block a tier holds, so both share one rule: the tier's block
list is snapshotted once under the store's lock and then handled in batches,
taking the lock per batch, so upkeep never holds the lock for a whole tier and
foreground reads and writes interleave with it.

* ``scrub`` re-verifies the checksum of blocks in the memory tiers, which are
  verified once on the way in and trusted after that.
* ``flush`` copies blocks that only a volatile tier holds into the first
  persistent tier, so that a daemon's cache survives a restart.

``Maintenance`` owns the optional scrubber thread; the store's ``StoreCore``
owns everything else and lends its ``state`` here (``kvstore.store.state``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from kvstore.block import stored_block, verify_block
from kvstore.errors import CorruptBlock, KVStoreError
from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.store.core import StoreCore
from kvstore.store.guarded import GuardedTier
from kvstore.store.placement import Admission

Held = list[tuple[bytes, ChunkKey]]  # (namespace digest, key) pairs


class Maintenance:
    """Scrub and flush over a store's tiers, and the periodic scrubber thread."""

    def __init__(self, core: StoreCore, scrub_interval_s: float | None) -> None:
        self._lock = core.state.lock
        self._index = core.state.index
        self._placement = core.state.placement
        self._stats = core.state.stats
        self._check_open = core.check_open
        self._interval = scrub_interval_s
        self._stop = threading.Event()
        self._scrubber: threading.Thread | None = None
        if scrub_interval_s:
            self._scrubber = threading.Thread(
                target=self._scrub_periodically, name="kvstore-scrub", daemon=True
            )
            self._scrubber.start()

    def scrub(self, batch: int = 64) -> int:
        """Verify the checksum of every block in the memory tiers; return how many failed.

        Reads from LMDB and Redis are verified on every access, but blocks in
        DRAM and HBM were verified once, on the way in, and are trusted after
        that. A scrub re-checks them, so that memory corrupted in place (a
        stray write through a client's mapping, a bit flip) is found and purged
        before it is served. Runs in batches, pinning each batch while it reads.
        """
        failed = 0
        for kind in self._placement.order:
            tier = self._placement.tiers[kind]
            if tier.verifies_reads:
                continue
            for entries in self._held_in_batches(kind, batch):
                failed += self._scrub_batch(tier, entries)
        return failed

    def flush(self, *, deadline: float | None = None, batch: int = 64) -> int:
        """Copy every block that only a volatile tier (HBM, DRAM) holds into the
        first persistent tier below it; the memory copy stays. Returns how many
        blocks were written.

        Puts are write-back: a block reaches LMDB only when DRAM evicts it. A
        daemon flushes before a graceful exit so that what it cached survives
        the restart. Stops at the first batch boundary past ``deadline``
        (``time.monotonic``).
        """
        order = self._placement.order
        target = next((kind for kind in order if not kind.traits.volatile), None)
        if target is None:
            return 0
        written = 0
        for kind in order:
            if not kind.traits.volatile:
                continue
            for entries in self._held_in_batches(kind, batch):
                if deadline is not None and time.monotonic() > deadline:
                    return written
                with self._lock:
                    self._check_open()
                    written += self._flush_batch(kind, target, entries)
        return written

    @property
    def scrubbing(self) -> bool:
        """Whether the periodic scrubber thread is running."""
        return self._scrubber is not None and self._scrubber.is_alive()

    def stop(self) -> None:
        """Stop the scrubber thread and wait for it (idempotent)."""
        self._stop.set()
        if self._scrubber is not None:
            self._scrubber.join()

    def _held_in_batches(self, kind: TierKind, batch: int) -> Iterator[Held]:
        with self._lock:
            self._check_open()
            held = self._index.held_by(kind)
        for start in range(0, len(held), batch):
            yield held[start : start + batch]

    def _scrub_periodically(self) -> None:
        assert self._interval is not None
        while not self._stop.wait(self._interval):
            try:
                self.scrub()
            except KVStoreError:  # closed under us
                return

    def _scrub_batch(self, tier: GuardedTier, entries: Held) -> int:
        with self._lock:
            pinned = self._index.pin([key for _, key in entries])
        bad: Held = []
        try:
            for namespace, key in entries:
                buffers = tier.get_many(namespace, [key])
                if not buffers or buffers[0] is None:
                    continue
                try:
                    header = verify_block(buffers[0])
                    if header.key != key or header.namespace_digest != namespace:
                        raise CorruptBlock("block stored under another key")
                except CorruptBlock:
                    bad.append((namespace, key))
        finally:
            with self._lock:
                self._placement.unpin(pinned)
                self._stats.tier(tier.kind).corrupt_blocks += len(bad)
                for namespace, key in bad:
                    self._placement.forget(tier.kind, namespace, key)
        return len(bad)

    def _flush_batch(self, kind: TierKind, target: TierKind, entries: Held) -> int:
        """Write ``entries`` of tier ``kind`` that no persistent tier holds into
        ``target``. Lock held."""
        placement = self._placement
        tier = placement.tiers[kind]
        by_namespace: dict[bytes, list[Admission]] = {}
        for namespace, key in entries:
            meta = self._index.get(key)
            if meta is None or kind not in meta.sizes or any(t >= target for t in meta.sizes):
                continue
            buffers = tier.get_many(namespace, [key])
            if not buffers or buffers[0] is None:
                continue
            try:
                block = placement.reencode(stored_block(buffers[0]), target)
            except CorruptBlock:
                self._stats.tier(kind).corrupt_blocks += 1
                continue
            by_namespace.setdefault(namespace, []).append(Admission(key, block, meta.parent))
        written = 0
        for namespace, admissions in by_namespace.items():
            keys = frozenset(admission.key for admission in admissions)
            written += len(placement.admit(target, namespace, admissions, protect=keys) & keys)
        return written

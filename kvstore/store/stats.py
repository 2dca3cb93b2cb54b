"""Counters the store keeps, per tier and overall.

Mutated only with the store lock held; ``snapshot`` copies them for readers.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from kvstore.keys import Namespace
from kvstore.kinds import TierKind


@dataclass
class TierCounters:
    """What happened at one tier. Bytes are stored (encoded) bytes."""

    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    demotions: int = 0
    promotions: int = 0
    evictions: int = 0
    corrupt_blocks: int = 0
    errors: int = 0
    writebacks_failed: int = 0  # victims kept here: their copy to a slower tier failed
    calls_refused: int = 0  # answered as a miss or a failed write: the breaker was open
    # A shared tier in write-through mode (``kvstore.store.write_through``): blocks queued
    # for a copy, copied, skipped (held there already, or gone before their turn), dropped
    # because the queue was full, and refused by the tier; and those queued or on their
    # way now (queued = written + skipped + failed + pending).
    write_through_queued: int = 0
    write_through_written: int = 0
    write_through_skipped: int = 0
    write_through_dropped: int = 0
    write_through_failed: int = 0
    write_through_pending: int = 0
    breaker_trips: int = 0
    down: int = 0  # 1 while the breaker is open
    used_bytes: int = 0
    capacity_bytes: int = 0
    blocks: int = 0


@dataclass
class StoreStats:
    """Store-wide counters plus one ``TierCounters`` per configured tier."""

    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    gets: int = 0
    get_misses: int = 0
    puts: int = 0
    chunks_stored: int = 0
    puts_dropped: int = 0
    namespaces_forgotten: int = 0  # by a full namespace table, least recently named first
    tiers: dict[TierKind, TierCounters] = field(default_factory=dict)

    def tier(self, kind: TierKind) -> TierCounters:
        return self.tiers.setdefault(kind, TierCounters())

    def snapshot(self) -> StoreStats:
        copy = dataclasses.replace(self)
        copy.tiers = {kind: dataclasses.replace(c) for kind, c in self.tiers.items()}
        return copy

    def to_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["tiers"] = {kind.label: dataclasses.asdict(c) for kind, c in self.tiers.items()}
        return data


@dataclass(frozen=True)
class NamespaceUsage:
    """What one namespace holds: blocks and stored bytes per tier, as this store's index
    knows them (a shared tier may also hold blocks other hosts put). ``namespace`` is
    ``None`` for blocks found on disk whose namespace no client has registered since
    the store started."""

    digest: bytes
    namespace: Namespace | None
    tiers: dict[TierKind, tuple[int, int]]

    def to_dict(self) -> dict[str, object]:
        namespace = self.namespace
        return {
            "namespace": self.digest.hex(),
            "model": None if namespace is None else namespace.model,
            "layout": None if namespace is None else dataclasses.asdict(namespace.layout),
            "tenant_salt_sha256": None if namespace is None else _salt_hash(namespace),
            "tiers": {
                kind.label: {"blocks": blocks, "bytes": nbytes}
                for kind, (blocks, nbytes) in sorted(self.tiers.items())
            },
        }


@dataclass(frozen=True)
class NamespaceEviction:
    """What ``TieredStore.evict_namespace`` did: blocks that left the tier, and blocks
    that stayed because a read or a lease held them pinned."""

    evicted: int
    pinned: int


def _salt_hash(namespace: Namespace) -> str | None:
    """A short hash of the tenant salt: enough to tell tenants apart, not to learn it."""
    salt = namespace.tenant_salt
    return None if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:12]

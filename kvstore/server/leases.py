"""Leases: how long a shared-memory reader may count on the blocks it was shown.

A ``"shm"`` get pins the DRAM blocks it describes, and the HBM ones when its
client copies device memory (``SharedServing.share``), so they cannot be
evicted and their arena extents cannot be reused while the client copies them
out of its own mapping of either arena. Every pin taken that way belongs
to exactly one lease, and is given back exactly once: when the client
releases the lease, when the lease expires, or when the daemon stops::

    grant ──► {id: Lease(namespace, keys, expires_at)} ──┬── release(id)       ──► unpin
     (share pins,                                         ├── release_many(ids) ──► unpin
      lease recorded in the same call)                    ├── expire()          ──► unpin
                                                          └── release_all       ──► unpin

``release_many`` is how a client's next get gives back the leases it is done
with (their ids ride in the get's body, ``routes.get``), instead of one
request per lease: unknown ids are skipped there, not refused, because a
lease may have expired, or been released by a request that was retried.

"Exactly once" holds because a lease leaves the table under ``_lock`` before
its keys are unpinned: whoever removed it unpins, and nobody else can find
it. ``grant`` pins and records in one call on a worker thread, so a request
cancelled while it waits cannot leave pins that no lease owns.

Lock order: this table's lock, then the store's (``share``/``unpin`` take it);
the store never calls back into the table.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.keys import ChunkKey, Namespace
from kvstore.store.shared import SharedBlock, SharedServing
from kvstore.wire.codes import ErrorCode, WireError


@dataclass(frozen=True, slots=True)
class Lease:
    """One grant of pinned DRAM and HBM blocks to a shared-memory reader."""

    id: str
    namespace: Namespace
    keys: tuple[ChunkKey, ...]
    ttl_s: float
    expires_at: float  # on the table's clock (monotonic)


class LeaseTable:
    """Lease id -> ``Lease``, bounded by ``max_leases``. Thread safe.

    Ids are 128 random bits: a client cannot release another client's lease
    by guessing.
    """

    def __init__(
        self,
        serving: SharedServing,
        *,
        ttl_s: float,
        max_leases: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.serving = serving
        self.ttl_s = ttl_s  # replaced on SIGHUP; applies to leases granted afterwards
        self.max_leases = max_leases
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def grant(
        self, namespace: Namespace, keys: Sequence[ChunkKey], *, hbm: bool = False
    ) -> tuple[Lease, list[SharedBlock | None]]:
        """Pin the keys held in DRAM (with ``hbm``, in a shared HBM arena too) under a
        new lease; ``None`` for the others.

        Over ``max_leases`` outstanding it pins nothing and raises
        ``request_too_large``: each lease holds memory that nothing else can use.
        """
        with self._lock:
            if len(self._leases) >= self.max_leases:
                raise WireError(
                    ErrorCode.REQUEST_TOO_LARGE,
                    f"{len(self._leases)} leases outstanding; the limit is {self.max_leases}",
                )
            shared = self.serving.share(namespace, keys, hbm=hbm)
            lease = Lease(
                id=secrets.token_hex(16),
                namespace=namespace,
                keys=tuple(block.key for block in shared if block is not None),
                ttl_s=self.ttl_s,
                expires_at=self._clock() + self.ttl_s,
            )
            self._leases[lease.id] = lease
        return lease, shared

    def release(self, lease_id: str) -> int:
        """Unpin a lease's blocks; return how many. ``unknown_lease`` if it is gone."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise WireError(ErrorCode.UNKNOWN_LEASE, "lease does not exist (released or expired)")
        self.serving.unpin(lease.keys)
        return len(lease.keys)

    def release_many(self, lease_ids: Sequence[str]) -> int:
        """Unpin the leases of ``lease_ids`` that still exist; return how many leases
        that was (unknown ids are skipped: expired, or released already)."""
        with self._lock:
            popped = [self._leases.pop(lease_id, None) for lease_id in lease_ids]
        leases = [lease for lease in popped if lease is not None]
        for lease in leases:
            self.serving.unpin(lease.keys)
        return len(leases)

    def expire(self) -> int:
        """Unpin every lease past its expiry; return how many leases expired."""
        now = self._clock()
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.id]
        for lease in expired:
            self.serving.unpin(lease.keys)
        return len(expired)

    def release_all(self) -> int:
        """Unpin every lease (the daemon is stopping); return how many there were."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            self.serving.unpin(lease.keys)
        return len(leases)

    def next_expiry(self) -> float | None:
        """Seconds until the earliest lease expires (``None`` without leases)."""
        with self._lock:
            if not self._leases:
                return None
            earliest = min(lease.expires_at for lease in self._leases.values())
        return max(0.0, earliest - self._clock())

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def pinned_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.keys) for lease in self._leases.values())

"""The one protocol every tier implements (the kinds themselves: ``kvstore.kinds``).

A tier is a dumb, batched byte store for encoded blocks (``kvstore.block``):
it neither chooses what to evict nor knows about prefixes; that is the
``TieredStore``'s job. Every method is batched so a prefix of hundreds of
chunks costs one round trip, not hundreds.

Contract, for every implementation:

* ``put_many`` stores complete blocks only: a reader never sees a partly
  written value (two-phase for arenas: copy, then publish; one transaction
  for LMDB; one ``SET`` per key for Redis). It raises ``TierFull`` when the
  backend refuses for lack of room, so the store can evict and retry.
* ``get_many`` returns *owned* buffers (valid after the call returns) or
  ``None`` for a miss. It never returns a value it cannot vouch for the
  length of; checksum verification is the store's job and ``verifies_reads``
  tells the store whether this tier's reads cross a trust boundary.
* Backend exceptions are translated here, at the tier's boundary, into
  ``TierUnavailable`` / ``TierFull`` (``kvstore.errors``).
* Every method takes the 16-byte namespace digest, so tiers that share a
  backend across processes can scope keys by namespace.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from kvstore.block import HEADER_BYTES, Block
from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class StoredBlockInfo:
    """What a persistent tier reports about a block it holds, for index rebuilds."""

    namespace: bytes
    key: ChunkKey
    nbytes: int
    header: bytes


@dataclass(frozen=True, slots=True)
class ServerMemory:
    """What the servers behind a shared tier say of their memory, summed over the masters
    that answered (``answered`` of ``masters``). ``max_bytes`` 0: some master has no
    ``maxmemory``; ``policies``: the ``maxmemory-policy`` of each master that answered."""

    used_bytes: int
    max_bytes: int
    policies: frozenset[str]
    masters: int
    answered: int


@runtime_checkable
class ServerOwnedTier(Protocol):
    """A shared tier whose servers own its capacity: they evict, the store does not."""

    def server_memory(self) -> ServerMemory:
        """Ask every master (one round trip each); raises ``TierError`` if none answers."""
        ...


@dataclass(frozen=True, slots=True)
class BlockDestination:
    """Where ``get_many_into`` copies one block: its header into ``header``
    (``HEADER_BYTES`` uint8) and its payload straight into ``payload``, a uint8
    view of the caller's own buffer (an engine's KV buffer, a pinned staging
    area), so the payload is copied once and no memory is allocated."""

    header: np.ndarray
    payload: np.ndarray


def scatter(stored: Buffer, destination: BlockDestination) -> bool:
    """Copy a stored block into ``destination``; ``False`` (nothing copied) unless its
    size is exactly header plus payload (a compressed or foreign block is not)."""
    view = np.frombuffer(stored, dtype=np.uint8)
    if view.size != HEADER_BYTES + destination.payload.size:
        return False
    np.copyto(destination.header, view[:HEADER_BYTES])
    np.copyto(destination.payload, view[HEADER_BYTES:])
    return True


@runtime_checkable
class Tier(Protocol):
    """A batched block store at one level of the hierarchy."""

    kind: TierKind
    verifies_reads: bool

    def put_many(self, namespace: bytes, items: Sequence[tuple[ChunkKey, Block]]) -> None:
        """Store every block; raise ``TierFull`` if the backend has no room."""

    def get_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        """The stored bytes (header + payload) of each key, or ``None`` if absent."""

    def get_many_into(
        self,
        namespace: bytes,
        keys: Sequence[ChunkKey],
        destinations: Sequence[BlockDestination],
    ) -> list[bool]:
        """Copy each stored block into its destination (see ``scatter``); ``False`` for a
        miss or a block of another size, whose destination is then left unspecified."""

    def contains_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is stored, without reading its value."""

    def delete_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> int:
        """Delete the keys present; return how many were deleted."""

    def scan(self) -> Iterator[StoredBlockInfo]:
        """Every block the tier holds (for rebuilding the index after a restart)."""

    def used_bytes(self) -> int:
        """Bytes of stored blocks, as the tier accounts them."""

    def capacity_bytes(self) -> int:
        """Bytes the tier may hold; the store evicts to stay under it."""

    def close(self) -> None:
        """Release the backend (idempotent)."""

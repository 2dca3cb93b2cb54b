"""The logic shared by the two memory tiers: an index over an arena of bytes.

DRAM and HBM differ only in where the arena lives and how bytes are copied in
and out (``ArenaMemory``); indexing, allocation, two-phase publication and
accounting live here once.

Two-phase put: extents for the whole batch are allocated first (all or
nothing, so a batch that does not fit raises ``TierFull`` having changed
nothing), bytes are copied in, and only then are the keys published in the
index. A reader can therefore never find a key whose bytes are still being
written.

Reads copy out while holding the tier lock, so an extent cannot be freed and
reused under a reader. Memory copies are bandwidth bound, so serialising them
costs little, and it keeps the invariant trivially true.

Readers in other processes (the daemon's shared-memory clients) cannot take
that lock, so a tier may also keep *extent generations*: one u64 counter per
page of the arena, in memory those readers can map. Freeing an extent bumps
the counter of its first page, under the lock and before the extent can be
handed out again, so "the counter still reads what it read when the extent
was looked up" (``extent_of``) means "these bytes have not been freed, let
alone rewritten, since": a seqlock per extent, with no ABA (counters only
grow). An extent is only ever freed whole, so its first page's counter
covers all of it.

Reservations (the daemon's puts, ``kvstore.server.landing``) split the two-phase put
across calls: ``reserve`` allocates an extent that no key names, the caller
writes the block into it (``writable``), and ``publish`` names it in the index
or ``unreserve`` gives it back. Between the two the extent belongs to whoever
reserved it: it counts in ``used_bytes`` (capacity holds), no reader can find
it, and no eviction can take it (eviction only takes indexed blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvstore.block import HEADER_BYTES, Block
from kvstore.errors import TierFull, TierUnavailable
from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.tiers.base import BlockDestination, Buffer, StoredBlockInfo
from kvstore.tiers.extents import ExtentAllocator


class ArenaMemory(Protocol):
    """A fixed block of bytes that the arena tier indexes."""

    nbytes: int

    def write(self, offset: int, parts: Sequence[memoryview | bytes]) -> None:
        """Copy ``parts`` back to back into the arena at ``offset``."""

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``offset`` into the uint8 array ``out``."""

    def close(self) -> None:
        """Release the memory."""


@dataclass(slots=True)
class _Extent:
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SharedExtent:
    """Where a block lies (``offset``, ``nbytes``) and its extent's ``generation``
    when it was looked up (0 for a tier without generations)."""

    offset: int
    nbytes: int
    generation: int = 0


# Index key: (namespace digest, chunk key). Chunk keys already hash the namespace
# in, but engines may supply raw keys, and one namespace must never be able to
# overwrite or delete another's block.
_IndexKey = tuple[bytes, ChunkKey]


class ArenaTier:
    """Index of blocks stored in an ``ArenaMemory``; see the module docstring."""

    verifies_reads = False

    def __init__(
        self,
        kind: TierKind,
        memory: ArenaMemory,
        *,
        capacity_bytes: int | None = None,
        generations: np.ndarray | None = None,
    ) -> None:
        """Blocks go in ``[0, capacity_bytes)`` of ``memory`` (all of it by default);
        ``generations``: a uint64 array with a counter per page of that range (see
        the module docstring), or ``None``."""
        self.kind = kind
        self._memory = memory
        self._allocator = ExtentAllocator(
            memory.nbytes if capacity_bytes is None else capacity_bytes
        )
        pages = -(-self._allocator.capacity // self._allocator.page)
        if generations is not None and (generations.dtype != np.uint64 or generations.size < pages):
            raise ValueError(f"generations must be {pages} uint64 counters")
        self._generations = generations
        self._index: dict[_IndexKey, _Extent] = {}
        self._lock = threading.Lock()
        self._closed = False

    def put_many(self, namespace: bytes, items: Sequence[tuple[ChunkKey, Block]]) -> None:
        with self._lock:
            self._check_open()
            offsets: list[int] = []
            for _, block in items:
                offset = self._allocator.allocate(block.nbytes)
                if offset is None:
                    for allocated in offsets:
                        self._allocator.free(allocated)
                    raise TierFull(
                        self.kind.label,
                        f"no free extent of {block.nbytes} bytes "
                        f"(largest free {self._allocator.largest_free})",
                    )
                offsets.append(offset)
            for (_, block), offset in zip(items, offsets, strict=True):
                self._memory.write(offset, (block.header, block.payload))
            for (key, block), offset in zip(items, offsets, strict=True):
                replaced = self._index.get((namespace, key))
                if replaced is not None:
                    self._free(replaced.offset)
                self._index[(namespace, key)] = _Extent(offset, block.nbytes)

    def reserve(self, nbytes: int) -> int | None:
        """The offset of a new extent of ``nbytes`` that no key names yet, or ``None``
        if no hole fits; the caller owns it until ``publish`` or ``unreserve``."""
        with self._lock:
            self._check_open()
            return self._allocator.allocate(nbytes)

    def publish(self, namespace: bytes, items: Sequence[tuple[ChunkKey, int, int]]) -> None:
        """Name reserved, fully written extents ``(key, offset, nbytes)`` in the index,
        freeing any extent a key named before: from now on readers find them."""
        with self._lock:
            self._check_open()
            for key, offset, nbytes in items:
                replaced = self._index.get((namespace, key))
                if replaced is not None:
                    self._free(replaced.offset)
                self._index[(namespace, key)] = _Extent(offset, nbytes)

    def unreserve(self, offsets: Sequence[int]) -> None:
        """Give back reserved extents that will not be published (a closed tier has
        already let go of all of its memory)."""
        with self._lock:
            if not self._closed:
                for offset in offsets:
                    self._free(offset)

    def get_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        with self._lock:
            self._check_open()
            found: list[Buffer | None] = []
            for key in keys:
                extent = self._index.get((namespace, key))
                if extent is None:
                    found.append(None)
                    continue
                # One allocation per block: blocks up to 32 MiB come from the heap,
                # which glibc reuses once freed, so a steady stream of gets does not
                # page-fault on every output buffer. ``get(..., out=)`` avoids the
                # allocation altogether.
                out = np.empty(extent.nbytes, dtype=np.uint8)
                self._memory.read_into(extent.offset, out)
                found.append(out.data)
            return found

    def get_many_into(
        self,
        namespace: bytes,
        keys: Sequence[ChunkKey],
        destinations: Sequence[BlockDestination],
    ) -> list[bool]:
        with self._lock:
            self._check_open()
            copied: list[bool] = []
            for key, destination in zip(keys, destinations, strict=True):
                extent = self._index.get((namespace, key))
                if extent is None or extent.nbytes != HEADER_BYTES + destination.payload.size:
                    copied.append(False)
                    continue
                self._memory.read_into(extent.offset, destination.header)
                self._memory.read_into(extent.offset + HEADER_BYTES, destination.payload)
                copied.append(True)
            return copied

    def extent_of(self, namespace: bytes, key: ChunkKey) -> SharedExtent | None:
        """Where a stored block lies in the arena, for zero-copy sharing, with its
        extent's generation read in the same breath (under the lock).

        Valid while the block stays put; the store pins it for as long as a
        client may read it through its own mapping of the arena, and the
        generation tells that client whether it did stay put.
        """
        with self._lock:
            self._check_open()
            extent = self._index.get((namespace, key))
            if extent is None:
                return None
            return SharedExtent(extent.offset, extent.nbytes, self._generation(extent.offset))

    def generation_index(self, offset: int) -> int:
        """Which counter of ``generations`` belongs to the extent at ``offset``."""
        return offset // self._allocator.page

    def _generation(self, offset: int) -> int:
        if self._generations is None:
            return 0
        return int(self._generations[self.generation_index(offset)])

    def _free(self, offset: int) -> None:
        """Free an extent, bumping its generation first (lock held)."""
        if self._generations is not None:
            self._generations[self.generation_index(offset)] += 1
        self._allocator.free(offset)

    def contains_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [(namespace, key) in self._index for key in keys]

    def delete_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> int:
        deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                extent = self._index.pop((namespace, key), None)
                if extent is not None:
                    self._free(extent.offset)
                    deleted += 1
        return deleted

    def scan(self) -> Iterator[StoredBlockInfo]:
        with self._lock:
            self._check_open()
            entries = [
                (
                    namespace,
                    key,
                    extent.nbytes,
                    self._read_header(extent),
                )
                for (namespace, key), extent in self._index.items()
            ]
        for namespace, key, nbytes, header in entries:
            yield StoredBlockInfo(namespace, key, nbytes, header)

    def _read_header(self, extent: _Extent) -> bytes:
        header = np.empty(min(HEADER_BYTES, extent.nbytes), dtype=np.uint8)
        self._memory.read_into(extent.offset, header)
        return header.tobytes()

    def used_bytes(self) -> int:
        with self._lock:
            self._check_open()
            return self._allocator.used_bytes

    def capacity_bytes(self) -> int:
        return self._allocator.capacity

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._index.clear()
                self._generations = None  # a view of the memory: let it go first
                self._memory.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(self.kind.label, "tier is closed")

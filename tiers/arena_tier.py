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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvstore.arena import ExtentAllocator
from kvstore.block import HEADER_BYTES, Block
from kvstore.errors import TierFull, TierUnavailable
from kvstore.keys import ChunkKey
from kvstore.tiers.base import BlockDestination, Buffer, StoredBlockInfo, TierKind


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


# Index key: (namespace digest, chunk key). Chunk keys already hash the namespace
# in, but engines may supply raw keys, and one namespace must never be able to
# overwrite or delete another's block.
_IndexKey = tuple[bytes, ChunkKey]


class ArenaTier:
    """Index of blocks stored in an ``ArenaMemory``; see the module docstring."""

    verifies_reads = False

    def __init__(self, kind: TierKind, memory: ArenaMemory) -> None:
        self.kind = kind
        self._memory = memory
        self._allocator = ExtentAllocator(memory.nbytes)
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
                    self._allocator.free(replaced.offset)
                self._index[(namespace, key)] = _Extent(offset, block.nbytes)

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

    def extent_of(self, namespace: bytes, key: ChunkKey) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a stored block in the arena, for zero-copy sharing.

        Valid while the block stays put; the store pins it for as long as a
        client may read it through its own mapping of the arena.
        """
        with self._lock:
            self._check_open()
            extent = self._index.get((namespace, key))
            return None if extent is None else (extent.offset, extent.nbytes)

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
                    self._allocator.free(extent.offset)
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
                self._memory.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(self.kind.label, "tier is closed")

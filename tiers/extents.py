"""Where blocks live inside a pre-allocated arena (DRAM shared memory, HBM tensor).

``ExtentAllocator`` hands out contiguous, page-aligned byte ranges of one
arena. Free space is a list of extents sorted by offset; ``free`` merges an
extent with its free neighbours at once, so fragmentation never outlives the
blocks that caused it. Allocation is best fit, which keeps big holes for big
blocks. Within a namespace every uncompressed chunk has the same size, so in
the common case the arena behaves like a fixed-slot pool and best fit reuses
the exact hole that the last eviction left.

Why not a dict of ``bytes``: the arena is allocated once (shared memory that
the daemon maps into client processes, pinned for DMA when CUDA is present),
so the store's footprint is fixed up front and blocks never go through the
Python allocator.

Owned by the arena tier; not thread safe on its own (the tier holds a lock).
"""

from __future__ import annotations

import bisect

PAGE_BYTES = 4096


def round_up(nbytes: int, page: int = PAGE_BYTES) -> int:
    return -(-nbytes // page) * page


class ExtentAllocator:
    """Best-fit allocator of page-aligned extents within ``[0, capacity)``."""

    def __init__(self, capacity: int, page: int = PAGE_BYTES) -> None:
        self.page = page
        self.capacity = capacity - capacity % page
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_lengths: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._allocated: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return self.capacity - sum(self._free_lengths.values())

    @property
    def largest_free(self) -> int:
        return max(self._free_lengths.values(), default=0)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes``, or ``None`` if no hole fits."""
        need = round_up(max(nbytes, 1), self.page)
        best_offset, best_length = -1, 0
        for offset in self._free_offsets:
            length = self._free_lengths[offset]
            if length >= need and (best_offset < 0 or length < best_length):
                best_offset, best_length = offset, length
                if length == need:
                    break
        if best_offset < 0:
            return None
        self._remove_free(best_offset)
        if best_length > need:
            self._insert_free(best_offset + need, best_length - need)
        self._allocated[best_offset] = need
        return best_offset

    def free(self, offset: int) -> None:
        """Return an extent; merge it with free neighbours."""
        length = self._allocated.pop(offset)
        index = bisect.bisect_left(self._free_offsets, offset)
        if index < len(self._free_offsets):
            right = self._free_offsets[index]
            if offset + length == right:
                length += self._free_lengths[right]
                self._remove_free(right)
        if index > 0:
            left = self._free_offsets[index - 1]
            if left + self._free_lengths[left] == offset:
                offset, length = left, length + self._free_lengths[left]
                self._remove_free(left)
        self._insert_free(offset, length)

    def _insert_free(self, offset: int, length: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_lengths[offset] = length

    def _remove_free(self, offset: int) -> None:
        del self._free_offsets[bisect.bisect_left(self._free_offsets, offset)]
        del self._free_lengths[offset]

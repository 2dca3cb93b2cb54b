"""A read-only mapping of the daemon's DRAM arena, for same-host zero-socket gets.

The daemon keeps its DRAM tier in one named POSIX shared-memory segment
(``kvstore.tiers.dram``). A client on the same host maps it once, read only,
and copies leased blocks straight out of it, so the KV never crosses the
socket. Read only is the point: a client bug can never scribble on blocks
that other clients will read.

A mapping outlives the segment's name: after a daemon restart the old segment
is unlinked but stays mapped until this object goes, and the new daemon's
leases name a new segment, which is mapped afresh (``ClientProtocol``).
"""

from __future__ import annotations

import mmap
import os
import re
import struct

from kvstore.errors import CorruptBlock

SHM_DIR = "/dev/shm"
# What SharedMemory names look like; nothing that could leave SHM_DIR.
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}")
# An extent generation: a u64 in the daemon's (this host's) byte order.
_GENERATION = struct.Struct("=Q")


class SharedArena:
    """One mapped segment. Copy out with ``block``; ``close`` when no copy is running."""

    def __init__(self, name: str) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a shared-memory segment name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the segment
        self.name = name
        self.size = size

    def block(self, offset: int, length: int) -> memoryview:
        """A view of ``[offset, offset + length)``; release it (``with``) before ``close``.

        Bounds are checked here because they come from the daemon: a block
        that does not lie inside the arena is treated like a corrupt one.
        """
        if offset < 0 or length <= 0 or offset + length > self.size:
            raise CorruptBlock(
                f"block [{offset}, +{length}) lies outside the {self.size}-byte arena"
            )
        return memoryview(self._map)[offset : offset + length]

    def generation(self, at: int) -> int:
        """The extent generation counter at byte ``at`` (``kvstore.tiers.dram``).

        One aligned 8-byte load, so it is never torn on x86-64; read after a
        copy, it is ordered after the copy's loads there (loads are not
        reordered with other loads), which is what ``client.blocks`` relies on.
        """
        if at < 0 or at % _GENERATION.size or at + _GENERATION.size > self.size:
            raise CorruptBlock(f"generation at {at} lies outside the {self.size}-byte arena")
        return int(_GENERATION.unpack_from(self._map, at)[0])

    def close(self) -> None:
        self._map.close()

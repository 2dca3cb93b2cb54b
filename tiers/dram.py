"""CPU DRAM tier: an arena in named POSIX shared memory.

The arena is one ``multiprocessing.shared_memory`` segment so that the daemon
can later hand its name to same-host clients, which map it once and copy
blocks out without the bytes crossing a socket. When CUDA is present the
segment is also registered with the driver as pinned (page-locked) memory, so
host-to-device copies from it run as DMA at full PCIe speed instead of being
staged through a bounce buffer.

The segment's layout::

    [0, capacity)                      blocks (``ArenaTier``'s extents)
    [capacity, capacity + 8 * pages)   extent generations: a u64 (native byte
                                       order) per 4 KiB page of the blocks

Clients that copy a block out of their own mapping cannot take the tier's
lock; they compare the generation of the block's extent after the copy with
the one it had when it was leased (``client.blocks``), which proves the
extent was not freed, so not rewritten, in between (``ArenaTier``).
"""

from __future__ import annotations

import os
import secrets
import weakref
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

from kvstore.errors import TierUnavailable
from kvstore.kinds import TierKind
from kvstore.tiers import shm_segments
from kvstore.tiers.arena_tier import ArenaTier
from kvstore.tiers.extents import PAGE_BYTES
from kvstore.tiers.prefault import Prefault

_GPU_DEVICE_FILES = (Path("/dev/nvidiactl"), Path("/dev/dxg"), Path("/dev/kfd"))
"""What a GPU driver (NVIDIA's; WSL's; ROCm's) shows a process: on a host with none of
them torch can find no device, so it is not imported (most of a second) to be asked."""


class SharedMemoryArena:
    """A named shared-memory segment viewed as a flat uint8 array, its pages allocated
    up front (``tiers.shm_segments``: a shortfall is an error now, not a SIGBUS later)."""

    def __init__(
        self,
        nbytes: int,
        *,
        name: str | None = None,
        pin: bool | None = None,
        prefault: bool = False,
    ) -> None:
        self.name = name or f"{shm_segments.PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        try:
            self._held = shm_segments.hold(self.name, nbytes)
        except BaseException:
            _release_segment(self._shm, None)
            raise
        self.nbytes = nbytes
        self._array: np.ndarray = np.ndarray((nbytes,), dtype=np.uint8, buffer=self._shm.buf)
        self.pinned = _pin_host_memory(self._array) if pin is not False else False
        # Pinning populated every page already.
        self.prefault = (
            Prefault(self._array.ctypes.data, nbytes, self.name)
            if prefault and not self.pinned and nbytes
            else None
        )
        # Unlink the segment even if close() is never called (a crashed test, a
        # forgotten store); otherwise it outlives the process in /dev/shm.
        self._finalizer = weakref.finalize(self, _release_segment, self._shm, self._held)

    def write(self, offset: int, parts: Sequence[memoryview | bytes]) -> None:
        for part in parts:
            length = len(part) if isinstance(part, bytes) else part.nbytes
            self._array[offset : offset + length] = np.frombuffer(part, dtype=np.uint8)
            offset += length

    def array(self, offset: int, count: int, dtype: type[np.generic]) -> np.ndarray:
        """``count`` items of ``dtype`` at ``offset``, a view of the segment (zeroed
        at creation, as fresh shared memory is)."""
        return np.ndarray((count,), dtype=dtype, buffer=self._shm.buf, offset=offset)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        np.copyto(out, self._array[offset : offset + out.size])

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of ``nbytes`` at ``offset``, for sending a block without
        copying it; valid only while the block stays put (pinned)."""
        return self._array[offset : offset + nbytes].data.toreadonly()

    def writable(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` at ``offset``: only for an extent the caller
        has reserved and not yet published (``ArenaTier.reserve``)."""
        return self._array[offset : offset + nbytes].data

    def close(self) -> None:
        if self.prefault is not None:  # before the memory it populates goes away
            self.prefault.stop()
        if self.pinned:
            _unpin_host_memory(self._array)
            self.pinned = False
        # Drop our own view before closing; numpy would otherwise keep the
        # exported buffer alive and SharedMemory.close() would refuse.
        self._array = np.empty(0, dtype=np.uint8)
        self._finalizer()


def _release_segment(segment: shared_memory.SharedMemory, held: int | None) -> None:
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:  # someone removed it from /dev/shm: nothing left to unlink
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    if held is not None:
        os.close(held)


def _pin_host_memory(array: np.ndarray) -> bool:
    """Page-lock ``array`` for DMA if a CUDA device is usable; report whether it was."""
    if array.nbytes == 0 or not any(device.exists() for device in _GPU_DEVICE_FILES):
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    return int(result) == 0


def _unpin_host_memory(array: np.ndarray) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)


class DRAMTier(ArenaTier):
    """Host-memory tier over a shared-memory arena (pinned when CUDA is present)."""

    def __init__(
        self, capacity_bytes: int, *, shm_name: str | None = None, prefault: bool = False
    ) -> None:
        """``prefault``: populate the arena's pages in the background now rather than
        by the first puts (``tiers.prefault``). Where ``/dev/shm`` has less room than
        ``capacity_bytes`` the tier is sized down to it, with a warning; segments that
        dead kvstore processes left there are removed first."""
        shm_segments.reap_stale()
        capacity = capacity_bytes - capacity_bytes % PAGE_BYTES
        fitted = shm_segments.fit(capacity + 8 * (capacity // PAGE_BYTES))
        # Each page of blocks takes 8 bytes of generation counter beside it.
        capacity = min(capacity, fitted * PAGE_BYTES // (PAGE_BYTES + 8) // PAGE_BYTES * PAGE_BYTES)
        if capacity < min(capacity_bytes, shm_segments.MIN_SEGMENT_BYTES):
            raise TierUnavailable(
                TierKind.DRAM.label,
                f"{shm_segments.SHM_DIR} has no room for a DRAM tier ({capacity} bytes fit); "
                "give it more (docker run --shm-size) or configure no DRAM tier",
            )
        pages = capacity // PAGE_BYTES
        self.arena = SharedMemoryArena(capacity + 8 * pages, name=shm_name, prefault=prefault)
        # Where the generation counters start in the segment (clients read them there).
        self.generations_offset = capacity
        generations = self.arena.array(capacity, pages, np.uint64)
        super().__init__(
            TierKind.DRAM, self.arena, capacity_bytes=capacity, generations=generations
        )

    def generation_offset(self, offset: int) -> int:
        """Byte offset in the segment of the generation of the extent at ``offset``."""
        return self.generations_offset + 8 * self.generation_index(offset)

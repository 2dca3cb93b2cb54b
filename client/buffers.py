"""Payload buffers for gets without ``out=``, reused once the caller lets go of them.

A plain get hands back chunks in memory the client allocates, and fresh
memory is expensive: the kernel faults in and zeroes each 4 KiB page on first
touch (~1.3 us a page here, so faulting a chunk in costs more than copying it
twice). Whether malloc reuses freed memory instead is up to glibc's
heuristics (mmap threshold, heap trimming, one arena per thread): in the
daemon benchmark it gave each get's memory back to the kernel before the
next, and every page faulted again (a 2 MiB-chunk get out of shared memory
ran at a third of the speed of the same get into the caller's buffers). So
the client reuses its own.

A buffer is handed out as a view of a backing array, and a finalizer on the
view gives the backing array back to the pool. Callers only ever see the
view's memory through ``memoryview``s and arrays made from them, all of which
keep the view alive, so a buffer is reused only once nothing can reach it:
the guarantee malloc gives. The pool keeps at most ``limit`` bytes; beyond
that, buffers given back are freed.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np


class BufferPool:
    """Byte buffers by size, reused once unreferenced; thread safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0
        # Reentrant: a garbage collection inside ``take`` may run a finalizer
        # (``_give_back``) on this thread while the lock is held.
        self._lock = threading.RLock()

    def take(self, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes (uninitialised)."""
        with self._lock:
            free = self._free.get(size)
            backing = free.pop() if free else None
            if backing is not None:
                self._held -= size
        if backing is None:
            backing = np.empty(size, dtype=np.uint8)
        view = backing[:]
        weakref.finalize(view, self._give_back, backing).atexit = False
        return view.data

    @property
    def held_bytes(self) -> int:
        """Bytes the pool keeps for reuse now."""
        return self._held

    def _give_back(self, backing: np.ndarray) -> None:
        with self._lock:
            if self._held + backing.size <= self.limit:
                self._free.setdefault(backing.size, []).append(backing)
                self._held += backing.size

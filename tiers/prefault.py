"""Fault in a shared-memory arena's pages ahead of use, on a background thread.

Why: a fresh ``/dev/shm`` segment has no pages. Each first write to a 4 KiB
page takes a fault that allocates and zeroes it, so the first pass of puts
through a DRAM arena runs far slower than every later one: on the 2-core
development VM a 1.5 GiB arena took ~3.5 s of faults (~0.4 GB/s), and the
daemon benchmark's first 128 MiB puts took 10-15x the median. Populating the
arena up front moves that cost off the request path. A pinned arena
(``cudaHostRegister``) is populated by the driver already.

``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) faults pages in writable
without writing them, so it is safe while puts and gets use the arena. Where
the kernel lacks it the arena is simply faulted in by use, as before.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time

log = logging.getLogger("kvstore.tiers")

_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; not in Python's mmap module before 3.13
_STEP_BYTES = 64 << 20  # one madvise call: a close() waits for at most one step


class Prefault:
    """Populates ``[address, address + nbytes)`` on a daemon thread, a step at a
    time; ``stop`` ends it between steps (before the memory is unmapped)."""

    def __init__(self, address: int, nbytes: int, name: str) -> None:
        self._address = address
        self._nbytes = nbytes
        self._stop = threading.Event()
        self.populated_bytes = 0
        self._thread = threading.Thread(target=self._run, name=f"prefault-{name}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        """Whether the thread has ended (every page populated, stopped, or unsupported)."""
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end; whether it has."""
        self._thread.join(timeout_s)
        return self.done

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        madvise = _madvise()
        if madvise is None:
            return
        started = time.perf_counter()
        for offset in range(0, self._nbytes, _STEP_BYTES):
            if self._stop.is_set():
                return
            length = min(_STEP_BYTES, self._nbytes - offset)
            if madvise(self._address + offset, length, _MADV_POPULATE_WRITE) != 0:
                log.info(
                    "not prefaulting the DRAM arena: madvise failed (%s)",
                    ctypes.get_errno(),
                )
                return
            self.populated_bytes = offset + length
        log.info(
            "DRAM arena prefaulted: %.0f MiB in %.1f s",
            self._nbytes / 2**20,
            time.perf_counter() - started,
        )


def _madvise() -> ctypes._FuncPointer | None:
    """libc's ``madvise``, typed; ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function

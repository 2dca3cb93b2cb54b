"""The DRAM tier's shared-memory segments on the host: room for them, and their leftovers.

Two ways a segment in ``/dev/shm`` (a tmpfs) goes wrong, both outside Python:

* **Too little room.** A segment is sparse: creating one larger than the
  tmpfs succeeds, and the first write to a page the tmpfs cannot back kills
  the process with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB; the
  DRAM tier's default is 2 GiB). So a segment is sized to what the tmpfs has
  free before it is created (``fit``), and its pages are then allocated at
  once (``posix_fallocate``): a shortfall is an error at start, never a
  signal later, and another process filling ``/dev/shm`` afterwards cannot
  take pages this one counts on.
* **Leftovers.** A segment is unlinked by its process when the store closes,
  or by Python's resource tracker when the process dies. ``kill -9`` of the
  whole process group (``systemctl kill``) takes the tracker too, and the
  segment stays until reboot, holding its memory. So each process holds a
  shared ``flock`` on every segment it created, for the segment's life, and a
  new store removes every ``kvstore-<pid>-*`` segment whose creator is gone:
  its pid is dead and nobody holds the lock (the lock covers a creator in
  another pid namespace, whose pid means nothing here).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from pathlib import Path

from kvstore.errors import TierUnavailable
from kvstore.kinds import TierKind

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "kvstore-"
_OWNED = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")
# What ``fit`` leaves free in the tmpfs for everyone else (other segments, clients):
# an eighth of what is free, at most this.
HEADROOM_BYTES = 16 << 20
# Below this a DRAM tier is not worth running (``DRAMTier`` refuses to start).
MIN_SEGMENT_BYTES = 1 << 20
_NAME = TierKind.DRAM.label


def free_bytes(directory: Path = SHM_DIR) -> int | None:
    """Bytes free in the shared-memory filesystem, or ``None`` where there is none
    to ask (not Linux)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def fit(nbytes: int, directory: Path = SHM_DIR) -> int:
    """The segment size to create for ``nbytes`` wanted: ``nbytes`` when the tmpfs has
    room for it, else what it has less some headroom (with a warning)."""
    free = free_bytes(directory)
    if free is None:
        return nbytes
    room = free - min(HEADROOM_BYTES, free // 8)
    if nbytes <= room:
        return nbytes
    fitted = max(0, room)
    logger.warning(
        "the DRAM tier wants %d MiB of shared memory but %s has %d MiB free: sizing it "
        "down to %d MiB (give the container more, e.g. docker run --shm-size, or lower "
        "the DRAM tier's capacity)",
        nbytes >> 20,
        directory,
        free >> 20,
        fitted >> 20,
    )
    return fitted


def hold(name: str, nbytes: int, directory: Path = SHM_DIR) -> int | None:
    """Allocate every page of segment ``name`` now and take the shared lock that marks
    its creator alive; the descriptor to keep open for the segment's life (``None``
    where segments are not files in ``directory``)."""
    path = directory / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        raise TierUnavailable(
            _NAME,
            f"cannot allocate {nbytes >> 20} MiB of shared memory in {directory} ({exc}); "
            "give it more room or lower the DRAM tier's capacity",
        ) from exc
    return fd


def creator_pid(name: str) -> int | None:
    """The pid a ``kvstore-<pid>-<hex>`` segment name says created it (``None``: not
    one of ours)."""
    match = _OWNED.match(name)
    return int(match.group(1)) if match else None


def reap_stale(directory: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of dead kvstore processes; their names."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    reaped = []
    for name in names:
        pid = creator_pid(name)
        if pid is None or _alive(pid):
            continue
        if _unlink_if_unheld(directory / name):
            reaped.append(name)
    if reaped:
        logger.warning(
            "removed %d shared-memory segment(s) left by dead kvstore processes: %s",
            len(reaped),
            ", ".join(reaped),
        )
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _unlink_if_unheld(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live creator holds it
    else:
        try:
            path.unlink()
        except OSError:
            return False
        return True
    finally:
        os.close(fd)

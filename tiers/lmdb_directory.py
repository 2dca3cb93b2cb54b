"""The directory an LMDB tier owns: one process at a time, damage moved aside, room
on its disk.

* **One owner.** LMDB itself lets many processes share an environment, but a
  tier's accounting and eviction assume they are its only writer: a daemon and
  an embedded store on the same directory would each evict blocks the other
  counts, and neither would say so. An exclusive ``flock`` on
  ``kvstore.lock`` in the directory (released by the kernel when its holder
  dies, so never stale) makes the second opener fail at once, naming the first.
* **Damage.** A torn or overwritten meta page makes ``mdb_env_open`` fail with
  ``MDB_INVALID`` on every start; a damaged tree fails the first full read. For
  a cache, losing its contents is cheap and not starting is not: the directory
  is renamed to ``<name>.corrupt-<time>`` (kept for a post-mortem, logged) and
  the tier starts empty.
* **Room.** A capacity larger than the map, or than the disk has free, is
  accepted but warned about at start: writes past it are refused (the store
  then keeps their blocks in the tier above, ``kvstore.store.placement``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from pathlib import Path

from kvstore.errors import TierUnavailable
from kvstore.kinds import TierKind

logger = logging.getLogger(__name__)

LOCK_FILE = "kvstore.lock"
_NAME = TierKind.SSD.label


def claim(path: Path) -> int:
    """Create ``path`` if needed and take its lock; the descriptor to keep open while
    the tier is. ``TierUnavailable`` if another process holds it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise TierUnavailable(_NAME, f"cannot use {path} for LMDB: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierUnavailable(
            _NAME,
            f"{path} is open in another kvstore process (pid {holder}); a daemon and an "
            "embedded store must not share an LMDB directory: give one of them its own "
            "data_dir, or reach the daemon through the client",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing drops the flock


def move_aside(path: Path, why: BaseException) -> Path:
    """Rename the damaged environment at ``path`` out of the way; where it went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{suffix}")
    path.rename(target)
    logger.error(
        "the LMDB environment at %s is damaged (%s): moved it to %s and starting empty",
        path,
        why,
        target,
    )
    return target


def warn_about_room(path: Path, capacity_bytes: int, map_size: int) -> None:
    """Warn when ``capacity_bytes`` is more than the map or the disk can hold."""
    if map_size < capacity_bytes:
        logger.warning(
            "LMDB at %s: map_size (%d MiB) is below the tier's capacity (%d MiB); the tier "
            "will be full at the map size",
            path,
            map_size >> 20,
            capacity_bytes >> 20,
        )
    try:
        free = shutil.disk_usage(path).free
        held = (path / "data.mdb").stat().st_size if (path / "data.mdb").exists() else 0
    except OSError:
        return
    if free + held < capacity_bytes:
        logger.warning(
            "LMDB at %s: the tier's capacity is %d MiB but its disk has %d MiB free; "
            "writes past that are refused, and their blocks stay in the tier above",
            path,
            capacity_bytes >> 20,
            free >> 20,
        )

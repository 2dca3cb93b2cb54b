"""The SSD tier: encoded blocks in one LMDB environment.

Why LMDB: a copy-on-write B+tree in one memory-mapped file. A committed
transaction is never half applied, there is no recovery step after a crash
(the last good meta page simply wins), readers never block the writer, and a
read can hand out a pointer into the map instead of a copy.

How this tier uses it, and why:

* **One environment, one database.** All namespaces share the main database
  (``max_dbs=0``); the LMDB key is ``namespace digest (16) || chunk key (16)``,
  so namespaces are scoped without named databases, and the key order groups
  a namespace's blocks together. LMDB forbids opening one environment twice in
  a process (py-lmdb raises), so a process holds exactly one ``LMDBTier`` per
  path.
* **One transaction per batch.** ``put_many`` and ``delete_many`` run in one
  write transaction: a batch of a prefix's chunks costs one commit (one fsync
  with ``sync=True``), and a batch is visible all at once or not at all, also
  after ``kill -9`` mid-write. LMDB has one writer at a time, so concurrent
  writers queue on the environment's write lock; readers never wait.
* **Zero-copy reads, copied out inside the transaction.** Reads use
  ``buffers=True``: values come back as memoryviews into the map, and
  ``get_many`` copies each into an owned numpy buffer before the transaction
  ends. py-lmdb does not release those memoryviews when the transaction ends:
  they stay readable but point at pages LMDB may reuse for a later write, or
  unmap on close, so one must never escape. ``contains_many``, ``scan`` and the
  accounting read only lengths and headers, and never copy a payload.
* **The map grows before it is full.** The map size is LMDB's hard wall, and
  what the file holds besides the values depends on their size: blocks of a
  few KiB cost a page or two of tree each, so a store kept under its capacity
  can still fill a map sized for the values. ``MapFullError`` aborts the whole
  batch (nothing of it visible); a map the tier sized itself is then doubled
  (LMDB resizes only with no transaction open in the process, so new calls wait
  for the ones in flight) and the batch runs again, up to
  ``_MAP_GROWTH_LIMIT`` times the size it opened with. An operator's
  ``map_size`` is a wall: a write past it is ``TierFull``, so the store evicts
  and retries, and the environment stays usable. A delete needs pages too
  (copy-on-write): at the wall a batch of them goes in halves, down to one key
  a transaction, which always goes through, so eviction can always make room.
  A full disk (``DiskError``, or EIO from a write that came up short with the
  disk out of room) aborts the batch the same way and becomes ``TierRefused``:
  the store keeps what it wanted to write elsewhere, and reads go on.
* **One owner, damage moved aside** (``tiers.lmdb_directory``). A second
  kvstore process opening the directory fails at once; an environment LMDB
  cannot open or read is renamed out of the way and the tier starts empty.
* **Stale readers are reaped at open.** A process killed inside a read
  transaction leaves its slot in the shared reader table; LMDB then keeps every
  page that reader could see, so freed pages are never reused and the file
  grows to the map size. ``reader_check`` at open clears the slots of dead
  processes.
* **Durability.** With ``sync=True`` (default) a committed transaction is on
  disk when ``put_many`` returns and survives a process or OS crash.
  ``sync=False`` skips the fsync: a process crash still loses nothing
  committed, but an OS crash or power loss may undo the last transactions
  (the data stays consistent, as ``writemap`` is off). For a cache that is
  usually the right trade; the default is the safe one.

Accounting: ``used_bytes`` is the sum of the stored value lengths. It is one
counter, not a per-key map: a write transaction looks up the length of the
value it replaces or deletes (a memoryview, so no copy and no payload read)
and the net change is added after the commit. It is computed from the data at
open, so it survives restarts, and it is this process's view: another process
writing the same environment is not counted until the next open.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb
import numpy as np

from kvstore.block import HEADER_BYTES, Block
from kvstore.errors import TierFull, TierRefused, TierUnavailable
from kvstore.keys import KEY_BYTES, ChunkKey
from kvstore.kinds import TierKind
from kvstore.tiers import lmdb_directory
from kvstore.tiers.base import BlockDestination, Buffer, StoredBlockInfo, scatter

_T = TypeVar("_T")
logger = logging.getLogger(__name__)

_NAME = TierKind.SSD.label
_MIB = 1 << 20
# What a damaged environment raises: a bad meta page, a broken tree, a foreign file.
_DAMAGED = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
)
# Headroom for what LMDB stores besides the values: branch and leaf pages,
# overflow pages rounded up to whole pages, the free list, and the pages that
# copy-on-write keeps alive while a reader still sees them.
_MAP_OVERHEAD_RATIO = 1.25
_MAP_OVERHEAD_FIXED = 64 * _MIB
# How far a map the tier sized itself may grow: a value of 2 KiB takes a 4 KiB
# page of its own and a place in the tree, and copy-on-write keeps more pages
# while a batch commits (a tier of 2 KiB stand-ins grew to 3.5 times its
# capacity in the tests). Beyond 8 times something else fills the map.
_MAP_GROWTH_LIMIT = 8
# Free space below which an I/O error on a write means the disk is full: what is
# left when a commit's pages no longer fit.
_FULL_DISK_BYTES = 16 * _MIB
# Entries per read transaction in ``scan``: a slow consumer of the iterator
# must not pin a snapshot (a long-lived reader stops LMDB reusing pages).
_SCAN_PAGE = 1024


def default_map_size(capacity_bytes: int) -> int:
    """The map size for a tier that may hold ``capacity_bytes`` of values.

    The store evicts to keep the values under capacity, but the file holds
    more than the values (see ``_MAP_OVERHEAD_RATIO``); a map sized to the
    capacity alone would turn a store that is merely full into ``TierFull``
    errors. The map is only address space until written, so headroom is free.
    """
    return int(capacity_bytes * _MAP_OVERHEAD_RATIO) + _MAP_OVERHEAD_FIXED


class LMDBTier:
    """A ``Tier`` over one LMDB environment at ``path`` (a directory).

    Thread safe: any number of threads may call any method. ``_lock`` guards
    ``_env`` (``None`` once closed), ``_used`` and ``_active`` (calls in
    flight); ``close`` waits for calls in flight, because a call may be copying
    out of the map that closing unmaps.

    ``stale_readers_cleared`` is how many reader slots of dead processes the
    open reaped (also logged), for metrics.
    """

    kind = TierKind.SSD
    # Bytes read from a file cross a trust boundary (disk rot, another writer).
    verifies_reads = True

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        *,
        map_size: int | None = None,
        sync: bool = True,
        max_readers: int = 126,
    ) -> None:
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._resizing = False
        path = self._path = Path(path)
        if map_size is None:  # the tier's own guess, so it may grow (module docstring)
            map_size = default_map_size(capacity_bytes)
            self._map_limit = map_size * _MAP_GROWTH_LIMIT
        else:
            self._map_limit = map_size
        self._claim = lmdb_directory.claim(path)
        try:
            env = self._open(path, map_size, sync, max_readers)
        except _DAMAGED as exc:  # a cache starts empty rather than not at all
            lmdb_directory.release(self._claim)
            lmdb_directory.move_aside(path, exc)
            self._claim = lmdb_directory.claim(path)
            env = self._open(path, map_size, sync, max_readers)
        except BaseException:
            lmdb_directory.release(self._claim)
            raise
        lmdb_directory.warn_about_room(path, capacity_bytes, map_size)
        if self.stale_readers_cleared:
            logger.warning("cleared %d stale LMDB readers at %s", self.stale_readers_cleared, path)
        self._env: lmdb.Environment | None = env

    def _open(self, path: Path, map_size: int, sync: bool, max_readers: int) -> lmdb.Environment:
        """Open the environment and read its accounting; ``_DAMAGED`` errors propagate
        as they are (the caller moves the directory aside), others as ``TierUnavailable``."""
        try:
            env = lmdb.open(
                str(path),
                map_size=map_size,
                subdir=True,
                sync=sync,
                # Blocks are read at random and are large; readahead would
                # fill the page cache with neighbours nobody asked for.
                readahead=False,
                # Skip zeroing the unused tail of pages before writing them.
                meminit=False,
                lock=True,
                max_readers=max_readers,
                max_dbs=0,
            )
        except _DAMAGED:
            raise
        except (lmdb.Error, OSError) as exc:
            raise TierUnavailable(_NAME, f"cannot open LMDB at {path}: {exc}") from exc
        try:
            # A process killed inside a read transaction keeps its reader slot,
            # and with it every page it could see. LMDB resets the table only
            # when the opener is the sole user of the lock file; when another
            # process (a daemon, a sibling worker) keeps it open, only this
            # call frees the slots of dead processes.
            self.stale_readers_cleared: int = env.reader_check()
            self._used = _sum_value_lengths(env)
        except _DAMAGED:
            env.close()
            raise
        except lmdb.Error as exc:
            env.close()
            raise TierUnavailable(_NAME, f"cannot read LMDB at {path}: {exc}") from exc
        return env

    def put_many(self, namespace: bytes, items: Sequence[tuple[ChunkKey, Block]]) -> None:
        lkeys = [_lmdb_key(namespace, key) for key, _ in items]
        if not lkeys:
            with self._session():
                return

        def put(txn: lmdb.Transaction) -> int:
            delta = 0
            for lkey, (_, block) in zip(lkeys, items, strict=True):
                # Joined one at a time: a batch never exists twice in memory.
                value = block.to_bytes()
                old = txn.get(lkey)
                delta += len(value) - (len(old) if old is not None else 0)
                txn.put(lkey, value)
            return delta

        self._add_used(self._write(put))

    def get_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        lkeys = [_lmdb_key(namespace, key) for key in keys]
        with self._session() as env, env.begin(buffers=True) as txn:
            found: list[Buffer | None] = []
            for lkey in lkeys:
                view = txn.get(lkey)
                # The copy must happen now: the view dies with the transaction.
                found.append(_owned_copy(view) if view is not None else None)
            return found

    def get_many_into(
        self,
        namespace: bytes,
        keys: Sequence[ChunkKey],
        destinations: Sequence[BlockDestination],
    ) -> list[bool]:
        """Like ``get_many``, but straight from the map into the caller's buffers."""
        lkeys = [_lmdb_key(namespace, key) for key in keys]
        with self._session() as env, env.begin(buffers=True) as txn:
            copied: list[bool] = []
            for lkey, destination in zip(lkeys, destinations, strict=True):
                view = txn.get(lkey)
                copied.append(view is not None and scatter(view, destination))
            return copied

    def contains_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[bool]:
        lkeys = [_lmdb_key(namespace, key) for key in keys]
        with self._session() as env, env.begin(buffers=True) as txn:
            return [txn.get(lkey) is not None for lkey in lkeys]

    def delete_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> int:
        return self._delete([_lmdb_key(namespace, key) for key in keys])

    def _delete(self, lkeys: list[bytes]) -> int:
        """Delete ``lkeys`` in one transaction, or in halves where the map is too full
        for it: a delete writes pages too, and each committed one frees pages the next
        reuses, so one key at a time always goes through a map at its limit."""

        def delete(txn: lmdb.Transaction) -> tuple[int, int]:
            deleted = freed = 0
            for lkey in lkeys:
                old = txn.get(lkey)
                if old is not None:
                    freed += len(old)
                    txn.delete(lkey)
                    deleted += 1
            return deleted, freed

        try:
            deleted, freed = self._write(delete)
        except TierFull as exc:
            if len(lkeys) == 1:
                raise TierRefused(_NAME, str(exc)) from exc
            half = len(lkeys) // 2
            return self._delete(lkeys[:half]) + self._delete(lkeys[half:])
        self._add_used(-freed)
        return deleted

    def scan(self) -> Iterator[StoredBlockInfo]:
        """Every stored block, in key order (so grouped by namespace).

        Reads pages of ``_SCAN_PAGE`` entries, each in its own short read
        transaction, so the caller may take its time between items. The scan is
        therefore not one snapshot: a block written or deleted meanwhile may or
        may not be reported, which an index rebuild at startup tolerates.
        """
        after: bytes | None = None
        while True:
            page = self._scan_page(after)
            yield from page
            if len(page) < _SCAN_PAGE:
                return
            after = page[-1].namespace + page[-1].key

    def used_bytes(self) -> int:
        with self._session():
            return self._used

    def capacity_bytes(self) -> int:
        return self._capacity

    def close(self) -> None:
        with self._lock:
            env, self._env = self._env, None
            while self._active:
                self._idle.wait()
        if env is not None:
            env.close()
            lmdb_directory.release(self._claim)

    def _scan_page(self, after: bytes | None) -> list[StoredBlockInfo]:
        with self._session() as env, env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            # Keys are all 2 * KEY_BYTES long, so ``after + b"\0"`` is the
            # smallest key past ``after``.
            positioned = cursor.first() if after is None else cursor.set_range(after + b"\0")
            page: list[StoredBlockInfo] = []
            while positioned and len(page) < _SCAN_PAGE:
                lkey, value = cursor.item()
                page.append(
                    StoredBlockInfo(
                        namespace=bytes(lkey[:KEY_BYTES]),
                        key=ChunkKey(lkey[KEY_BYTES:]),
                        nbytes=len(value),
                        header=bytes(value[:HEADER_BYTES]),
                    )
                )
                positioned = cursor.next()
            return page

    def _add_used(self, delta: int) -> None:
        with self._lock:
            self._used += delta

    def _write(self, apply: Callable[[lmdb.Transaction], _T]) -> _T:
        """``apply`` in one write transaction; while the map is full and may grow, grow
        it and run the whole transaction again; ``TierFull`` at its limit."""
        while True:
            with self._session() as env:
                try:
                    with env.begin(write=True, buffers=True) as txn:
                        return apply(txn)
                except lmdb.MapFullError as exc:
                    seen, error = env.info()["map_size"], exc
            if not self._grow(seen):
                raise TierFull(_NAME, f"LMDB map is full at {seen >> 20} MiB ({error})")

    def _grow(self, seen: int) -> bool:
        """Double the map that was ``seen`` full, up to its limit; ``False`` at the limit.

        LMDB changes the map size only while the process has no transaction open: new
        calls wait (``_session``) until the calls in flight are done. A writer that
        found the map full while another grew it just runs again."""
        with self._lock:
            env = self._open_env()
            current = env.info()["map_size"]
            if current > seen:
                return True
            if current >= self._map_limit:
                return False
            size = min(2 * current, self._map_limit)
            self._resizing = True
            try:
                while self._active:
                    self._idle.wait()
                if self._env is not env:
                    raise TierUnavailable(_NAME, "tier is closed")
                env.set_mapsize(size)
            except lmdb.Error as exc:
                raise TierUnavailable(_NAME, f"cannot grow the LMDB map: {exc}") from exc
            finally:
                self._resizing = False
                self._idle.notify_all()
        logger.info("LMDB map grown from %d to %d MiB", current >> 20, size >> 20)
        return True

    def _disk_is_full(self) -> bool:
        """Whether the disk under the environment is out of room. LMDB reports a write
        that came up short as EIO, which is how a disk that fills mid-commit answers."""
        try:
            return shutil.disk_usage(self._path).free < _FULL_DISK_BYTES
        except OSError:
            return False

    def _open_env(self) -> lmdb.Environment:
        """The open environment once no resize is under way; under ``_lock``."""
        while self._resizing:
            self._idle.wait()
        if self._env is None:
            raise TierUnavailable(_NAME, "tier is closed")
        return self._env

    @contextmanager
    def _session(self) -> Iterator[lmdb.Environment]:
        """The open environment for one call; translates LMDB errors at this boundary."""
        with self._lock:
            env = self._open_env()
            self._active += 1
        try:
            yield env
        except lmdb.DiskError as exc:  # the disk is full: reads still work
            raise TierRefused(_NAME, f"LMDB could not write: {exc}") from exc
        except lmdb.Error as exc:
            if exc.code == errno.EIO and self._disk_is_full():
                raise TierRefused(_NAME, f"LMDB could not write, disk full: {exc}") from exc
            raise TierUnavailable(_NAME, f"LMDB error: {exc}") from exc
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()


def _lmdb_key(namespace: bytes, key: ChunkKey) -> bytes:
    if len(namespace) != KEY_BYTES or len(key) != KEY_BYTES:
        raise ValueError(
            f"namespace digest and chunk key must be {KEY_BYTES} bytes each, "
            f"got {len(namespace)} and {len(key)}"
        )
    return namespace + key


def _sum_value_lengths(env: lmdb.Environment) -> int:
    """Total length of the stored values; reads leaf pages only, never a payload."""
    with env.begin(buffers=True) as txn:
        return sum(len(value) for value in txn.cursor().iternext(keys=False, values=True))


def _owned_copy(view: memoryview) -> memoryview:
    """Copy a value out of the map. numpy's copy releases the GIL (``bytearray``'s
    does not), so the store can checksum the previous value on another thread."""
    out = np.empty(view.nbytes, dtype=np.uint8)
    np.copyto(out, np.frombuffer(view, dtype=np.uint8))
    return out.data

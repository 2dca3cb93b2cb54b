"""A put's blocks received straight into the store: each block written once, where it
will stay, and verified as it lands; published only once the whole put verified.

One path for every block, whatever it lands in::

    a block's header ──► parses, length agrees? ──► where it lands:
      (read off the                                  a Reservation of the DRAM
       socket first)                                 arena (serving.reserve:
                                                     evicts as a put would), or,
                                                     with none to be had, a
                                                     buffer of its own
                                                          │
         ``receive``: the payload is read from the socket into it (``fill``),
         each step checksummed right after it landed (block.fill_verified; or
         block.fill_sealed, which computes the checksum of a block sent
         without one in its header: kvstore.wire.Seal), then key, namespace,
         layout, one chunk and a payload that decodes are checked
                                                          │
                                        bad? ─yes─► its reservation aborted, raise
                                                          │
                                                          ▼
                      kept, unpublished, until the whole put verified ─► serving.put_landed
                      publishes the reserved ones and stores the others (or ``abort``
                      gives every reservation back)

Who owns a reservation, and when its block becomes visible:

* From ``serving.reserve`` until the put ends, the ``Landing`` owns it: it
  counts against DRAM's capacity, no reader can find it (it is in no index)
  and no eviction can take it (eviction only takes indexed blocks).
* ``commit`` hands every reservation to ``serving.put_landed``, which publishes
  each (tier index, then store index) or gives it back if its key is held
  already: a block becomes visible only after every block of the put passed.
* ``abort`` (a block failed, the body was cut off, the client went away) gives
  every reservation back. A thread still writing into one when the put is
  aborted gives that one back itself when it finishes, never before: the space
  cannot be handed to anyone else while it is being written.
* Reserving may evict, before the block is verified, but only by demoting
  (``Placement.reserve``): a put that then fails may have moved others' blocks
  down a tier, never dropped one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.block import (
    HEADER_BYTES,
    Block,
    check_identity,
    check_payload_size,
    check_trailer,
    fill_sealed,
    fill_verified,
    parse_header,
    stored_block,
)
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch, PutAborted
from kvstore.keys import ChunkKey, Namespace
from kvstore.store.reservation import Filled, Reservation
from kvstore.store.shared import SharedServing
from kvstore.wire.frames import Seal


class Landing:
    """The blocks of one put being received; see the module docstring.

    ``land`` runs on worker threads (several may run at once); ``commit`` and
    ``abort`` run once every ``land`` call has returned or been given up on.
    """

    def __init__(
        self, serving: SharedServing, namespace: Namespace, keys: Sequence[ChunkKey]
    ) -> None:
        self._serving = serving
        self._namespace = namespace
        self._protect = frozenset(keys)
        self._lock = threading.Lock()  # guards the three fields below
        self._landed: list[Reservation] = []  # written and verified, not yet published
        self._writing: set[Reservation] = set()
        self._done = False  # committed or aborted: nothing more may land

    def land(
        self,
        index: int,
        key: ChunkKey,
        parent: ChunkKey | None,
        header_bytes: bytes,
        nbytes: int,
        fill: Callable[[memoryview], None],
        *,
        seal: Seal = Seal.HEADER,
        read_trailer: Callable[[], bytes] | None = None,
    ) -> Block | Filled:
        """Land block ``index`` (``nbytes`` in all, header ``header_bytes``): in a
        reservation of the DRAM arena (``Filled``), or in a buffer of its own
        (``Block``) when none is to be had, ``fill`` writing its payload there step
        by step (a socket read); see ``receive`` for ``seal`` and ``read_trailer``.
        Raises ``CorruptBlock``/``LayoutMismatch`` for a bad block (its reservation
        given back) and ``PutAborted`` once the put is over."""
        if self._done:  # do not evict for a put that already failed
            raise PutAborted("the put ended before this block landed")
        try:
            header = parse_header(header_bytes)
            check_payload_size(header, nbytes - HEADER_BYTES)
        except CorruptBlock as error:
            raise CorruptBlock(f"block {index}: {error}") from None
        reservation = self._serving.reserve(nbytes, header.codec, self._protect)
        if reservation is None:
            # np.empty: not zero-filled first (MiB-sized bytearrays measured ~2.5x slower).
            data = np.empty(nbytes, dtype=np.uint8).data
            self._receive(index, key, header_bytes, data, fill, seal, read_trailer)
            return stored_block(data)
        with self._lock:
            if self._done:
                reservation.abort()
                raise PutAborted("the put ended before this block landed")
            self._writing.add(reservation)
        verified = False
        try:
            self._receive(index, key, header_bytes, reservation.view(), fill, seal, read_trailer)
            verified = True
        finally:
            with self._lock:
                self._writing.discard(reservation)
                keep = verified and not self._done
                if keep:
                    self._landed.append(reservation)
            if not keep:
                reservation.abort()
        if not keep:
            raise PutAborted("the put ended while this block was landing")
        return Filled(key, parent, reservation)

    def _receive(
        self,
        index: int,
        key: ChunkKey,
        header_bytes: bytes,
        target: memoryview,
        fill: Callable[[memoryview], None],
        seal: Seal,
        read_trailer: Callable[[], bytes] | None,
    ) -> None:
        try:
            receive(self._namespace, key, header_bytes, target, fill, seal, read_trailer)
        except (CorruptBlock, LayoutMismatch) as error:
            raise type(error)(f"block {index}: {error}") from None

    def commit(
        self,
        keys: Sequence[ChunkKey],
        blocks: Sequence[Block | Filled | None],
        session: str | None,
    ) -> int:
        """Store the verified put: publish its landed blocks, admit the others."""
        with self._lock:
            assert not self._writing, "commit only after every land returned"
            self._done = True
            self._landed = []
        return self._serving.put_landed(self._namespace, keys, blocks, session=session)

    def abort(self) -> None:
        """Give back every landed reservation (those still being written go back when
        their copy ends). Idempotent; a no-op after ``commit``."""
        with self._lock:
            self._done = True
            landed, self._landed = self._landed, []
        if landed:
            self._serving.give_back(landed)


def receive(
    namespace: Namespace,
    key: ChunkKey,
    header_bytes: bytes,
    target: memoryview,
    fill: Callable[[memoryview], None],
    seal: Seal = Seal.HEADER,
    read_trailer: Callable[[], bytes] | None = None,
) -> None:
    """Write a received block into ``target`` (its header, then its payload as ``fill``
    reads it) and check it: the one verification every block a daemon receives passes.

    Each step of the payload is checksummed as it lands, against the header's
    checksum (``Seal.HEADER``); with another ``seal``, into the header stored
    (``block.fill_sealed``), checked against the checksum ``read_trailer`` reads
    after the payload for ``Seal.TRAILER``. Then its key, namespace and layout,
    that it holds one whole chunk, and that its payload decodes.
    """
    target[:HEADER_BYTES] = header_bytes
    payload = target[HEADER_BYTES:]
    if seal is Seal.HEADER:
        header = fill_verified(header_bytes, payload, fill)
    else:
        header, sealed = fill_sealed(header_bytes, payload, fill)
        if seal is Seal.TRAILER:
            assert read_trailer is not None, "a trailer-sealed block has a trailer"
            check_trailer(sealed, read_trailer(), key)
        target[:HEADER_BYTES] = sealed
    check_identity(header, namespace, key, whole_chunk=True)
    decode_payload(payload, header.dtype, header.codec, header.raw_len)

"""A put's blocks received straight into the DRAM arena, published only once the
whole put verified.

::

    a block's header ──► parses, length agrees? ──► reserve an extent
      (read off the                                  (serving.reserve_dram:
       socket first)                                  evicts as a put would)
                                                          │ none: the caller
                                                          │ receives it the usual way
                                                          ▼
         the payload is read from the socket into the extent (``fill``), each
         step checksummed right after it landed (block.fill_verified; or
         block.fill_sealed, which computes the checksum of a block sent
         without one in its header: kvstore.wire.Seal): the kernel's copy is
         the only copy
                                                          │
                      checksum, key, namespace, layout ok? ─no─► give the extent back, raise
                                                          │
                                                          ▼
                      kept, unpublished, until the whole put verified ─► serving.put_landed
                      publishes it (or ``abort`` gives every extent back)

Who owns a reserved extent, and when it becomes visible:

* From ``serving.reserve_dram`` until the put ends, the ``Landing`` owns it:
  the extent counts against DRAM's capacity, no reader can find it (it is in
  no index) and no eviction can take it (eviction only takes indexed blocks).
* ``commit`` hands every extent to ``serving.put_landed``, which publishes each
  (tier index, then store index) or gives it back if its key is held already:
  a block becomes visible only after every block of the put passed.
* ``abort`` (a block failed, the body was cut off, the client went away) gives
  every extent back. A thread still writing into an extent when the put is
  aborted gives that one back itself when it finishes, never before: the extent
  cannot be handed to anyone else while it is being written.
* Reserving may evict, before the block is verified, but only by demoting
  (``Placement.reserve``): a put that then fails may have moved others' blocks
  down a tier, never dropped one.
* The arena is in-process shared memory and the index lives in memory, so a
  daemon killed mid-put leaves nothing of it anywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvstore.block import (
    HEADER_BYTES,
    Block,
    BlockHeader,
    check_identity,
    check_payload_size,
    check_trailer,
    fill_sealed,
    fill_verified,
    parse_header,
)
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch, PutAborted
from kvstore.keys import ChunkKey, Namespace
from kvstore.server.serving import SharedServing
from kvstore.store.placement import Reserved
from kvstore.wire.frames import Seal


class Landing:
    """The reserved DRAM extents of one put being received; see the module docstring.

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
        self._landed: list[int] = []  # offsets written and verified, not yet published
        self._writing: set[int] = set()
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
    ) -> Reserved | None:
        """Land block ``index`` (``nbytes`` in all, header ``header_bytes``) in a
        reserved extent: ``fill`` writes its payload there step by step (a socket
        read) and each step is checksummed as it lands, against the header's
        checksum; with another ``seal``, into the header stored
        (``block.fill_sealed``), against the checksum ``read_trailer`` reads after
        the payload for ``Seal.TRAILER``. ``None`` if no extent was
        to be had (nothing was read: the caller receives it the usual way).
        Raises ``CorruptBlock``/``LayoutMismatch`` for a bad block (its extent
        given back) and ``PutAborted`` once the put is over."""
        if self._done:  # do not evict for a put that already failed
            raise PutAborted("the put ended before this block landed")
        try:
            header = parse_header(header_bytes)
            check_payload_size(header, nbytes - HEADER_BYTES)
        except CorruptBlock as error:
            raise CorruptBlock(f"block {index}: {error}") from None
        offset = self._serving.reserve_dram(nbytes, header.codec, self._protect)
        if offset is None:
            return None
        with self._lock:
            if self._done:
                self._serving.unreserve_dram([offset])
                raise PutAborted("the put ended before this block landed")
            self._writing.add(offset)
        verified = False
        try:
            target = self._serving.dram_writable(offset, nbytes)
            target[:HEADER_BYTES] = header_bytes
            if seal is Seal.HEADER:
                fill_verified(header_bytes, target[HEADER_BYTES:], fill)
            else:
                _, sealed = fill_sealed(header_bytes, target[HEADER_BYTES:], fill)
                if seal is Seal.TRAILER:
                    assert read_trailer is not None, "a trailer-sealed block has a trailer"
                    check_trailer(sealed, read_trailer(), key)
                target[:HEADER_BYTES] = sealed
            check_received(header, self._namespace, key, target[HEADER_BYTES:])
            verified = True
        except (CorruptBlock, LayoutMismatch) as error:
            raise type(error)(f"block {index}: {error}") from None
        finally:
            with self._lock:
                self._writing.discard(offset)
                keep = verified and not self._done
                if keep:
                    self._landed.append(offset)
            if not keep:
                self._serving.unreserve_dram([offset])
        if not keep:
            raise PutAborted("the put ended while this block was landing")
        return Reserved(key, parent, offset, nbytes)

    def commit(
        self,
        keys: Sequence[ChunkKey],
        blocks: Sequence[Block | Reserved | None],
        session: str | None,
    ) -> int:
        """Store the verified put: publish its landed blocks, admit the others."""
        with self._lock:
            assert not self._writing, "commit only after every land returned"
            self._done = True
            self._landed = []
        return self._serving.put_landed(self._namespace, keys, blocks, session=session)

    def abort(self) -> None:
        """Give back every landed extent (those still being written go back when
        their copy ends). Idempotent; a no-op after ``commit``."""
        with self._lock:
            self._done = True
            landed, self._landed = self._landed, []
        if landed:
            self._serving.unreserve_dram(landed)


def check_received(
    header: BlockHeader, namespace: Namespace, key: ChunkKey, payload: memoryview
) -> None:
    """What the daemon checks of every block it receives besides its checksum, landed
    or not: key, namespace, layout, one chunk, a payload that decodes."""
    check_identity(header, namespace, key, whole_chunk=True)
    decode_payload(payload, header.dtype, header.codec, header.raw_len)

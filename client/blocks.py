"""Blocks arriving from the daemon: verified before the caller sees a byte of them.

The socket and the shared arena are trust boundaries, exactly like a read
from LMDB: every block is checked against its checksum (header and payload),
and against the key, namespace and layout that were asked for. A block that
fails any check is a miss, counted as corrupt, and never returned; a wrong
block would silently corrupt a generation, while a miss only costs a
recompute.

Two sources, one check (``chunk_of``), and each payload copied once, into
its final buffer: the caller's ``out`` buffer when the block is raw KV of
that size, else one of the client's ``BufferPool`` (decoded into ``out``
from there, if given):

* ``FramesSink`` takes a ``"bytes"`` get's frames body as it streams in
  (``kvstore.wire.FrameDecoder`` in its one-copy mode, so no body is ever
  buffered), then verifies each block once it is complete: on a worker
  thread when it is given one, so block ``i`` is checksummed while block
  ``i+1`` is read off the socket (xxhash releases the GIL), as
  ``kvstore.reader`` overlaps LMDB reads; ``finish`` waits for the last.
* ``copy_leased`` copies the blocks a ``"shm"`` lease points at out of the
  read-only mapping (``client.shm``), checked as ``Verify`` says. A large
  batch is split with a helper thread: copy and checksum release the GIL,
  and with a core to spare two threads moved 1.3-1.4x the bytes of one.

How a shared-memory copy is checked (``Verify``)::

    FULL  header + payload checksummed as they are copied (copy_verified):
          the copy is what the daemon verified when it was put, whatever
          happened in shared memory; costs an xxh3 pass over every byte
    FAST  header parsed; payload copied (copy_unverified); then the extent's
          generation must still be the one the lease reported, else the
          copy is checksummed after all (FULL, on the copy)

Why FAST still never serves a wrong block: the hazards of this path are the
extent being freed and rewritten while the client reads it (a lease that
expired, a delete that ignores pins, a daemon bug). The daemon verified the
block's checksum when it was put (the DRAM tier holds only verified blocks),
and bumps the extent's generation whenever it frees the extent, before the
extent can be handed out again (``kvstore.tiers.arena_tier``). The lease
carries the generation read together with the extent. If the counter still
reads the same after the copy, the extent was not freed since the lease was
granted, so no byte of it was rewritten: the header and payload copied are
the verified block (counters only grow: no ABA). This needs the copy's loads
to be ordered before the counter's load, which x86-64 guarantees; elsewhere
the default is FULL. What FAST does not catch is memory that rots in DRAM
after the put: the daemon's background scrub re-checks the DRAM tier's
checksums for that, as for the embedded store, whose DRAM reads are not
re-checksummed either.

With ``out`` buffers the returned ``KVChunk`` is a view of the caller's
buffer, as with ``TieredStore.get(out=)``; a missed block leaves its buffer
with unspecified contents.
"""

from __future__ import annotations

import contextlib
import enum
import platform
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from kvstore.block import (
    HEADER_BYTES,
    BlockHeader,
    Codec,
    check_identity,
    copy_unverified,
    copy_verified,
    parse_header,
    verify_parts,
)
from kvstore.chunk import KVChunk
from kvstore.client.buffers import BufferPool
from kvstore.client.failures import unavailable
from kvstore.client.shm import SharedArena
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import ChunkKey, Namespace
from kvstore.tiers.base import TierKind
from kvstore.wire import FrameDecoder, FrameLimits, WireError

Destinations = Sequence[np.ndarray] | None

# A leased batch at least this large is copied by two threads (the hand-off
# costs about as much as copying a few hundred KiB).
PARALLEL_COPY_BYTES = 4 << 20

_TIERS = {kind.label: kind for kind in TierKind}


class Verify(enum.Enum):
    """How a shared-memory get checks what it copied; see the module docstring."""

    FAST = "fast"
    FULL = "full"


# FAST relies on x86-64's load ordering (the module docstring).
DEFAULT_VERIFY = Verify.FAST if platform.machine().lower() in {"x86_64", "amd64"} else Verify.FULL


@dataclass
class Received:
    """What a get has so far: ``chunks[i]`` verified or ``None``; how many were corrupt."""

    chunks: list[KVChunk | None]
    corrupt: int = 0
    inline: list[int] = field(default_factory=list)  # shm: positions to fetch as bytes


def chunk_of(
    header: BlockHeader,
    payload: memoryview,
    namespace: Namespace,
    key: ChunkKey,
    tier: TierKind,
    destination: np.ndarray | None,
) -> KVChunk:
    """The chunk asked for, from a block whose checksum was verified (or raise
    ``CorruptBlock`` / ``LayoutMismatch``): its identity is checked and its
    payload decoded, into ``destination`` if one is given."""
    check_identity(header, namespace, key)
    raw = decode_payload(payload, header.dtype, header.codec, header.raw_len)
    if raw.nbytes != namespace.layout.chunk_nbytes:
        raise CorruptBlock(f"block {key.hex()} holds {raw.nbytes} bytes, not one chunk")
    if destination is None:
        return KVChunk(key, tier, namespace.layout, raw)
    np.copyto(destination, np.frombuffer(raw, dtype=np.uint8))
    return KVChunk(key, tier, namespace.layout, destination.data)


def tier_of(label: Any) -> TierKind:
    """A tier label of the wire (``"dram"``) as a ``TierKind``."""
    try:
        return _TIERS[label]
    except (KeyError, TypeError):
        raise unavailable(f"malformed response: unknown tier {label!r}") from None


def _fits(header: bytes, size: int, destination: np.ndarray) -> bool:
    """Whether a payload can go straight into ``destination``: raw KV of exactly its size."""
    try:
        return size == destination.size and parse_header(header).codec is Codec.NONE
    except CorruptBlock:  # caught again, and counted, when the block is verified
        return False


class FramesSink:
    """Receives a ``"bytes"`` get's frames response, block by block, as it streams in."""

    def __init__(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        out: Destinations,
        buffers: BufferPool,
        verifier: Executor | None = None,
    ) -> None:
        self.namespace = namespace
        self.keys = keys
        self.out = out
        self.received = Received([None] * len(keys))
        self._verifier = verifier
        self._verifying: list[Future[None]] = []
        self._tiers: list[Any] = []
        self._placement = _Placement(out, buffers)
        # The daemon answers exactly the keys asked for; a block can be at most a
        # little larger than raw (a codec's worst case), never gigabytes.
        limit = HEADER_BYTES + 2 * namespace.layout.chunk_nbytes + 4096
        self._decoder = FrameDecoder(
            FrameLimits(max_blocks=len(keys), max_block_bytes=limit), into=self._placement
        )

    def feed(self, data: bytes) -> None:
        try:
            blocks = self._decoder.feed(data)
        except WireError as error:
            raise unavailable(f"malformed frames response: {error}") from None
        if not self._tiers and self._decoder.meta is not None:
            entries = self._decoder.meta["blocks"]
            if len(entries) != len(self.keys):
                raise unavailable(f"{len(entries)} blocks answered for {len(self.keys)} keys")
            self._tiers = [entry.get("tier") for entry in entries]
        for block in blocks:
            if block.data is None or block.header is None:
                continue
            index = block.index
            destination = None
            if self.out is not None and index not in self._placement.placed:
                destination = self.out[index]
            tier = tier_of(self._tiers[index])
            if self._verifier is None:
                self._verify(index, block.header, block.data, tier, destination)
            else:
                self._verifying.append(
                    self._verifier.submit(
                        self._verify, index, block.header, block.data, tier, destination
                    )
                )

    def finish(self) -> None:
        """Check the body ended where it should, and wait for every verification."""
        try:
            self._decoder.finish()
        except WireError as error:
            raise unavailable(f"malformed frames response: {error}") from None
        finally:
            self._wait()

    def settle(self) -> None:
        """After a failed exchange: drop the verifications not started and wait for
        the running one, so nothing writes to the caller's buffers once the get
        has returned."""
        verifying, self._verifying = self._verifying, []
        for future in verifying:
            future.cancel()
        for future in verifying:
            with contextlib.suppress(CancelledError):
                future.result()

    def _wait(self) -> None:
        verifying, self._verifying = self._verifying, []
        for future in verifying:
            future.result()

    def _verify(
        self,
        index: int,
        header_bytes: bytes,
        payload: bytes | memoryview,
        tier: TierKind,
        destination: np.ndarray | None,
    ) -> None:
        """Verify block ``index`` and record its chunk, or count it corrupt. One
        thread at a time per sink: the caller's, or the one worker's."""
        try:
            header = verify_parts(header_bytes, payload)
            chunk = chunk_of(
                header, memoryview(payload), self.namespace, self.keys[index], tier, destination
            )
        except (CorruptBlock, LayoutMismatch):
            self.received.corrupt += 1
            return
        self.received.chunks[index] = chunk


@dataclass
class _Placement:
    """Where each payload of a frames response goes (the decoder's ``into``): the
    caller's buffer when the payload fits it, else one of the pool.

    Not a method of ``FramesSink``: the decoder holds it, and a sink-decoder
    cycle would keep every chunk received alive until the garbage collector
    runs, and their buffers out of the pool.
    """

    out: Destinations
    buffers: BufferPool
    placed: set[int] = field(default_factory=set)  # payloads that went into ``out``

    def __call__(self, index: int, header: bytes, size: int) -> memoryview:
        if self.out is None or not _fits(header, size, self.out[index]):
            return self.buffers.take(size)
        self.placed.add(index)
        return self.out[index].data


@dataclass(frozen=True, slots=True)
class LeasedBlock:
    """One entry of a ``"shm"`` get: where the block lies, or that it is inline or missing."""

    offset: int | None
    length: int | None
    tier: TierKind | None
    inline: bool
    # The extent's generation when leased, and where its counter lies in the
    # arena (``None``: a daemon that does not say; the copy is then checksummed).
    generation: int | None = None
    generation_at: int | None = None

    @classmethod
    def parse(cls, entry: Any) -> LeasedBlock:
        try:
            if entry.get("missing"):
                return cls(None, None, None, False)
            if entry.get("inline"):
                return cls(None, None, None, True)
            generation, at = entry.get("generation"), entry.get("generation_at")
            return cls(
                int(entry["offset"]),
                int(entry["length"]),
                tier_of(entry["tier"]),
                False,
                None if generation is None else int(generation),
                None if at is None else int(at),
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            raise unavailable(f"malformed lease entry {entry!r}") from None


def copy_leased(
    arena: SharedArena,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    entries: Sequence[LeasedBlock],
    out: Destinations,
    buffers: BufferPool,
    helper: Executor | None = None,
    verify: Verify = Verify.FULL,
) -> Received:
    """Copy and check (``verify``) every leased block; note which ones to fetch inline.

    With a ``helper`` and ``PARALLEL_COPY_BYTES`` or more to copy, the helper's
    thread copies the second half of the blocks (by bytes) while this thread
    copies the first; if the helper is busy with another call's copy, this
    thread copies both halves rather than wait.
    """
    if len(entries) != len(keys):
        raise unavailable(f"{len(entries)} lease entries for {len(keys)} keys")
    received = Received([None] * len(keys))
    leased: list[int] = []
    for index, entry in enumerate(entries):
        if entry.inline:
            received.inline.append(index)
        elif entry.length is not None:
            leased.append(index)

    def copy(indices: list[int]) -> int:
        """Copy ``indices`` into ``received.chunks``; how many were corrupt."""
        corrupt = 0
        for index in indices:
            entry = entries[index]
            assert entry.offset is not None and entry.length is not None and entry.tier is not None
            destination = out[index] if out is not None else None
            unchanged = _unchanged(arena, entry) if verify is Verify.FAST else None
            try:
                with arena.block(entry.offset, entry.length) as view:
                    received.chunks[index] = _copy_one(
                        view, namespace, keys[index], entry.tier, destination, buffers, unchanged
                    )
            except (CorruptBlock, LayoutMismatch):
                corrupt += 1
        return corrupt

    sizes = [entries[index].length or 0 for index in leased]
    total = sum(sizes)
    if helper is None or len(leased) < 2 or total < PARALLEL_COPY_BYTES:
        received.corrupt = copy(leased)
        return received
    # This thread takes the first blocks, up to half the bytes; the helper the rest.
    half = next(count for count, upto in enumerate(accumulate(sizes), 1) if upto >= total / 2)
    cut = min(half, len(leased) - 1)
    first, second = leased[:cut], leased[cut:]
    theirs = helper.submit(copy, second)
    try:
        received.corrupt = copy(first)
    finally:
        if theirs.cancel():  # not started: the helper is busy elsewhere
            received.corrupt += copy(second)
        else:
            received.corrupt += theirs.result()
    return received


def _unchanged(arena: SharedArena, entry: LeasedBlock) -> Callable[[], bool] | None:
    """For ``Verify.FAST``: whether the entry's extent still has the generation it
    was leased at (``None`` if the daemon did not say: checksum instead)."""
    generation, at = entry.generation, entry.generation_at
    if generation is None or at is None:
        return None
    return lambda: arena.generation(at) == generation


def _copy_one(
    view: memoryview,
    namespace: Namespace,
    key: ChunkKey,
    tier: TierKind,
    destination: np.ndarray | None,
    buffers: BufferPool,
    unchanged: Callable[[], bool] | None = None,
) -> KVChunk:
    """Copy one block out of shared memory, checked as the module docstring says:
    checksummed as it is copied, or (``unchanged`` given) copied, then proven
    unchanged by its extent's generation, or else checksummed after all.

    The header is copied aside. A raw payload bound for a caller's buffer is
    copied straight into it: one copy of the KV, as with the embedded store's
    ``get(out=)``. Any other payload goes into a buffer of the pool and is
    decoded from there.
    """
    header_bytes = bytes(view[:HEADER_BYTES])
    size = view.nbytes - HEADER_BYTES
    if destination is not None and _fits(header_bytes, size, destination):
        target, destination = destination.data, None
    else:  # a block shorter than its header fails in copy_verified / copy_unverified
        target = buffers.take(max(size, 0))
    if unchanged is None:
        header = copy_verified(header_bytes, view[HEADER_BYTES:], target)
    else:
        header = copy_unverified(header_bytes, view[HEADER_BYTES:], target)
        if not unchanged():  # freed since the lease: check what was copied
            header = verify_parts(header_bytes, target)
    return chunk_of(header, target, namespace, key, tier, destination)

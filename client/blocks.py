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

* ``FramesSink`` takes a ``"bytes"`` get's frames body one of two ways.
  The blocking client reads it straight off the socket (``receive``,
  ``client.get_body``): each payload lands in its final buffer by
  ``recv_into`` and is checksummed 256 KiB at a time right after, while in
  cache (``fill_verified``), on the caller's thread: a fifth to a quarter
  of the client CPU of going through h11 and copying (~35-55 ms against
  ~165-310 ms per 128 MiB get, 2 shared cores). The asyncio client, and any
  response without a ``Content-Length``, stream it in (``feed``;
  ``kvstore.wire.FrameDecoder`` in its one-copy mode, so no body is ever
  buffered), then verify each block once it is complete: on a worker
  thread when it is given one, so block ``i`` is checksummed while block
  ``i+1`` is read off the socket (xxhash releases the GIL), as
  ``kvstore.store.reader`` overlaps LMDB reads; ``finish`` waits for the last.
* ``copy_leased`` copies the blocks a ``"shm"`` lease points at out of the
  read-only mapping (``client.shm``), checked as ``Verify`` says. A large
  batch of large blocks is copied by two threads taking blocks in turn (copy
  and checksum release the GIL); a batch of small blocks by one, as a second
  thread then costs more GIL hand-offs than it saves (``PARALLEL_COPY_BYTES``).
  A lease's HBM blocks are copied device to device by ``client.device``
  instead, and reach ``copy_leased`` as done or inline.

How a shared-memory copy is checked (``Verify``)::

    FULL  header + payload checksummed as they are copied (copy_payload):
          the copy is what the daemon verified when it was put, whatever
          happened in shared memory; costs an xxh3 pass over every byte
    FAST  header parsed; payload copied unchecked; then the extent's
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

With ``out`` buffers, host arrays (the caller's own, or the staging of its
device tensors: ``kvstore.store.out_buffers``), the returned ``KVChunk`` is a
view of the array, as with ``TieredStore.get(out=)``; a missed block leaves
its array with unspecified contents. A leased block bound for ``ChunkPages``
(a paged cache's pages) is copied, and checked, straight into them.
"""

from __future__ import annotations

import contextlib
import enum
import platform
from collections.abc import Sequence
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.block import (
    HEADER_BYTES,
    BlockHeader,
    Codec,
    check_identity,
    check_payload_size,
    copy_into,
    copy_payload,
    fill_verified,
    parse_header,
    verify_parts,
)
from kvstore.client.buffers import BufferPool
from kvstore.client.failures import unavailable
from kvstore.client.get_body import SocketBody
from kvstore.client.shm import SharedArena
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.store.chunk import ChunkPages, KVChunk
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.frames import META_LENGTH, FrameDecoder, FrameLimits, meta_length, parse_meta

Destinations = Sequence[np.ndarray] | None
LeasedDestinations = Sequence[np.ndarray | ChunkPages] | None

# A leased batch is copied by two threads only where the batch and its blocks are
# large: the hand-off costs about as much as copying a few hundred KiB, and each
# block takes the GIL to start and finish. On 2 cores (AMD EPYC), 64 MiB checksummed
# as 256 256-KiB blocks: two threads 56.6 ms, one 35.4. Of large blocks, two threads
# copy more, checked FAST too: `bench/daemon.py`'s shared-memory gets of 128 MiB in
# 2 and 16 MiB blocks, run interleaved, 0.92-1.07 of a one-thread memcpy with two
# threads against 0.63-0.77 with one.
PARALLEL_COPY_BYTES = 4 << 20
PARALLEL_BLOCK_BYTES = 1 << 20

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
    destination: np.ndarray | ChunkPages | None,
    chunk_nbytes: int | None = None,
) -> KVChunk:
    """The chunk asked for, from a block whose checksum was verified (or raise
    ``CorruptBlock`` / ``LayoutMismatch``): its identity is checked and its
    payload decoded, into ``destination`` (a buffer, or pages) if one is given. ``chunk_nbytes``:
    the layout's, if the caller has it at hand (it is a product over the
    chunk's shape, a few microseconds a block)."""
    check_identity(header, namespace, key)
    raw = decode_payload(payload, header.dtype, header.codec, header.raw_len)
    if chunk_nbytes is None:
        chunk_nbytes = namespace.layout.chunk_nbytes
    if raw.nbytes != chunk_nbytes:
        raise CorruptBlock(f"block {key.hex()} holds {raw.nbytes} bytes, not one chunk")
    if isinstance(destination, ChunkPages):
        destination.fill(raw)
        return KVChunk(key, tier, namespace.layout, memoryview(b""), pages=destination)
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
    """Receives a ``"bytes"`` get's frames response, block by block: fed as it streams
    in (``feed``, then ``finish``), or read off the socket (``receive``)."""

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

    def receive(self, body: SocketBody) -> None:
        """Read the whole frames body off the socket (``client.get_body``), each
        payload straight into its buffer, checksummed step by step as it lands
        (``fill_verified``), on this thread; instead of ``feed`` and ``finish``.

        A block that fails a check is counted corrupt, and the rest of its bytes
        skipped, as with ``feed``. Everything is written before this returns.
        """
        try:
            self._receive(body)
        except WireError as error:
            raise unavailable(f"malformed frames response: {error}") from None

    def _receive(self, body: SocketBody) -> None:
        limits = self._decoder.limits
        length = meta_length(body.read_exact(META_LENGTH.size), limits)
        meta, entries = parse_meta(body.read_exact(length), limits)
        if len(entries) != len(self.keys):
            raise unavailable(f"{len(entries)} blocks answered for {len(self.keys)} keys")
        chunk_nbytes = self.namespace.layout.chunk_nbytes
        for index, (_, block_length) in enumerate(entries):
            if block_length is None:
                continue
            tier = tier_of(meta["blocks"][index].get("tier"))
            header = body.read_exact(min(block_length, HEADER_BYTES))
            payload = self._placement(index, header, block_length - len(header))
            destination = None
            if self.out is not None and index not in self._placement.placed:
                destination = self.out[index]
            try:
                chunk = _fill_chunk(
                    body,
                    header,
                    payload,
                    self.namespace,
                    self.keys[index],
                    tier,
                    destination,
                    chunk_nbytes,
                )
            except (CorruptBlock, LayoutMismatch):
                self.received.corrupt += 1
                continue
            self.received.chunks[index] = chunk
        if body.remaining:
            raise WireError(ErrorCode.MALFORMED_BODY, "bytes after the last block")

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


def _fill_chunk(
    body: SocketBody,
    header: bytes,
    payload: memoryview,
    namespace: Namespace,
    key: ChunkKey,
    tier: TierKind,
    destination: np.ndarray | None,
    chunk_nbytes: int,
) -> KVChunk:
    """Read one block's payload off ``body`` into ``payload``, checksummed as it lands,
    and check it (``chunk_of``); a block found corrupt before its payload was
    all read has the rest skipped, so the next block starts where it should."""
    filled = 0

    def fill(step: memoryview) -> None:
        nonlocal filled
        body.readinto(step)
        filled += step.nbytes

    try:
        verified = fill_verified(header, payload, fill)
    except CorruptBlock:
        body.skip(payload.nbytes - filled)
        raise
    return chunk_of(verified, payload, namespace, key, tier, destination, chunk_nbytes)


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
    out: LeasedDestinations,
    buffers: BufferPool,
    helper: Executor | None = None,
    verify: Verify = Verify.FULL,
) -> Received:
    """Copy and check (``verify``) every leased block; note which ones to fetch inline.

    With a ``helper`` and a large batch of large blocks (``PARALLEL_COPY_BYTES``),
    the helper's thread copies too.
    The two threads take blocks one at a time from one iterator (``next`` on
    it is atomic under the GIL), not a fixed half each: on a busy host the
    helper's thread may be descheduled for milliseconds,
    and then this thread copies the rest instead of waiting for it (a fixed
    half measured 0.62-0.79 of a single-thread memcpy for 2 MiB blocks on 2
    shared cores). Each block's Python work (its header, its chunk) runs on
    the thread that copies it, so it overlaps the other thread's copy. A
    helper that never started (busy with another call's copy) is called off,
    not waited for.
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
    chunk_nbytes = namespace.layout.chunk_nbytes  # a product over the shape: once per batch
    order = iter(leased)

    def copy_some() -> int:
        """Copy blocks until none are left to take; how many were corrupt."""
        corrupt = 0
        for index in order:
            destination = out[index] if out is not None else None
            try:
                received.chunks[index] = _copy_one(
                    arena,
                    entries[index],
                    namespace,
                    keys[index],
                    destination,
                    buffers,
                    verify,
                    chunk_nbytes,
                )
            except (CorruptBlock, LayoutMismatch):
                corrupt += 1
        return corrupt

    total = sum(entries[index].length or 0 for index in leased)
    if (
        helper is None
        or len(leased) < 2
        or total < max(PARALLEL_COPY_BYTES, PARALLEL_BLOCK_BYTES * len(leased))
    ):
        received.corrupt = copy_some()
        return received
    theirs = helper.submit(copy_some)
    try:
        received.corrupt = copy_some()
    finally:
        if not theirs.cancel():  # started: it has at most the block in hand left
            received.corrupt += theirs.result()
    return received


def _copy_one(
    arena: SharedArena,
    entry: LeasedBlock,
    namespace: Namespace,
    key: ChunkKey,
    destination: np.ndarray | ChunkPages | None,
    buffers: BufferPool,
    verify: Verify,
    chunk_nbytes: int,
) -> KVChunk:
    """Copy one block out of shared memory, checked as the module docstring says:
    checksummed as it is copied (FULL, or a lease without generations), or
    copied, then proven unchanged by its extent's generation, or else
    checksummed after all (FAST).

    The header is copied aside and parsed once. A raw payload bound for a
    caller's buffer or pages is copied straight into them: one copy of the KV,
    as with the embedded store's ``get(out=)``. Any other payload goes into a
    buffer of the pool and is decoded from there.
    """
    assert entry.offset is not None and entry.length is not None and entry.tier is not None
    fast = verify is Verify.FAST and entry.generation is not None
    with arena.block(entry.offset, entry.length) as view:
        header_bytes = bytes(view[:HEADER_BYTES])
        header = parse_header(header_bytes)
        size = view.nbytes - HEADER_BYTES
        check_payload_size(header, size)
        target: memoryview | tuple[np.ndarray, ...]
        pages: ChunkPages | None = None
        if destination is None or header.codec is not Codec.NONE:
            target = buffers.take(size)
        elif isinstance(destination, ChunkPages) and size == destination.nbytes:
            target, pages, destination = destination.pages, destination, None
        elif isinstance(destination, np.ndarray) and size == destination.size:
            target, destination = destination.data, None
        else:
            target = buffers.take(size)
        if not fast or entry.generation_at is None:
            header = copy_payload(header_bytes, view[HEADER_BYTES:], target)
        else:
            _copy_range(view, target)
            if arena.generation(entry.generation_at) != entry.generation:
                header = verify_parts(header_bytes, target)  # freed since the lease
    if pages is not None:  # landed raw in pages: its identity and size are left to check
        check_identity(header, namespace, key)
        if header.raw_len != size:
            raise CorruptBlock(f"block {key.hex()} holds {header.raw_len} bytes, not {size}")
        return KVChunk(key, entry.tier, namespace.layout, memoryview(b""), pages=pages)
    assert isinstance(target, memoryview)
    return chunk_of(header, target, namespace, key, entry.tier, destination, chunk_nbytes)


def _copy_range(source: memoryview, target: memoryview | tuple[np.ndarray, ...]) -> None:
    """Copy the payload of the arena block ``source`` into ``target``, a buffer or
    pages, unchecked (its own frame, so the arrays exporting ``source`` are gone
    when it returns)."""
    copy_into(np.frombuffer(source, dtype=np.uint8, offset=HEADER_BYTES), target)

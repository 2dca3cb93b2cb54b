"""Frames bodies in and out of the daemon, moved without copying on the event loop.

In (a put)::

    request.content ──► FrameSplitter ──► ArrivedBlock(index, key, parts)
      (chunks as        (metadata: FrameDecoder;   (views of the chunks a block
       aiohttp read      blocks: cut at their       spans; joined, verified and
       them)             lengths, never copied)     framed later, on a worker)

Out (a bytes get)::

    ServedGet ──► metadata (every length known up front)
                  then block by block, in order:
                    DRAM  ──► a view of the shared arena, pinned while it is written
                    other ──► read on a worker, one window ahead of the writer

Writes go out in slices of ``WRITE_SLICE_BYTES``: asyncio (3.11) copies into
its own buffer whatever the kernel does not take at once, and then moves the
rest of that buffer down after every partial send. A Unix socket takes about
200 KiB per send, so a whole 16 MiB block written at once is copied in full
and then memmoved ~80 times; slices keep both the copy and the moves small
(daemon CPU per 128 MiB of 16 MiB blocks: Unix socket 38 ms written whole,
28 ms in 256 KiB slices; TCP 52 and 34 ms; the same within noise at 2 MiB).
From Python 3.12 asyncio keeps a reference instead of a copy, so a response
is only done, and its DRAM blocks may be unpinned, once asyncio holds none
of it (``_flushed``).
"""

from __future__ import annotations

import asyncio
import struct
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvstore.block import HEADER_BYTES
from kvstore.keys import ChunkKey
from kvstore.reader import VERIFY_WINDOW_BYTES
from kvstore.serving import ServedGet
from kvstore.store import TieredStore
from kvstore.wire import (
    FRAMES_CONTENT_TYPE,
    ErrorCode,
    FrameDecoder,
    FrameLimits,
    WireError,
    encode_frames,
)

WRITE_SLICE_BYTES = 256 << 10
# Whether asyncio's transports buffer views of what they were given, not copies.
_TRANSPORT_KEEPS_VIEWS = sys.version_info >= (3, 12)
_FLUSH_POLL_S = 0.001
# The frames body's length prefix (kvstore/wire.py): u32 LE, then that much JSON.
_META_LENGTH = struct.Struct("<I")


# -- in: a put's body ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArrivedBlock:
    """One block of a frames body as it arrived: views of the received chunks it
    spans, in order (``None`` for a block the metadata says is absent)."""

    index: int
    key: ChunkKey
    parts: list[memoryview] | None

    @property
    def nbytes(self) -> int:
        return 0 if self.parts is None else sum(part.nbytes for part in self.parts)

    def joined(self) -> bytes | memoryview | None:
        """The block's bytes in one buffer (a copy unless it arrived in one piece)."""
        if self.parts is None:
            return None
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)


class FrameSplitter:
    """Cuts a frames body into blocks as it streams in, copying none of their bytes.

    The metadata goes through ``FrameDecoder`` (one parser and one set of
    limits for client and daemon); after it, each block is the list of views
    of the chunks fed that hold its bytes, so the chunks must not be mutated
    (aiohttp hands out ``bytes``). Errors are the decoder's ``WireError``s.
    """

    def __init__(self, limits: FrameLimits) -> None:
        self._decoder = FrameDecoder(limits)
        self._fed = 0  # bytes of the length prefix and metadata fed to the decoder
        self._prefix = bytearray()
        self._entries: list[tuple[ChunkKey, int | None]] = []
        self._next = 0
        self._parts: list[memoryview] = []
        self._filled = 0

    @property
    def meta(self) -> dict[str, Any] | None:
        return self._decoder.meta

    @property
    def keys(self) -> list[ChunkKey]:
        return [key for key, _ in self._entries]

    def feed(self, data: bytes) -> list[ArrivedBlock]:
        """The blocks ``data`` completes (absent ones included), in order."""
        view = memoryview(data)
        if self._decoder.meta is None:
            view = self._feed_meta(view)
            if self._decoder.meta is None:
                return []
            self._entries = [
                (ChunkKey(bytes.fromhex(entry["key"])), entry["length"])
                for entry in self._decoder.meta["blocks"]  # checked by the decoder
            ]
        return self._split(view)

    def finish(self) -> None:
        """Raise unless the body ended exactly after its last block."""
        if self._decoder.meta is None or self._next < len(self._entries):
            raise WireError(ErrorCode.MALFORMED_BODY, "body ended before its last block")

    def _feed_meta(self, view: memoryview) -> memoryview:
        """Feed the decoder the length prefix and the metadata, not a byte more;
        return what follows them in ``view``."""
        while self._decoder.meta is None and view.nbytes:
            if self._fed < _META_LENGTH.size:
                wanted = _META_LENGTH.size - self._fed
            else:
                wanted = _META_LENGTH.size + _META_LENGTH.unpack(self._prefix)[0] - self._fed
            piece = view[:wanted]
            if self._fed < _META_LENGTH.size:
                self._prefix += piece
            self._fed += piece.nbytes
            # Refuses metadata over the limit as soon as its length is in.
            self._decoder.feed(piece)
            view = view[piece.nbytes :]
        return view

    def _split(self, view: memoryview) -> list[ArrivedBlock]:
        arrived: list[ArrivedBlock] = []
        while self._next < len(self._entries):
            key, length = self._entries[self._next]
            if length is None:
                arrived.append(ArrivedBlock(self._next, key, None))
                self._next += 1
                continue
            if not view.nbytes:
                break
            piece = view[: length - self._filled]
            self._parts.append(piece)
            self._filled += piece.nbytes
            view = view[piece.nbytes :]
            if self._filled < length:
                break
            arrived.append(ArrivedBlock(self._next, key, self._parts))
            self._parts, self._filled = [], 0
            self._next += 1
        if view.nbytes:
            raise WireError(ErrorCode.MALFORMED_BODY, "bytes after the last block")
        return arrived


# -- out: a bytes get's response -------------------------------------------------------


async def send_served(
    request: web.Request, store: TieredStore, served: ServedGet
) -> web.StreamResponse:
    """Answer ``request`` with the blocks of ``served`` as a frames body.

    Blocks below DRAM start being read before the metadata is written. A block
    lost between ``store.serving.serve`` and its turn (``read_served`` gives ``None``)
    is written as zeros of its announced length: it fails the client's
    verification, so it is a miss there, and the rest still arrives.
    """
    reader = _WindowReader(store, served)
    try:
        entries = [
            {"key": key.hex(), "length": length, "tier": None if tier is None else tier.label}
            for key, length, tier in zip(served.keys, served.lengths, served.tiers, strict=True)
        ]
        meta = list(encode_frames({"blocks": entries}, ()))
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        response.content_length = sum(len(piece) for piece in meta) + sum(
            length for length in served.lengths if length is not None
        )
        await response.prepare(request)
        for piece in meta:
            await response.write(piece)
        for index, length in enumerate(served.lengths):
            if length is None:
                continue
            shared = served.shared[index]
            block = store.serving.arena_view(shared) if shared is not None else await reader.next()
            await _write(response, block if block is not None else memoryview(bytes(length)))
        await response.write_eof()
        await _flushed(request)
    finally:
        reader.cancel()
    return response


async def _flushed(request: web.Request) -> None:
    """Where the transport may hold views of the arena, wait until it has handed
    everything to the kernel (at most a high-water mark's worth, 64 KiB, is left
    after ``write_eof``). A transport that fails drops its buffer, so this ends
    on a hang-up too."""
    transport = request.transport
    while _TRANSPORT_KEEPS_VIEWS and transport is not None and transport.get_write_buffer_size():
        await asyncio.sleep(_FLUSH_POLL_S)


async def _write(response: web.StreamResponse, block: memoryview) -> None:
    for start in range(0, block.nbytes, WRITE_SLICE_BYTES):
        await response.write(block[start : start + WRITE_SLICE_BYTES])


class _WindowReader:
    """Reads the blocks of a ``ServedGet`` that DRAM does not share, in windows of
    about ``VERIFY_WINDOW_BYTES`` on a worker thread, one window ahead of the writer."""

    def __init__(self, store: TieredStore, served: ServedGet) -> None:
        self._store = store
        self._served = served
        below = [
            index
            for index, (shared, length) in enumerate(
                zip(served.shared, served.lengths, strict=True)
            )
            if shared is None and length is not None
        ]
        step = max(1, VERIFY_WINDOW_BYTES // (HEADER_BYTES + served.namespace.layout.chunk_nbytes))
        self._windows = deque(below[start : start + step] for start in range(0, len(below), step))
        self._reading: asyncio.Future[list[memoryview | None]] | None = None
        self._ready: deque[memoryview | None] = deque()
        self._read_next()

    async def next(self) -> memoryview | None:
        """The next block below DRAM, in order; ``None`` if it was lost."""
        if not self._ready:
            assert self._reading is not None, "asked for more blocks than were announced"
            self._ready.extend(await self._reading)
            self._reading = None
            self._read_next()
        return self._ready.popleft()

    def cancel(self) -> None:
        """Stop waiting for the window being read (the thread finishes it unseen)."""
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None

    def _read_next(self) -> None:
        if self._windows:
            self._reading = asyncio.get_running_loop().run_in_executor(
                None, self._store.serving.read_served, self._served, self._windows.popleft()
            )

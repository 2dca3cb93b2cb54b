"""Frames bodies out of the daemon (a bytes get), moved without copying on the event
loop (a put's body comes in through ``kvstore.server.put``)::

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
import socket
import sys
from collections import deque

from aiohttp import web

from kvstore.block import HEADER_BYTES
from kvstore.server.connection import connection_socket
from kvstore.store.reader import VERIFY_WINDOW_BYTES
from kvstore.store.shared import ServedGet, SharedServing
from kvstore.wire.body import UNIX_SEND_BUFFER_BYTES
from kvstore.wire.frames import FRAMES_CONTENT_TYPE, encode_frames

WRITE_SLICE_BYTES = 256 << 10
# Whether asyncio's transports buffer views of what they were given, not copies.
_TRANSPORT_KEEPS_VIEWS = sys.version_info >= (3, 12)
_FLUSH_POLL_S = 0.001


# -- out: a bytes get's response -------------------------------------------------------


async def send_served(
    request: web.Request, serving: SharedServing, served: ServedGet
) -> web.StreamResponse:
    """Answer ``request`` with the blocks of ``served`` as a frames body.

    Blocks below DRAM start being read before the metadata is written. A block
    lost between ``serving.serve`` and its turn (``read_served`` gives ``None``)
    is written as zeros of its announced length: it fails the client's
    verification, so it is a miss there, and the rest still arrives.
    """
    reader = _WindowReader(serving, served)
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
        widen_send_buffer(request)
        await response.prepare(request)
        for piece in meta:
            await response.write(piece)
        for index, length in enumerate(served.lengths):
            if length is None:
                continue
            shared = served.shared[index]
            block = serving.arena_view(shared) if shared is not None else await reader.next()
            await _write(response, block if block is not None else memoryview(bytes(length)))
        await response.write_eof()
        await _flushed(request)
    finally:
        reader.cancel()
    return response


def widen_send_buffer(request: web.Request) -> None:
    """Give a Unix-socket connection ``UNIX_SEND_BUFFER_BYTES`` of send buffer before
    a large response (Linux caps it at ``net.core.wmem_max``)."""
    sock = connection_socket(request)
    if sock is not None and sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)


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

    def __init__(self, serving: SharedServing, served: ServedGet) -> None:
        self._serving = serving
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
                None, self._serving.read_served, self._served, self._windows.popleft()
            )

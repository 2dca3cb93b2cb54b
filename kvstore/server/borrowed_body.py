"""A request body read straight off the connection's socket, on a worker thread.

Why: aiohttp hands a body over as a fresh ``bytes`` per socket read (256 KiB),
which a put then copied a second time, into its reserved DRAM extent. On a
put of 128 MiB that copy, the allocations and the event loop's share of the
work cost the daemon about twice the CPU a bare aiohttp app spends reading
the same body. Read with ``recv_into`` straight into the extent, the
kernel's copy is the only one, and each step is checksummed while it is
still in cache (``block.fill_verified``).

How the connection is borrowed from aiohttp (``borrow``)::

    transport.pause_reading()       no more reads into aiohttp's buffer ...
    await asyncio.sleep(0)          ... once a read already queued this loop
                                    iteration has run
    request.content.read_nowait()   what aiohttp buffered: the body's first bytes
    pause_reading() again           aiohttp's flow control may have resumed it
    ── worker thread: recv_into on a duplicate of the socket's descriptor,
       waiting in poll() slices, until Content-Length bytes were read ──
    request.content.feed_eof()      aiohttp sees the body as read ...
    Connection: close               ... but its parser still counts the bytes we
                                    took, so the connection ends with the response

One reconnect per put (~0.1 ms on a Unix socket) buys the copy. Only bodies
with a ``Content-Length`` can be borrowed: chunked encoding would need
parsing here.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import math
import os
import select
import socket
import termios
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from kvstore.server.connection import connection_socket
from kvstore.wire.body import BodyReader
from kvstore.wire.codes import ErrorCode, WireError

# Requests whose connection a handler borrowed: their responses close it.
BORROWED = web.RequestKey("borrowed_socket", bool)
# poll() waits in slices this long, so that a connection aiohttp closed (the
# daemon stopping) is noticed within one.
_POLL_SLICE_S = 0.25
_DISCARD_BYTES = 1 << 20
# How soon ``arrived`` looks again while some, too few, of the bytes it waits for are
# here (the socket stays readable, so it cannot wait for that): at first at once, as a
# client sending at speed is a segment away; then less often, up to the longest.
_ARRIVAL_POLL_FIRST_S = 0.0005
_ARRIVAL_POLL_LONGEST_S = 0.02


class SocketBody(BodyReader):
    """A body of ``length`` bytes, none read yet: what aiohttp had buffered, then the
    socket. Blocking reads, one worker thread at a time; ``arrived`` waits on the
    event loop.

    ``time_limit``: how long the body may take. A client that sends nothing for
    ``idle_timeout_s`` is cut off, and so is one still sending at ``deadline_s``
    (``request_timeout``): a client trickling a byte now and then never goes
    quiet, yet must not hold its put slot for long. The deadline runs from the
    body being borrowed and again from ``start_clock`` (a put's slot: waiting
    for one is not the client's doing). ``closed()``: whether the connection was
    closed under us (checked between polls), which ends the read as a hang-up
    would.
    """

    def __init__(
        self,
        sock: socket.socket,
        buffered: bytes,
        length: int,
        time_limit: BodyTimeLimit,
        closed: Callable[[], bool],
    ) -> None:
        super().__init__(buffered, length)
        self._sock = sock
        self._limit = time_limit
        self._deadline = time.monotonic() + time_limit.deadline_s
        self._closed = closed
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def start_clock(self) -> None:
        """Count the deadline from now."""
        self._deadline = time.monotonic() + self._limit.deadline_s

    async def arrived(self, nbytes: int) -> None:
        """Wait until the next ``nbytes`` of the body are here (aiohttp's buffer and
        the kernel's), holding no thread and no slot, within the deadline and the
        idle timeout. Bytes the client sent are waiting in the kernel's buffer
        (``FIONREAD``) until they are read, so a client that sends headers and
        then trickles waits here, not in a put slot."""
        loop = asyncio.get_running_loop()
        fd = self._sock.fileno()
        waiting, quiet_since = -1, time.monotonic()
        pause_s = _ARRIVAL_POLL_FIRST_S
        while True:
            before, waiting = waiting, self._ahead.nbytes + _queued(fd)
            if waiting >= nbytes:
                return
            now = time.monotonic()
            if waiting > before:
                quiet_since = now
                pause_s = _ARRIVAL_POLL_FIRST_S
            self._check_time(now, quiet_since)
            if self._closed():
                raise WireError(ErrorCode.UNAVAILABLE, "connection closed mid-body")
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _wake, readable)
            try:
                await asyncio.wait([readable], timeout=self._wait_s(now))
            finally:
                loop.remove_reader(fd)
            if readable.done() and self._ahead.nbytes + _queued(fd) == waiting:
                if waiting == self._ahead.nbytes:  # readable with nothing queued: hung up
                    raise WireError(ErrorCode.MALFORMED_BODY, "client hung up mid-body")
                await asyncio.sleep(pause_s)  # some bytes, too few: look again soon
                pause_s = min(2 * pause_s, _ARRIVAL_POLL_LONGEST_S)

    def discard(self, deadline_s: float) -> None:
        """Read and drop the rest of the body for at most ``deadline_s`` seconds, so
        that a client still sending reads the error answer instead of a reset. Past
        the body's own deadline this ends at the first pause: a slow client is not
        waited for twice."""
        until = time.monotonic() + deadline_s
        with contextlib.suppress(WireError):  # gone or quiet: nothing more to wait for
            while self.remaining and time.monotonic() < until:
                self.skip(min(_DISCARD_BYTES, self.remaining))

    def _receive(self, view: memoryview) -> int:
        quiet_since = time.monotonic()
        while True:
            try:
                received = self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                received = None
            except OSError as error:
                raise WireError(
                    ErrorCode.MALFORMED_BODY, f"connection failed mid-body: {error}"
                ) from None
            if received == 0:
                raise WireError(ErrorCode.MALFORMED_BODY, "client hung up mid-body")
            if received is not None:
                return received
            if self._closed():
                raise WireError(ErrorCode.UNAVAILABLE, "connection closed mid-body")
            now = time.monotonic()
            self._check_time(now, quiet_since)
            self._poller.poll(max(1, math.ceil(self._wait_s(now) * 1000)))

    def _check_time(self, now: float, quiet_since: float) -> None:
        if now >= self._deadline:
            raise WireError(
                ErrorCode.REQUEST_TIMEOUT,
                f"body not received within {self._limit.deadline_s:g} s; giving up",
            )
        if now - quiet_since > self._limit.idle_timeout_s:
            raise WireError(
                ErrorCode.MALFORMED_BODY,
                f"no body bytes for {self._limit.idle_timeout_s:g} s; giving up",
            )

    def _wait_s(self, now: float) -> float:
        return min(_POLL_SLICE_S, self._deadline - now)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _queued(fd: int) -> int:
    """Bytes the kernel holds for ``fd``, not yet read (``FIONREAD``)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


@dataclass(frozen=True, slots=True)
class BodyTimeLimit:
    """How long a borrowed body may take: ``deadline_s`` in all, counted from when it
    is borrowed, with no pause longer than ``idle_timeout_s``."""

    deadline_s: float
    idle_timeout_s: float


@asynccontextmanager
async def borrow(request: web.Request, time_limit: BodyTimeLimit) -> AsyncIterator[SocketBody]:
    """Take the rest of ``request``'s body off aiohttp (see the module docstring).

    The response to ``request``, whatever it is, closes the connection
    (``close_borrowed``, an ``on_response_prepare`` hook). Raises ``WireError``
    if the body has no ``Content-Length``.
    """
    length = request.content_length
    transport = request.transport
    if length is None or "chunked" in request.headers.get("Transfer-Encoding", "").lower():
        raise WireError(ErrorCode.LENGTH_REQUIRED, "a put body needs a Content-Length")
    raw = connection_socket(request)
    if transport is None or raw is None:
        raise WireError(ErrorCode.UNAVAILABLE, "the connection is gone")
    request[BORROWED] = True
    transport.pause_reading()
    await asyncio.sleep(0)  # a read queued before the pause lands in request.content
    buffered = request.content.read_nowait(-1)
    if transport.is_reading():  # aiohttp's flow control resumed it while draining
        transport.pause_reading()
    # A duplicate descriptor of the same socket (non-blocking, like the original):
    # ours to read from and close, while aiohttp keeps its own for the response.
    sock = socket.socket(fileno=os.dup(raw.fileno()))
    try:
        yield SocketBody(sock, buffered, length, time_limit, transport.is_closing)
    finally:
        sock.close()
        request.content.feed_eof()


async def close_borrowed(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: end the connection after answering a request whose
    body was borrowed; aiohttp's parser would read the next request as body.
    (The hook runs after aiohttp chose its headers, so the header is set here.)"""
    if request.get(BORROWED):
        response.force_close()
        response.headers["Connection"] = "close"

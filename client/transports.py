"""The httpx transports ``connect`` gives its clients: Unix socket or TCP, bounded pools.

They are httpx's own transports over network backends of ours, which differ
from httpcore's in these ways:

* Reads take more than the 64 KiB httpcore asks for: a get moves tens of
  MiB, and every read is a pass through h11 and httpcore. Blocking reads
  take up to ``READ_BYTES`` (a bare 128 MiB body: ~10% faster), not more:
  ``recv(n)`` allocates ``n`` bytes first, and from 256 KiB up glibc maps
  fresh pages for each read (every page faulted on TCP; 1 MiB reads were
  ~30% slower than 64 KiB). asyncio reads 256 KiB at a time whatever is
  asked, and anyio cuts what it read into copies of at most the size asked:
  async reads take ``ASYNC_READ_BYTES``, whole (~25% faster).
* The blocking backend writes with ``sendall``, where httpcore's loop copies
  the unsent rest of a buffer after every partial send: quadratic in the
  buffer's size on a Unix socket's ~200 KiB send buffer. (The write timeout
  then bounds each buffer h11 hands over, a body slice of at most 1 MiB,
  rather than each ``send``.)
* A Unix socket gets a send buffer of ``wire.UNIX_SEND_BUFFER_BYTES``: the default
  (~208 KiB) holds a tenth of a 2 MiB block, so sender and receiver take
  turns instead of overlapping. A put of 128 MiB over a Unix socket went
  from ~2.0 to ~3.8 GB/s (bare aiohttp) and ~1.25 to ~3.2 GB/s (the daemon)
  with 1-4 MiB. Linux caps it at ``net.core.wmem_max``; TCP keeps its
  autotuning, which setting a size would turn off.
* The blocking stream cuts each response's head from its body, so that h11
  buffers nothing of the body and a bytes get can read it off the socket
  itself (``BodyStream``, ``client.get_body``).
* httpcore 1.0's blocking backend does not close a Unix socket whose
  ``connect`` fails (its asyncio backend, anyio, does): each call made while
  the daemon is down or restarting would leave a socket to the garbage
  collector and a ``ResourceWarning``.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Iterable

import httpcore
import httpx
from httpcore._backends.sync import SyncStream  # what SyncBackend itself returns

from kvstore.wire.body import UNIX_SEND_BUFFER_BYTES

# As httpcore spells it (setsockopt's argument forms).
SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)

READ_BYTES = 128 << 10
_UNIX_SOCKET_OPTIONS: list[SocketOption] = [
    (socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
]
ASYNC_READ_BYTES = 256 << 10  # asyncio's own read size (selector transports)
# The end of a response head, as h11 finds it.
_BLANK_LINE = re.compile(b"\n\r?\n")


def limits(max_connections: int) -> httpx.Limits:
    # Keep every connection alive: a busy engine would otherwise reconnect per call.
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)


def transport(uds: str | None, max_connections: int) -> httpx.BaseTransport:
    return Transport(uds, limits(max_connections))


def async_transport(uds: str | None, max_connections: int) -> httpx.AsyncBaseTransport:
    return AsyncTransport(uds, limits(max_connections))


class Transport(httpx.HTTPTransport):
    """``httpx.HTTPTransport`` (``uds``: over that Unix socket) on ``_Backend``."""

    def __init__(self, uds: str | None, pool_limits: httpx.Limits) -> None:
        super().__init__(uds=uds, limits=pool_limits)
        self._pool = httpcore.ConnectionPool(
            max_connections=pool_limits.max_connections,
            max_keepalive_connections=pool_limits.max_keepalive_connections,
            keepalive_expiry=pool_limits.keepalive_expiry,
            uds=uds,
            socket_options=_UNIX_SOCKET_OPTIONS if uds else None,
            network_backend=_Backend(),
        )


class AsyncTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` (``uds``: over that Unix socket) on ``_AsyncBackend``."""

    def __init__(self, uds: str | None, pool_limits: httpx.Limits) -> None:
        super().__init__(uds=uds, limits=pool_limits)
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=pool_limits.max_connections,
            max_keepalive_connections=pool_limits.max_keepalive_connections,
            keepalive_expiry=pool_limits.keepalive_expiry,
            uds=uds,
            socket_options=_UNIX_SOCKET_OPTIONS if uds else None,
            network_backend=_AsyncBackend(),
        )


class BodyStream(SyncStream):
    """httpcore's blocking stream, with large reads, ``sendall``, and a response's
    head cut from its body, so that a bytes get can read the body itself
    (``client.get_body``).

    After each write (a request going out), reads are in the response's head:
    a read that takes in the head's blank line returns only up to it, and keeps
    the rest for ``take_body_start`` (or the next read). One connection, one
    thread at a time (httpcore's pool hands it to one request).
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._in_head = False
        self._head_tail = b""  # the last bytes of the head so far: a blank line may straddle
        self._pending = b""  # read off the socket, after the head

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
        else:
            data = super().read(max(max_bytes, READ_BYTES), timeout)
        if self._in_head and data:
            data = self._cut_head(data)
        return data

    def take_body_start(self) -> bytes | None:
        """What was read past the head just received (``None``: no head was cut)."""
        if self._in_head:
            return None
        pending, self._pending = self._pending, b""
        return pending

    def give_back(self, pending: bytes) -> None:
        """Undo ``take_body_start``: the body goes through h11 after all."""
        self._pending = pending

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._in_head, self._head_tail = True, b""
        try:
            self._sock.settimeout(timeout)
            self._sock.sendall(buffer)
        except TimeoutError as error:
            raise httpcore.WriteTimeout(str(error)) from error
        except OSError as error:
            raise httpcore.WriteError(str(error)) from error

    def _cut_head(self, data: bytes) -> bytes:
        seen = self._head_tail + data
        match = _BLANK_LINE.search(seen)
        if match is None:
            self._head_tail = seen[-2:]
            return data
        end = match.end() - len(self._head_tail)
        self._in_head, self._head_tail = False, b""
        self._pending = data[end:]
        return data[:end]


class _Backend(httpcore.SyncBackend):
    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.NetworkStream:
        source = None if local_address is None else (local_address, 0)
        try:
            sock = socket.create_connection((host, port), timeout, source_address=source)
        except TimeoutError as error:
            raise httpcore.ConnectTimeout(str(error)) from error
        except OSError as error:
            raise httpcore.ConnectError(str(error)) from error
        return _configured(sock, socket_options, nodelay=True)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.NetworkStream:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except TimeoutError as error:
            sock.close()
            raise httpcore.ConnectTimeout(str(error)) from error
        except OSError as error:
            sock.close()
            raise httpcore.ConnectError(str(error)) from error
        return _configured(sock, socket_options, nodelay=False)


def _configured(
    sock: socket.socket, options: Iterable[SocketOption] | None, *, nodelay: bool
) -> BodyStream:
    """``sock``, connected, with ``options`` set (and ``TCP_NODELAY``, as httpcore does)."""
    try:
        for option in options or ():
            sock.setsockopt(*option)
        if nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as error:
        sock.close()
        raise httpcore.ConnectError(str(error)) from error
    return BodyStream(sock)


class _AsyncStream(httpcore.AsyncNetworkStream):
    """anyio's stream as httpcore wraps it, with large reads."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max(max_bytes, ASYNC_READ_BYTES), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> object:
        return self._stream.get_extra_info(info)


class _AsyncBackend(httpcore.AnyIOBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await super().connect_tcp(host, port, timeout, local_address, socket_options)
        return _AsyncStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _AsyncStream(await super().connect_unix_socket(path, timeout, socket_options))

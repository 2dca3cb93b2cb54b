"""The httpx transports ``connect`` gives its clients: Unix socket or TCP, bounded pools.

One fix lives here. httpcore 1.0's blocking backend does not close a Unix
socket whose ``connect`` fails (its asyncio backend, anyio, does): each call
made while the daemon is down or restarting would leave a socket to the
garbage collector and a ``ResourceWarning``. ``UnixTransport`` is httpx's own
transport with a backend that closes it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

import httpcore
import httpx
from httpcore._backends.sync import SyncStream  # what SyncBackend itself returns

# As httpcore spells it (setsockopt's argument forms).
SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)


def limits(max_connections: int) -> httpx.Limits:
    # Keep every connection alive: a busy engine would otherwise reconnect per call.
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)


def transport(uds: str | None, max_connections: int) -> httpx.BaseTransport:
    if uds is None:
        return httpx.HTTPTransport(limits=limits(max_connections))
    return UnixTransport(uds, limits(max_connections))


def async_transport(uds: str | None, max_connections: int) -> httpx.AsyncBaseTransport:
    return httpx.AsyncHTTPTransport(uds=uds, limits=limits(max_connections))


class UnixTransport(httpx.HTTPTransport):
    """``httpx.HTTPTransport(uds=path)`` whose failed connects close their socket."""

    def __init__(self, path: str, pool_limits: httpx.Limits) -> None:
        super().__init__(uds=path, limits=pool_limits)
        self._pool = httpcore.ConnectionPool(
            max_connections=pool_limits.max_connections,
            max_keepalive_connections=pool_limits.max_keepalive_connections,
            keepalive_expiry=pool_limits.keepalive_expiry,
            uds=path,
            network_backend=_UnixBackend(),
        )


class _UnixBackend(httpcore.SyncBackend):
    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.NetworkStream:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.settimeout(timeout)
            sock.connect(path)
        except TimeoutError as error:
            sock.close()
            raise httpcore.ConnectTimeout(str(error)) from error
        except OSError as error:
            sock.close()
            raise httpcore.ConnectError(str(error)) from error
        return SyncStream(sock)

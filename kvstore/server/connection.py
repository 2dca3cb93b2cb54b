"""What a request's connection is: its socket, and whether it came over the Unix socket.

Several routes behave differently for a same-host client (shared-memory gets,
unsealed puts, no bearer token, a wider send buffer), and all ask here.
"""

from __future__ import annotations

import socket
from asyncio.trsock import TransportSocket

from aiohttp import web


def connection_socket(request: web.Request) -> TransportSocket | None:
    """The socket ``request`` arrived on, as asyncio lends it (``None`` once the
    connection is gone)."""
    transport = request.transport
    return transport.get_extra_info("socket") if transport is not None else None


def is_local(request: web.Request) -> bool:
    """Whether the request came over the Unix socket (the same host, the same user:
    the socket file is 0600)."""
    sock = connection_socket(request)
    return sock is not None and sock.family == socket.AF_UNIX

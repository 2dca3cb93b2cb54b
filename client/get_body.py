"""A bytes get's response body read straight off the socket, past h11 (blocking transports:
``StoreClient``, and ``AsyncStoreClient`` on a worker thread, ``client.blocking``).

Why: through httpx, every byte of a get's body passed through h11's receive
buffer (appended, then cut out: two copies) and was then copied a third time,
into its block's buffer (``client.blocks.FramesSink.feed``). Read with
``recv_into`` straight into the block's buffer, the kernel's copy is the only
one, and each 256 KiB step is checksummed on the same thread while it is
still in cache (``kvstore.block.fill_verified``), as the daemon reads put
bodies (``kvstore.server.borrowed_body``).

How the body is taken from httpx::

    _Stream.write           a request goes out: the next reads are a response head
    _Stream.read            cuts its data after the head's blank line and keeps
                            the rest (``pending``), so h11 never buffers a byte
                            of the body
    httpx (stream=True)     returns the response after its head
    open_body(response)     the connection's stream (httpcore's ``network_stream``
                            extension), its pending bytes, then the socket,
                            for exactly ``Content-Length`` bytes
    response.close()        h11 never saw the body, so its state is not DONE,
                            and httpcore closes the connection rather than
                            reuse it: one reconnect per get (~0.1 ms)

Only a ``200`` with a ``Content-Length`` and no transfer or content coding is
read this way (the daemon always sends one for a frames get); anything else,
and an asyncio client without a blocking transport, streams through h11. A response head
preceded by an interim ``1xx`` would be cut at the interim's blank line; the
daemon sends none (httpx never asks ``Expect: 100-continue``), and if one
came the rest would stay in h11 and the frames parse or a checksum would fail:
misses, never a wrong block.
"""

from __future__ import annotations

import socket
import struct
import sys

import httpx

from kvstore.client.transports import BodyStream
from kvstore.wire.body import BodyReader

# MSG_WAITALL: the kernel fills a whole step in one call (one syscall and one
# trip through Python per 256 KiB, rather than one per segment that arrived).
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


class SocketBody(BodyReader):
    """The ``length`` bytes of a response body: ``pending`` first, then the socket.

    Blocking, with ``timeout_s`` as the most a single read may wait without a
    byte arriving. The connection failing raises httpx's errors (``ReadError``,
    ``ReadTimeout``), which the shell translates at its one boundary
    (``client.failures``); a read past ``length`` is a malformed body
    (``WireError``). ``sock`` is left blocking, with a receive timeout: the
    connection is closed after this body (the module docstring).
    """

    def __init__(
        self,
        sock: socket.socket,
        pending: bytes,
        length: int,
        timeout_s: float | None,
        request: httpx.Request,
    ) -> None:
        super().__init__(pending, length)
        self._sock = sock
        self._request = request
        # Blocking, with the kernel's receive timeout: a MSG_WAITALL read then
        # waits for the whole step, or returns what came before the timeout.
        sock.settimeout(None)
        if timeout_s is not None and sys.platform.startswith("linux"):
            seconds = int(timeout_s)
            micros = int((timeout_s - seconds) * 1e6)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, micros)
            )
        elif timeout_s is not None:
            sock.settimeout(timeout_s)  # elsewhere: Python's poll-then-read

    def _receive(self, view: memoryview) -> int:
        try:
            received = self._sock.recv_into(view, 0, _WAITALL)
        except (BlockingIOError, TimeoutError):
            raise httpx.ReadTimeout(
                "no body bytes within the timeout", request=self._request
            ) from None
        except OSError as error:
            raise httpx.ReadError(
                f"connection failed mid-body: {error}", request=self._request
            ) from error
        if received == 0:
            raise httpx.ReadError("the daemon hung up mid-body", request=self._request)
        return received


def open_body(response: httpx.Response) -> SocketBody | None:
    """``response``'s body to read off the socket, or ``None`` if it must go
    through h11 (see the module docstring for which responses qualify)."""
    stream = response.extensions.get("network_stream")
    headers = response.headers
    if not isinstance(stream, BodyStream) or "transfer-encoding" in headers:
        return None
    if headers.get("content-encoding", "identity").lower() != "identity":
        return None
    try:
        length = int(headers["content-length"])
    except (KeyError, ValueError):
        return None
    pending = stream.take_body_start()
    if length <= 0 or pending is None or len(pending) > length:
        if pending is not None:
            stream.give_back(pending)  # h11 reads it after all
        return None
    timeout = response.request.extensions.get("timeout", {}).get("read")
    return SocketBody(stream.socket, pending, length, timeout, response.request)

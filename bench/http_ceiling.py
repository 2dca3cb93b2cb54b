"""The socket paths' ceiling: a bare aiohttp app in its own process, and its client.

``bench/daemon.py`` measures the daemon's Unix-socket and TCP paths against
the best the same transports do with nothing of kvstore around them: this
app answers a get with a same-size body written one chunk at a time (as the
daemon writes one block at a time), from distinct, touched memory, and reads
and discards a put's body; ``BareHTTP`` drives it with the httpx transport,
pool, timeout and headers ``kvstore.connect`` gives a ``StoreClient``, and
reads a get's body the way that client does: straight off the socket with
``recv_into`` (``kvstore.client.get_body``), here into one preallocated,
touched buffer (the memory a caller's ``out=`` would be), nothing verified.

    python bench/http_ceiling.py SOCKET PORT   # what ceiling_process starts
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ServerProcess  # noqa: E402

from kvstore.client.get_body import open_body  # noqa: E402
from kvstore.client.transports import transport  # noqa: E402
from kvstore.local.processes import HOST, free_port  # noqa: E402
from kvstore.server.get_frames import widen_send_buffer  # noqa: E402


def ceiling_process(root: Path) -> tuple[ServerProcess, int]:
    """The bare app (this file, run as a script) on ``root/ceiling.sock`` and a free
    loopback port; returns the process (not yet started) and the port."""
    port = free_port()
    socket_path = root / "ceiling.sock"
    argv = [sys.executable, __file__, str(socket_path), str(port)]
    return ServerProcess("ceiling server", argv, socket_path, root / "ceiling.log"), port


def serve_ceiling(socket_path: str, port: int) -> None:
    """A minimal aiohttp app on a Unix socket and a TCP port, until SIGTERM/SIGINT.

    ``POST /get?nbytes=N&piece=P`` answers N bytes written P at a time, from
    distinct random memory (a zero-filled buffer could be served from the one
    zero page); ``POST /put`` reads its body and discards it.
    """
    bodies: dict[int, bytes] = {}

    def body_of(nbytes: int) -> memoryview:
        if nbytes not in bodies:
            bodies.clear()  # one size at a time
            bodies[nbytes] = np.random.default_rng(nbytes).bytes(nbytes)
        return memoryview(bodies[nbytes])

    async def get(request: web.Request) -> web.StreamResponse:
        nbytes, piece = int(request.query["nbytes"]), int(request.query["piece"])
        body = body_of(nbytes)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = nbytes
        widen_send_buffer(request)  # the daemon's socket settings for a get
        await response.prepare(request)
        for start in range(0, nbytes, piece):
            await response.write(body[start : start + piece])
        await response.write_eof()
        return response

    async def put(request: web.Request) -> web.Response:
        received = 0
        while data := await request.content.readany():
            received += len(data)
        return web.json_response({"received": received})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/get", get)
        app.router.add_post("/put", put)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await web.TCPSite(runner, HOST, port).start()
            await web.UnixSite(runner, socket_path).start()  # last: healthz means all up
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


class BareHTTP:
    """httpx against the bare app, with the transport and settings ``connect`` gives
    a ``StoreClient`` (same pool, timeout, and bearer header over TCP)."""

    def __init__(self, uds: str | None, base_url: str, token: str | None, timeout_s: float) -> None:
        self._http = httpx.Client(
            base_url=base_url,
            transport=transport(uds, 64),
            timeout=httpx.Timeout(timeout_s),
            headers={"Authorization": f"Bearer {token}"} if token else None,
        )
        self._into = memoryview(bytearray(0))

    def get(self, nbytes: int, piece: int) -> int:
        """Fetch an ``nbytes`` body into this client's buffer, read off the socket as
        the store client reads a get; how many bytes came."""
        if self._into.nbytes < nbytes:
            self._into = memoryview(np.ones(nbytes, dtype=np.uint8).data)  # touched
        request = self._http.build_request(
            "POST", "/get", params={"nbytes": nbytes, "piece": piece}
        )
        response = self._http.send(request, stream=True)
        received = 0
        try:
            body = open_body(response)
            if body is None:
                raise RuntimeError("bare get: the body could not be read off the socket")
            received = body.remaining
            body.readinto(self._into[:received])
        finally:
            response.close()
        if response.status_code != 200 or received != nbytes:
            raise RuntimeError(f"bare get: HTTP {response.status_code}, {received} bytes")
        return received

    def put(self, pieces: Sequence[memoryview]) -> None:
        """Send ``pieces`` as one body, piece by piece (not joined), with a length."""
        length = sum(piece.nbytes for piece in pieces)
        content: Any = iter(pieces)  # bytes-like views; httpx's hint says bytes
        response = self._http.post(
            "/put",
            content=content,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(length)},
        )
        if response.status_code != 200 or response.json()["received"] != length:
            raise RuntimeError(f"bare put: HTTP {response.status_code} {response.text[:200]}")

    def close(self) -> None:
        self._http.close()


if __name__ == "__main__":
    serve_ceiling(sys.argv[1], int(sys.argv[2]))

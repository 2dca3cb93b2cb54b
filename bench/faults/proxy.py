"""A TCP fault proxy: what a slow, hung or broken network does to a Redis client,
made on demand between the client and a real ``redis-server``.

::

    client ──► FaultProxy (127.0.0.1:port) ──► upstream (a redis-server)
                 │ per connection, each way: read ─► queue ─► send
                 └ set(Fault.X, ...) / clear(), from any thread

The modes, as toxiproxy names its toxics (``latency``, ``timeout``,
``reset_peer``, ``bandwidth``) and as a client meets them in production:

* ``NONE``: pass-through.
* ``LATENCY``: every chunk read is sent ``delay_s`` after it arrived, each way.
  Chunks are stamped on arrival and queued, so the delay does not add up
  along a long reply and the link's throughput is kept (a long path, not a
  slow one).
* ``STALL``: nothing is read or sent, on old and new connections alike; new
  ones are still accepted. A hung server (``SIGSTOP``): the client's requests
  sit in the socket buffers unanswered. ``clear()`` resumes every connection
  where it stopped, as ``SIGCONT`` does.
* ``RESET``: every established connection is reset (``SO_LINGER`` 0, so the
  close sends RST), and every new one is accepted and reset at once: the
  client's connect succeeds and its first read fails with ``ECONNRESET``,
  as after a server crash or a middlebox that drops the flow.
* ``BANDWIDTH``: each way of each connection is paced to ``bytes_per_s``.
  Every chunk is sent in slices of a twentieth of a second's worth, so a
  client reading with a per-read timeout sees bytes trickle in, never a gap.
* ``HALF_OPEN``: everything read is dropped, nothing is ever answered, and no
  connection is closed by the proxy. A connection that was open during the
  fault stays such a black hole after ``clear()`` (its peer is gone, as
  after a lost NAT entry or a host that vanished); only connections made
  after it pass again. A client learns of it only by its own timeout.

Bounded: at most ``max_connections`` links at once (one more is reset on
accept), and at most ``QUEUE_CHUNKS`` reads of ``READ_BYTES`` queued per
direction of a link, so the proxy buffers at most
``max_connections * 2 * QUEUE_CHUNKS * READ_BYTES`` bytes. Everything runs on
one asyncio loop in one thread; ``close()`` (or leaving the ``with`` block)
closes the listener and every socket, and joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from kvstore.local.processes import HOST

# One read from a socket; a queued chunk is at most this long.
READ_BYTES = 64 << 10
# Chunks read but not yet sent, per direction of a link: the proxy's memory bound.
QUEUE_CHUNKS = 16
# A paced chunk goes out in slices of this fraction of a second's bytes.
PACING_STEPS_PER_S = 20
# How long a new link waits to reach the upstream before the client is reset.
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# How long set() and close() wait for the proxy's loop to act on them.
CONTROL_TIMEOUT_S = 10.0


class Fault(enum.Enum):
    """What the proxy does to the bytes (see the module docstring)."""

    NONE = "none"
    LATENCY = "latency"
    STALL = "stall"
    RESET = "reset"
    BANDWIDTH = "bandwidth"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """The fault in force and its parameter (``delay_s`` for ``LATENCY``,
    ``bytes_per_s`` for ``BANDWIDTH``)."""

    fault: Fault = Fault.NONE
    delay_s: float = 0.0
    bytes_per_s: int = 0

    def __post_init__(self) -> None:
        if self.fault is Fault.LATENCY and self.delay_s <= 0:
            raise ValueError("a latency fault needs delay_s > 0")
        if self.fault is Fault.BANDWIDTH and self.bytes_per_s <= 0:
            raise ValueError("a bandwidth fault needs bytes_per_s > 0")


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream connection. Owned by the proxy's loop."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    # Set when a half-open fault caught the link: it drops everything from then on.
    blackholed: bool = False

    def close(self) -> None:
        self.client.close()
        if self.upstream is not None:
            self.upstream.close()

    def reset(self) -> None:
        _reset(self.client)
        if self.upstream is not None:
            self.upstream.transport.abort()


@dataclass
class _Pacer:
    """When the next slice of a bandwidth-capped direction may go out (loop time)."""

    next_at: float = 0.0


@dataclass
class ProxyCounters:
    """What the proxy did since it started; written by its loop only."""

    accepted: int = 0  # client connections linked to the upstream (or black-holed)
    reset_on_accept: int = 0  # refused: a reset fault, the link limit, no upstream
    reset_established: int = 0  # links reset by a reset fault
    bytes_forwarded: int = 0
    bytes_dropped: int = 0  # read and thrown away by a half-open fault


class FaultProxy:
    """Listens on a free loopback port and forwards to ``upstream_host:upstream_port``
    under the fault set with ``set`` (thread safe; in force when it returns).

    A context manager: started on entry (``port`` is known from then on),
    closed on exit.
    """

    def __init__(
        self, upstream_port: int, upstream_host: str = HOST, *, max_connections: int = 64
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.max_connections = max_connections
        self.port = 0  # known once started
        self.counters = ProxyCounters()
        # Written on the loop only (by ``_apply``); read by the pumps and ``settings``.
        self._settings = FaultSettings()
        # Set and replaced at every change of settings: what a stalled pump waits on.
        self._changed: asyncio.Event | None = None
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` a client connects to instead of the upstream."""
        return f"{HOST}:{self.port}"

    @property
    def settings(self) -> FaultSettings:
        return self._settings

    @property
    def open_links(self) -> int:
        return len(self._links)

    # -- control (any thread) --------------------------------------------------------

    def start(self) -> None:
        """Bind the listener and start the loop's thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(CONTROL_TIMEOUT_S):
            raise RuntimeError("the fault proxy did not start")
        if self._start_error is not None:
            raise RuntimeError("the fault proxy did not start") from self._start_error

    def set(self, fault: Fault, *, delay_s: float = 0.0, bytes_per_s: int = 0) -> None:
        """Put ``fault`` in force; when this returns, old and new connections see it."""
        self._call(self._apply(FaultSettings(fault, delay_s, bytes_per_s)))

    def clear(self) -> None:
        """Back to pass-through (links black-holed by a half-open fault stay so)."""
        self.set(Fault.NONE)

    def close(self) -> None:
        """Close the listener and every link, stop the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended on its own
                loop.call_soon_threadsafe(stopping.set)
        thread.join(CONTROL_TIMEOUT_S)
        if thread.is_alive():
            raise RuntimeError("the fault proxy's thread did not stop")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, change: Coroutine[Any, Any, None]) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            change.close()
            raise RuntimeError("the fault proxy is not running")
        done: Future[None] = asyncio.run_coroutine_threadsafe(change, loop)
        done.result(CONTROL_TIMEOUT_S)

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        try:
            server = await asyncio.start_server(
                self._on_client, HOST, 0, backlog=self.max_connections
            )
        except OSError as error:
            self._start_error = error
            self._started.set()
            return
        self.port = int(server.sockets[0].getsockname()[1])
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for link in list(self._links):
                link.close()
            current = asyncio.current_task()
            tasks = [task for task in asyncio.all_tasks() if task is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.wait_closed()

    async def _apply(self, settings: FaultSettings) -> None:
        self._settings = settings
        if settings.fault is Fault.RESET:
            for link in list(self._links):
                link.reset()
                self.counters.reset_established += 1
        elif settings.fault is Fault.HALF_OPEN:
            for link in self._links:
                link.blackholed = True
        assert self._changed is not None
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _while_stalled(self) -> None:
        while self._settings.fault is Fault.STALL:
            assert self._changed is not None
            await self._changed.wait()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        settings = self._settings
        if settings.fault is Fault.RESET or len(self._links) >= self.max_connections:
            self.counters.reset_on_accept += 1
            _reset(writer)
            return
        link = _Link(writer, blackholed=settings.fault is Fault.HALF_OPEN)
        self._links.add(link)
        try:
            if link.blackholed:
                self.counters.accepted += 1
                await self._drop_until_eof(reader)
                return
            try:
                upstream_reader, link.upstream = await asyncio.wait_for(
                    asyncio.open_connection(self.upstream_host, self.upstream_port),
                    UPSTREAM_CONNECT_TIMEOUT_S,
                )
            except (OSError, TimeoutError):
                self.counters.reset_on_accept += 1
                _reset(writer)
                return
            self.counters.accepted += 1
            await self._pump(link, reader, upstream_reader)
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(
        self, link: _Link, client: asyncio.StreamReader, upstream: asyncio.StreamReader
    ) -> None:
        """Forward both ways until the client goes, or the upstream does (unless the
        link is a black hole, which never closes on the client)."""
        assert link.upstream is not None
        to_upstream = asyncio.create_task(self._forward(link, client, link.upstream))
        to_client = asyncio.create_task(self._forward(link, upstream, link.client))
        try:
            done, _ = await asyncio.wait(
                {to_upstream, to_client}, return_when=asyncio.FIRST_COMPLETED
            )
            if to_client in done and link.blackholed:
                await to_upstream
        finally:
            to_upstream.cancel()
            to_client.cancel()
            await asyncio.gather(to_upstream, to_client, return_exceptions=True)

    async def _drop_until_eof(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(READ_BYTES):
                self.counters.bytes_dropped += len(data)

    async def _forward(
        self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter
    ) -> None:
        """One direction: read, stamp, queue; ``_send`` delivers. Ends at EOF or error."""
        assert self._loop is not None
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUE_CHUNKS)
        sending = asyncio.create_task(self._send(link, queue, sink))
        try:
            while True:
                await self._while_stalled()
                data = await source.read(READ_BYTES)
                if not data:
                    break
                if link.blackholed:
                    self.counters.bytes_dropped += len(data)
                    continue
                settings = self._settings
                delay = settings.delay_s if settings.fault is Fault.LATENCY else 0.0
                await queue.put((self._loop.time() + delay, data))
            await queue.put(None)
            await sending
        except OSError:
            return
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)

    async def _send(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        sink: asyncio.StreamWriter,
    ) -> None:
        assert self._loop is not None
        pacer = _Pacer()
        while (item := await queue.get()) is not None:
            due, data = item
            wait = due - self._loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._send_paced(link, memoryview(data), sink, pacer)

    async def _send_paced(
        self, link: _Link, data: memoryview, sink: asyncio.StreamWriter, pacer: _Pacer
    ) -> None:
        """Send ``data``: whole, or in slices at the capped rate while a bandwidth
        fault is in force; held while stalled, dropped once the link is a black hole."""
        assert self._loop is not None
        while data:
            await self._while_stalled()
            if link.blackholed:
                self.counters.bytes_dropped += len(data)
                return
            settings = self._settings
            if settings.fault is not Fault.BANDWIDTH:
                piece = data
            else:
                rate = settings.bytes_per_s
                piece = data[: max(1, rate // PACING_STEPS_PER_S)]
                wait = pacer.next_at - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # the fault may have changed while asleep
                pacer.next_at = self._loop.time() + len(piece) / rate
            sink.write(piece)
            await sink.drain()
            self.counters.bytes_forwarded += len(piece)
            data = data[len(piece) :]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with an RST instead of a FIN (``SO_LINGER`` 0)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()

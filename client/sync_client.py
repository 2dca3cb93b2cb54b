"""``StoreClient``: the daemon's client for threads. I/O only; the logic is in
``client.protocol``, shared with ``AsyncStoreClient`` line for line."""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from time import monotonic
from typing import Concatenate, ParamSpec

import httpx

from kvstore.client.blocking import send
from kvstore.client.exchange import MAX_DETACHED_CALLS, Call, Operation, Reply, T
from kvstore.client.failures import ClientStats, from_reply
from kvstore.client.protocol import DEFAULTS, ClientOptions, ClientProtocol
from kvstore.errors import KVStoreError
from kvstore.store.closing import Closing

log = logging.getLogger("kvstore.client")

P = ParamSpec("P")


def operation(
    make: Callable[Concatenate[ClientProtocol, P], Operation[T]],
) -> Callable[Concatenate[StoreClient, P], T]:
    """``ClientProtocol``'s operation ``make`` as a method: its signature, its docstring,
    driven to its result over this client's I/O."""

    @functools.wraps(make)
    def call(self: StoreClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(make(self._protocol, *args, **kwargs))

    return call


class StoreClient(Closing):
    """A blocking client of ``kvstore serve``: ``TieredStore``'s methods and return types.

    Thread safe: share one per process; httpx pools the connections.
    Failures degrade or raise as ``client.failures`` draws it: ``lookup``,
    ``get``, ``put`` and the session events never raise for a daemon that is
    down or slow (they answer nothing cached / misses / dropped within
    ``timeout_s`` per I/O phase, and count it in ``client_stats()``), while a
    wrong request raises its ``KVStoreError``. Usually made by
    ``kvstore.connect``; tests pass their own httpx ``transport``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        transport: httpx.BaseTransport | None = None,
        options: ClientOptions = DEFAULTS,
    ) -> None:
        self._http = httpx.Client(transport=transport, **options.http(base_url))
        self._protocol = options.protocol()
        # Calls nothing waits for (``Call.wait``): sent by these threads, at most
        # MAX_DETACHED_CALLS at once; close() waits for them.
        self._detached = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-detached")
        self._detached_slots = threading.BoundedSemaphore(MAX_DETACHED_CALLS)
        # Calls held back (``Call.delay_s``), sent, if still due, by its one thread.
        self._delayed = _Delayed(self._send_delayed)

    # -- the API (``client.api.KVClientAPI``): the protocol's operations, driven --------

    lookup = operation(ClientProtocol.lookup)
    put = operation(ClientProtocol.put)
    get = operation(ClientProtocol.get)
    delete = operation(ClientProtocol.delete)
    stats = operation(ClientProtocol.stats)
    request_started = operation(ClientProtocol.request_started)
    request_finished = operation(ClientProtocol.request_finished)

    # -- lifecycle ------------------------------------------------------------------

    def client_stats(self) -> ClientStats:
        """What this client degraded instead of raising (``ClientStats``)."""
        return self._protocol.client_stats()

    def close(self) -> None:
        self._delayed.close()  # sends what is still due now, not after its delay
        self._detached.shutdown(wait=True)
        self._http.close()
        self._protocol.close()

    # -- I/O --------------------------------------------------------------------------

    def _run(self, operation: Operation[T]) -> T:
        """Drive one operation of ``ClientProtocol`` to its result."""
        with contextlib.closing(operation):
            try:
                call = next(operation)
                while True:
                    try:
                        reply = self._exchange(call)
                    except KVStoreError as error:
                        call = operation.throw(error)
                    else:
                        call = operation.send(reply)
            except StopIteration as stop:
                result: T = stop.value
                return result

    def _exchange(self, call: Call) -> Reply:
        if not call.wait and call.delay_s > 0 and self._delayed.hold(call):
            return Reply(202)
        if not call.wait and self._detached_slots.acquire(blocking=False):
            self._detached.submit(self._send_detached, call)
            return Reply(202)
        if call.due is not None and not call.due():
            return Reply(202)
        return self._send(call)

    def _send_detached(self, call: Call) -> None:
        try:
            self._send_delayed(call)
        finally:
            self._detached_slots.release()

    def _send_delayed(self, call: Call) -> None:
        """Send a call nothing waits for, if it is still due; log how it went."""
        try:
            if call.due is not None and not call.due():
                return
            reply = self._send(call)
            if reply.status != 200:
                raise from_reply(reply.status, reply.content)
        except KVStoreError as error:
            log.debug("%s %s (sent in the background) failed: %s", call.method, call.path, error)

    def _send(self, call: Call) -> Reply:
        return send(self._http, call)


class _Delayed:
    """Calls held back until ``Call.delay_s`` has passed, then handed to ``send``.

    One thread, started with the first call, sleeps until the earliest is due.
    It is woken early only by a call due before all the others (with one
    delay for all, only one arriving to an empty queue) and at ``close``, so
    a client that gets continuously costs it one short wake-up per call,
    most of which find the call no longer due (a get took its lease). The
    queue holds calls, not threads or slots: a burst of gets never makes a
    release wait for room, and the daemon bounds the leases, hence the calls.
    """

    def __init__(self, send: Callable[[Call], None]) -> None:
        self._send = send
        self._wake = threading.Condition()
        self._queue: list[tuple[float, int, Call]] = []
        self._order = itertools.count()  # ties keep arrival order; calls never compare
        self._thread: threading.Thread | None = None
        self._closed = False

    def hold(self, call: Call) -> bool:
        """Queue ``call``; ``False`` once closed (the caller sends it itself)."""
        with self._wake:
            if self._closed:
                return False
            heapq.heappush(self._queue, (monotonic() + call.delay_s, next(self._order), call))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvstore-delayed", daemon=True
                )
                self._thread.start()
            elif self._queue[0][2] is call:  # due before any other: sleep less
                self._wake.notify()
        return True

    def close(self) -> None:
        """Send every call still queued now, and stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._queue or self._queue[0][0] > monotonic()):
                    self._wake.wait(self._queue[0][0] - monotonic() if self._queue else None)
                if not self._queue:  # closed, and nothing left
                    return
                _, _, call = heapq.heappop(self._queue)
            try:
                self._send(call)
            except Exception:  # never lose the thread, and with it every call queued
                log.exception("%s %s (delayed) failed", call.method, call.path)

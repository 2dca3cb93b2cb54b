"""``AsyncStoreClient``: the daemon's client for asyncio. I/O only; the logic is in
``client.protocol``, shared with ``StoreClient`` line for line."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec

import httpx

from kvstore.client.blocking import STALE_CONNECTION, send
from kvstore.client.exchange import MAX_DETACHED_CALLS, Call, Operation, Reply, T
from kvstore.client.failures import ClientStats, from_reply, from_transport
from kvstore.client.protocol import DEFAULTS, ClientOptions, ClientProtocol
from kvstore.client.put_body import PutBody
from kvstore.errors import KVStoreError
from kvstore.store.closing import AsyncClosing

log = logging.getLogger("kvstore.client")

P = ParamSpec("P")


def operation(
    make: Callable[Concatenate[ClientProtocol, P], Operation[T]],
) -> Callable[Concatenate[AsyncStoreClient, P], Coroutine[Any, Any, T]]:
    """``ClientProtocol``'s operation ``make`` as a coroutine method: its signature, its
    docstring, driven to its result over this client's I/O."""

    @functools.wraps(make)
    async def call(self: AsyncStoreClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(make(self._protocol, *args, **kwargs))

    return call


class AsyncStoreClient(AsyncClosing):
    """An asyncio client of ``kvstore serve``: ``TieredStore``'s methods, awaitable.

    Share one per event loop; httpx pools the connections. Verification and
    shared-memory copies run on the loop (they are memory bandwidth, not waits).
    With a ``blocking_transport`` (``connect_async`` gives one), bytes gets and
    puts go over it on a worker thread, as ``StoreClient`` sends them
    (``client.blocking``); the loop stays free meanwhile.
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
        transport: httpx.AsyncBaseTransport | None = None,
        blocking_transport: httpx.BaseTransport | None = None,
        options: ClientOptions = DEFAULTS,
    ) -> None:
        self._http = httpx.AsyncClient(transport=transport, **options.http(base_url))
        self._blocking = (
            None
            if blocking_transport is None
            else httpx.Client(transport=blocking_transport, **options.http(base_url))
        )
        self._protocol = options.protocol()
        # Calls nothing waits for (``Call.wait``): tasks, at most MAX_DETACHED_CALLS
        # at once; close() waits for them.
        self._detached: set[asyncio.Task[None]] = set()
        # Calls held back (``Call.delay_s``): timers, which close() fires at once.
        self._delayed: dict[asyncio.TimerHandle, Call] = {}

    # -- the API (``client.api.AsyncKVClientAPI``): the protocol's operations, driven ---

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

    async def close(self) -> None:
        delayed, self._delayed = self._delayed, {}
        for timer, call in delayed.items():
            timer.cancel()
            self._start_detached(call)
        await asyncio.gather(*self._detached)
        await self._http.aclose()
        if self._blocking is not None:
            self._blocking.close()
        self._protocol.close()

    # -- I/O --------------------------------------------------------------------------

    async def _run(self, operation: Operation[T]) -> T:
        """Drive one operation of ``ClientProtocol`` to its result."""
        with contextlib.closing(operation):
            try:
                call = next(operation)
                while True:
                    try:
                        reply = await self._exchange(call)
                    except KVStoreError as error:
                        call = operation.throw(error)
                    else:
                        call = operation.send(reply)
            except StopIteration as stop:
                result: T = stop.value
                return result

    async def _exchange(self, call: Call) -> Reply:
        if not call.wait and call.delay_s > 0:
            self._hold(call)
            return Reply(202)
        if not call.wait and len(self._detached) < MAX_DETACHED_CALLS:
            self._start_detached(call)
            return Reply(202)
        if call.due is not None and not call.due():
            return Reply(202)
        return await self._send(call)

    def _hold(self, call: Call) -> None:
        """Send ``call`` in the background after its delay, if it is still due then.
        A timer, not a sleeping task: most never send anything (a get took the
        lease), and a timer is the cheapest way to find that out."""

        def fire() -> None:
            if self._delayed.pop(timer, None) is not None and (call.due is None or call.due()):
                self._start_detached(dataclasses.replace(call, due=None))  # claimed just now

        timer = asyncio.get_running_loop().call_later(call.delay_s, fire)
        self._delayed[timer] = call

    def _start_detached(self, call: Call) -> None:
        task = asyncio.create_task(self._send_detached(call))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _send_detached(self, call: Call) -> None:
        try:
            if call.due is not None and not call.due():
                return
            reply = await self._send(call)
            if reply.status != 200:
                raise from_reply(reply.status, reply.content)
        except KVStoreError as error:
            log.debug("%s %s (sent in the background) failed: %s", call.method, call.path, error)

    async def _send(self, call: Call) -> Reply:
        if self._blocking is not None and (call.sink is not None or call.body is not None):
            return await _to_the_end(asyncio.to_thread(send, self._blocking, call))
        try:
            response = await self._open(call)
            try:
                if response.status_code == 200 and call.sink is not None:
                    async for data in response.aiter_bytes():
                        call.sink.feed(data)
                    call.sink.finish()
                    return Reply(200)
                return Reply(response.status_code, await response.aread())
            finally:
                await response.aclose()
        except httpx.HTTPError as error:
            raise from_transport(error) from error

    async def _open(self, call: Call) -> httpx.Response:
        """Send ``call``; the response's body is left unread."""
        try:
            return await self._http.send(self._request(call), stream=True)
        except STALE_CONNECTION:
            if not call.retry:
                raise
            return await self._http.send(self._request(call), stream=True)

    def _request(self, call: Call) -> httpx.Request:
        content: Any = call.content if call.body is None else _pieces(call.body)
        return self._http.build_request(
            call.method, call.path, json=call.json, content=content, headers=call.headers
        )


async def _to_the_end(sending: Awaitable[Reply]) -> Reply:
    """The worker's reply. Cancelled meanwhile, still wait for the worker before
    raising: it writes into the caller's buffers (a get's ``out=``) or reads them
    (a put's chunks), and nothing may once the call has returned. The client's
    timeout bounds the wait."""
    future = asyncio.ensure_future(sending)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


async def _pieces(body: PutBody) -> AsyncIterator[bytes | memoryview]:
    """A frames body as the async iterable httpx's ``AsyncClient`` sends (each block
    is hashed as it is reached, on the loop, as the whole batch was before)."""
    for piece in body:
        yield piece

"""Both client flavours behind one awaitable face, so each scenario is written once.

A scenario is an ``async def`` run with ``asyncio.run``; for the ``"async"``
flavour it awaits ``AsyncStoreClient`` methods, for ``"sync"`` it calls the
blocking ``StoreClient`` in place (blocking the scenario's own loop, which
runs nothing else). Threads get a loop each (``run_in_threads``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kvstore

FLAVOURS = ("sync", "async")


class Face:
    """Awaitable calls on a sync or async client (or anything with the same methods)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return call


@contextlib.asynccontextmanager
async def opened(flavour: str, url: str, **options: Any) -> AsyncIterator[Face]:
    """``kvstore.connect`` (sync) or ``connect_async`` (async), closed on exit."""
    connect = kvstore.connect if flavour == "sync" else kvstore.connect_async
    face = Face(connect(url, **options))
    try:
        yield face
    finally:
        await face.close()


def run_in_threads(count: int, worker: Callable[[int], Awaitable[None]]) -> None:
    """``worker(i)`` for each ``i`` on a thread of its own, each with its own loop."""
    with ThreadPoolExecutor(count) as pool:
        for future in [pool.submit(asyncio.run, worker(i)) for i in range(count)]:
            future.result()

"""``AsyncTieredStore``: the asyncio face of ``TieredStore``.

One design, two faces (as httpx pairs ``Client`` and ``AsyncClient``): all
logic lives in the synchronous store, which is thread safe and releases the
GIL in its copies, hashing and backend I/O; each async method runs the same
call in a worker thread so the event loop never blocks on LMDB or Redis.

The methods are not written out again: each is ``threaded(TieredStore.<name>)``,
with that method's signature, types and docstring, so the two faces cannot
drift apart (``tests/client/test_api.py`` checks that every public operation of
``TieredStore`` has its awaitable twin here).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstore.store.closing import AsyncClosing
from kvstore.store.config import StoreConfig
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.tiered_store import TieredStore

P = ParamSpec("P")
T = TypeVar("T")


def threaded(
    method: Callable[Concatenate[TieredStore, P], T],
) -> Callable[Concatenate[AsyncTieredStore, P], Coroutine[Any, Any, T]]:
    """``TieredStore``'s ``method``, awaitable: run on a worker thread."""

    @functools.wraps(method)
    async def call(self: AsyncTieredStore, *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.to_thread(method, self.sync, *args, **kwargs)

    return call


class AsyncTieredStore(AsyncClosing):
    """Awaitable mirror of ``TieredStore``; same methods, same return types."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
        store: TieredStore | None = None,
    ) -> None:
        self.sync = store if store is not None else TieredStore(config, policy=policy)

    lookup = threaded(TieredStore.lookup)
    put = threaded(TieredStore.put)
    get = threaded(TieredStore.get)
    delete = threaded(TieredStore.delete)
    demote = threaded(TieredStore.demote)
    promote = threaded(TieredStore.promote)
    pin = threaded(TieredStore.pin)
    unpin = threaded(TieredStore.unpin)
    scrub = threaded(TieredStore.scrub)
    flush = threaded(TieredStore.flush)
    write_back = threaded(TieredStore.write_back)
    stats = threaded(TieredStore.stats)
    close = threaded(TieredStore.close)

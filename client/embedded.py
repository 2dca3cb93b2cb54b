"""``embedded://``: the client API over a store in this process.

Why a store with two methods more, and not an httpx transport that serves the
HTTP API in process: the store already has exactly the client's data path
and return types, and routing in-process calls through JSON and frames would
encode, checksum and copy every chunk twice for nothing. What a remote
client has and a store lacks is added here: session events (accepted and
dropped: no predictor runs in process) and ``client_stats`` (all zero: the
store itself turns tier failures into misses and counts them in
``stats()``). The event methods take exactly the remote client's arguments
(``ClientProtocol``'s), so an engine switches between the two by URL alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec

from kvstore.client.exchange import Operation
from kvstore.client.failures import ClientStats
from kvstore.client.protocol import ClientProtocol
from kvstore.store.async_store import AsyncTieredStore
from kvstore.store.tiered_store import TieredStore

P = ParamSpec("P")
# Take the operation's name and signature (``__wrapped__``), keep this docstring.
_SIGNATURE_ONLY = ("__module__", "__name__", "__qualname__")


def dropped(
    operation: Callable[Concatenate[ClientProtocol, P], Operation[None]],
) -> Callable[Concatenate[Any, P], None]:
    """A method with ``operation``'s arguments that does nothing."""

    @functools.wraps(operation, assigned=_SIGNATURE_ONLY)
    def accept(self: Any, *args: P.args, **kwargs: P.kwargs) -> None:
        """Accepted and dropped (see the module docstring)."""

    return accept


def dropped_async(
    operation: Callable[Concatenate[ClientProtocol, P], Operation[None]],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, None]]:
    """A coroutine method with ``operation``'s arguments that does nothing."""

    @functools.wraps(operation, assigned=_SIGNATURE_ONLY)
    async def accept(self: Any, *args: P.args, **kwargs: P.kwargs) -> None:
        """Accepted and dropped (see the module docstring)."""

    return accept


class EmbeddedClient(TieredStore):
    """A ``TieredStore`` with the ``StoreClient`` interface (``client.api.KVClientAPI``)."""

    request_started = dropped(ClientProtocol.request_started)
    request_finished = dropped(ClientProtocol.request_finished)

    def client_stats(self) -> ClientStats:
        return ClientStats()


class AsyncEmbeddedClient(AsyncTieredStore):
    """An ``AsyncTieredStore`` with the ``AsyncStoreClient`` interface."""

    request_started = dropped_async(ClientProtocol.request_started)
    request_finished = dropped_async(ClientProtocol.request_finished)

    def client_stats(self) -> ClientStats:
        return ClientStats()

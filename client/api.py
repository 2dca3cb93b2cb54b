"""The store's API, once: what every face answers, embedded or remote, blocking or awaited.

::

                    KVStoreAPI                          AsyncKVStoreAPI
                    lookup put get delete stats close   (the same, awaitable)
                        │                                   │
      ┌─────────────────┼───────────────┐        ┌──────────┼──────────────────┐
      TieredStore   KVClientAPI                 AsyncTieredStore  AsyncKVClientAPI
      (embedded,    + request_started                          + request_started ...
       + demote,      request_finished
       promote,       client_stats
       pin, ...)        │                                          │
                ┌───────┴────────┐                        ┌────────┴─────────┐
           StoreClient    EmbeddedClient          AsyncStoreClient  AsyncEmbeddedClient
           (the daemon)   (embedded://)           (the daemon)      (embedded://)

An engine integration takes a ``KVClientAPI`` (``connect`` returns one), so
the same code runs against the daemon or a store in its own process. The
faces implement these protocols structurally; ``tests/client/test_api.py``
checks every face against them, parameter by parameter, so they cannot
drift apart. The faces do not write the methods out again either: the
awaitable store runs the blocking one's methods on a thread, and the
daemon's clients drive ``ClientProtocol``'s operations, which carry the
signatures below.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from kvstore.client.failures import ClientStats
from kvstore.keys import ChunkKey, Namespace, TokensOrKeys
from kvstore.store.chunk import CachedPrefix, ChunkData, KVChunk, OutData
from kvstore.store.stats import StoreStats
from kvstore.wire.events import Trigger


@runtime_checkable
class KVStoreAPI(Protocol):
    """The data path of a store: every blocking face has it."""

    def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        """How many leading chunks are cached, the fastest tier holding each, and how
        many are worth loading rather than recomputing (``CachedPrefix``)."""
        ...

    def put(
        self, namespace: Namespace, tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None], *, session: str | None = None,
    ) -> int:  # fmt: skip
        """Store chunk ``i`` under the ``i``-th chunk key (``None``: known to be cached);
        return how many were newly stored."""
        ...

    def get(
        self, namespace: Namespace, keys: Sequence[ChunkKey],
        *, out: Sequence[OutData] | None = None,
    ) -> list[KVChunk | None]:  # fmt: skip
        """The verified chunk for each key, or ``None`` (a miss); with ``out``, each
        payload lands in the caller's buffer."""
        ...

    def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Remove keys from every tier; how many were held."""
        ...

    def stats(self) -> StoreStats:
        """The store's counters, with each tier's usage."""
        ...

    def close(self) -> None:
        """Let go of everything the face holds (idempotent)."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self, exc_type: type[BaseException] | None,
        exc: BaseException | None, tb: TracebackType | None,
    ) -> None: ...  # fmt: skip


@runtime_checkable
class KVClientAPI(KVStoreAPI, Protocol):
    """What ``connect`` returns: the data path, session events, the client's own counters."""

    def request_started(
        self, session: str, *, prompt_tokens: int, cached_tokens: int,
        trigger: Trigger = Trigger.USER, time: float | None = None,
        idle_since: float | None = None, user: str | None = None,
        namespace: Namespace | None = None, keys: Sequence[ChunkKey] = (),
    ) -> None:  # fmt: skip
        """A request of ``session`` began: the predictor labels its last idle gap.
        ``namespace`` and ``keys``: the prompt's chain, so the daemon can move the
        session's KV, and can tell which session it continues when ``session`` is
        ``UNNAMED`` (``kvstore.wire.events``)."""
        ...

    def request_finished(
        self, session: str, *, steps: int, output_tokens: int, context_tokens: int,
        loaded_tokens: int, recomputed_tokens: int, tool_running: bool = False,
        time: float | None = None, namespace: Namespace | None = None,
        keys: Sequence[ChunkKey] = (),
    ) -> None:  # fmt: skip
        """A request of ``session`` ended: the session goes idle, and is placed
        (``keys``: the chain of its prompt and output)."""
        ...

    def client_stats(self) -> ClientStats:
        """What this client degraded instead of raising."""
        ...


@runtime_checkable
class AsyncKVStoreAPI(Protocol):
    """``KVStoreAPI``, awaitable (same parameters, same results)."""

    async def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix: ...

    async def put(
        self, namespace: Namespace, tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None], *, session: str | None = None,
    ) -> int: ...  # fmt: skip

    async def get(
        self, namespace: Namespace, keys: Sequence[ChunkKey],
        *, out: Sequence[OutData] | None = None,
    ) -> list[KVChunk | None]: ...  # fmt: skip

    async def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int: ...

    async def stats(self) -> StoreStats: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None,
        exc: BaseException | None, tb: TracebackType | None,
    ) -> None: ...  # fmt: skip


@runtime_checkable
class AsyncKVClientAPI(AsyncKVStoreAPI, Protocol):
    """``KVClientAPI``, awaitable (``client_stats`` answers at once)."""

    async def request_started(
        self, session: str, *, prompt_tokens: int, cached_tokens: int,
        trigger: Trigger = Trigger.USER, time: float | None = None,
        idle_since: float | None = None, user: str | None = None,
        namespace: Namespace | None = None, keys: Sequence[ChunkKey] = (),
    ) -> None: ...  # fmt: skip

    async def request_finished(
        self, session: str, *, steps: int, output_tokens: int, context_tokens: int,
        loaded_tokens: int, recomputed_tokens: int, tool_running: bool = False,
        time: float | None = None, namespace: Namespace | None = None,
        keys: Sequence[ChunkKey] = (),
    ) -> None: ...  # fmt: skip

    def client_stats(self) -> ClientStats: ...

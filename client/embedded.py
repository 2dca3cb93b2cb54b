"""``embedded://``: the client interface over a store in this process.

Why a thin wrapper and not an httpx transport that serves the HTTP API in
process: the store already has exactly the client's methods and return
types, and routing in-process calls through JSON and frames would encode,
checksum and copy every chunk twice for nothing. The wrapper adds only what a
remote client has and a store lacks: session events (accepted and dropped:
no predictor runs in process), ``client_stats`` (all zero: the store itself
turns tier failures into misses and counts them in ``stats()``), and owning
the store's lifetime.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from kvstore.client.failures import ClientStats
from kvstore.keys import ChunkKey, Namespace, TokensOrKeys
from kvstore.store.async_store import AsyncTieredStore
from kvstore.store.chunk import CachedPrefix, ChunkData, KVChunk
from kvstore.store.stats import StoreStats
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import Trigger


class EmbeddedClient:
    """A ``TieredStore`` behind the ``StoreClient`` interface; closes the store on close."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        return self.store.lookup(namespace, tokens_or_keys)

    def put(
        self,
        namespace: Namespace,
        tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None],
        *,
        session: str | None = None,
    ) -> int:
        return self.store.put(namespace, tokens_or_keys, kv_chunks, session=session)

    def get(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        *,
        out: Sequence[ChunkData] | None = None,
    ) -> list[KVChunk | None]:
        return self.store.get(namespace, keys, out=out)

    def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self.store.delete(namespace, keys)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def request_started(
        self,
        session: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        trigger: Trigger = Trigger.USER,
        time: float | None = None,
    ) -> None:
        """Accepted and dropped (see the module docstring)."""

    def request_finished(
        self,
        session: str,
        *,
        steps: int,
        output_tokens: int,
        context_tokens: int,
        loaded_tokens: int,
        recomputed_tokens: int,
        tool_running: bool = False,
        time: float | None = None,
    ) -> None:
        """Accepted and dropped (see the module docstring)."""

    def client_stats(self) -> ClientStats:
        return ClientStats()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> EmbeddedClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncEmbeddedClient:
    """An ``AsyncTieredStore`` behind the ``AsyncStoreClient`` interface."""

    def __init__(self, store: AsyncTieredStore) -> None:
        self.store = store

    async def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        return await self.store.lookup(namespace, tokens_or_keys)

    async def put(
        self,
        namespace: Namespace,
        tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None],
        *,
        session: str | None = None,
    ) -> int:
        return await self.store.put(namespace, tokens_or_keys, kv_chunks, session=session)

    async def get(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        *,
        out: Sequence[ChunkData] | None = None,
    ) -> list[KVChunk | None]:
        return await self.store.get(namespace, keys, out=out)

    async def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        return await self.store.delete(namespace, keys)

    async def stats(self) -> StoreStats:
        return await self.store.stats()

    async def request_started(
        self,
        session: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        trigger: Trigger = Trigger.USER,
        time: float | None = None,
    ) -> None:
        """Accepted and dropped (see the module docstring)."""

    async def request_finished(
        self,
        session: str,
        *,
        steps: int,
        output_tokens: int,
        context_tokens: int,
        loaded_tokens: int,
        recomputed_tokens: int,
        tool_running: bool = False,
        time: float | None = None,
    ) -> None:
        """Accepted and dropped (see the module docstring)."""

    def client_stats(self) -> ClientStats:
        return ClientStats()

    async def close(self) -> None:
        await self.store.close()

    async def __aenter__(self) -> AsyncEmbeddedClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

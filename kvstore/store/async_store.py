"""``AsyncTieredStore``: the asyncio face of ``TieredStore``.

One design, two faces (as httpx pairs ``Client`` and ``AsyncClient``): all
logic lives in the synchronous store, which is thread safe and releases the
GIL in its copies, hashing and backend I/O; each async method runs the same
call in a worker thread so the event loop never blocks on LMDB or Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType

from kvstore.keys import ChunkKey, Namespace, TokensOrKeys
from kvstore.store.chunk import CachedPrefix, ChunkData, KVChunk
from kvstore.store.config import StoreConfig
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.stats import StoreStats
from kvstore.store.tiered_store import TieredStore


class AsyncTieredStore:
    """Awaitable mirror of ``TieredStore``; same methods, same return types."""

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
        store: TieredStore | None = None,
    ) -> None:
        self.sync = store if store is not None else TieredStore(config, policy=policy)

    async def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> CachedPrefix:
        return await asyncio.to_thread(self.sync.lookup, namespace, tokens_or_keys)

    async def put(
        self,
        namespace: Namespace,
        tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None],
        *,
        session: str | None = None,
    ) -> int:
        return await asyncio.to_thread(
            self.sync.put, namespace, tokens_or_keys, kv_chunks, session=session
        )

    async def get(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        *,
        out: Sequence[ChunkData] | None = None,
    ) -> list[KVChunk | None]:
        return await asyncio.to_thread(self.sync.get, namespace, keys, out=out)

    async def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        return await asyncio.to_thread(self.sync.delete, namespace, keys)

    async def demote(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        return await asyncio.to_thread(self.sync.demote, namespace, keys)

    async def promote(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> int:
        return await asyncio.to_thread(self.sync.promote, namespace, keys)

    async def stats(self) -> StoreStats:
        return await asyncio.to_thread(self.sync.stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncTieredStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

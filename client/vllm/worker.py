"""The worker side of the vLLM connector: load blocks into vLLM's KV cache, save blocks out of it.

It runs in each vLLM worker process; every copy into or out of vLLM's KV
memory is ``client.vllm.cache_pages``'s.

* Loads go in batches. Into a cache in host memory (vLLM-CPU) the get's
  destinations are the blocks' pages themselves (``CachePages.destinations``):
  each block is copied once, from the daemon's shared-memory arena into its
  pages, and checked there. Into a device's cache they go through a host
  staging buffer: ``get(..., out=staging)`` verifies every block into it,
  then the good rows are scattered into the cache. A block that misses, fails
  its checksum or cannot be fetched is reported as a load error (its pages
  hold unspecified bytes, or what they held), and vLLM recomputes from it
  (``kv_load_failure_policy: "recompute"``), writing them over. A synchronous
  load runs before the forward that needs it; a large one runs on a thread of
  its own while vLLM runs other requests (``client.vllm.loads``).
* Saves are ``client.vllm.saves``': gathered into a bounded pool and put by a
  thread of their own, so ``wait_for_save`` never waits for the store. A
  request whose load failed in this step saves nothing in it: its forward ran
  on a block that was not loaded and vLLM discards that step's work for it.
* ``finished`` names the finished requests whose saves are out, so vLLM may
  free their blocks, and the requests whose asynchronous loads are done
  (``get_finished``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from kvstore.client.connect import KVClient
from kvstore.client.vllm.block_keys import BlockKeys
from kvstore.client.vllm.cache_pages import CachePages
from kvstore.client.vllm.loads import AsyncLoads
from kvstore.client.vllm.pages import BlockTransfer, PageFormat
from kvstore.client.vllm.saves import POOL_BYTES, Saves
from kvstore.errors import ConfigError, KVStoreError
from kvstore.store.chunk import OutData

log = logging.getLogger("kvstore.client.vllm")

IN_PLACE_BATCH_BYTES = 256 << 20
"""KV one get of a load into pages asks for. A get costs a round trip of a few ms of
client and daemon CPU whatever its size, and a load into pages needs no staging to
bound it: 64 MiB of 256-KiB blocks loaded in 30 ms as one get, 38-66 ms as eight
(2 cores). 256 MiB copies in well under a lease's 10 s."""
IN_PLACE_BATCH_BLOCKS = 1024
"""At most this many blocks a get, well under the daemon's ``max_batch_chunks`` (4096)."""


class WorkerSide:
    """Loads and saves of block pages; see the module docstring."""

    def __init__(
        self,
        store: KVClient,
        pages: PageFormat,
        batch_blocks: int = 32,
        save_pool_bytes: int = POOL_BYTES,
    ) -> None:
        if batch_blocks <= 0:
            raise ConfigError("batch_blocks must be positive")
        self._store = store
        self._pages = pages
        self._keys = BlockKeys(pages)
        self._batch_blocks = batch_blocks
        self._save_pool_bytes = save_pool_bytes
        self._cache: CachePages | None = None
        self._saves: Saves | None = None
        self._loads: AsyncLoads | None = None
        self._staging: torch.Tensor | None = None
        self.failed_blocks: set[int] = set()
        self.failed_requests: set[str] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's KV caches (``register_kv_caches``); loads and saves start here."""
        self._cache = CachePages(self._pages, kv_caches)
        self._staging = self._cache.staging(self._batch_blocks)
        self._saves = Saves(
            self._store, self._cache, self._keys, self._batch_blocks, self._save_pool_bytes
        )
        self._loads = AsyncLoads(
            self._load, self._cache.staging(self._batch_blocks), self._cache.device
        )

    @property
    def cache(self) -> CachePages:
        if self._cache is None:
            raise ConfigError("vLLM has not registered its KV caches with the connector")
        return self._cache

    @property
    def saves(self) -> Saves:
        if self._saves is None:
            raise ConfigError("vLLM has not registered its KV caches with the connector")
        return self._saves

    # -- load --------------------------------------------------------------------

    def load(self, transfers: Sequence[BlockTransfer]) -> None:
        """Load every transfer's blocks before the forward; failures land in
        ``failed_blocks`` and ``failed_requests``."""
        assert self._staging is not None, "set with the cache"
        for transfer in transfers:
            failed = self._load(transfer, self._staging)
            if failed:
                self.failed_blocks.update(failed)
                self.failed_requests.add(transfer.req_id)

    def load_async(self, transfers: Sequence[BlockTransfer]) -> None:
        """Hand every transfer to the load thread (``client.vllm.loads``)."""
        if self._loads is None:
            raise ConfigError("vLLM has not registered its KV caches with the connector")
        for transfer in transfers:
            self._loads.submit(transfer)

    def _load(self, transfer: BlockTransfer, staging: torch.Tensor) -> list[int]:
        """Bring ``transfer``'s blocks in, into their pages or through ``staging``; the
        vLLM block ids that failed."""
        cache = self.cache
        keys = self._keys.keys(transfer.salt, transfer.hashes)
        namespace = self._pages.namespace(transfer.salt)
        batch = self._batch_blocks
        if cache.loads_in_place:
            in_place = min(IN_PLACE_BATCH_BLOCKS, IN_PLACE_BATCH_BYTES // self._pages.block_bytes)
            batch = max(batch, in_place)
        failed: list[int] = []
        for start in range(0, len(keys), batch):
            stop = min(len(keys), start + batch)
            block_ids = transfer.block_ids[start:stop]
            out: Sequence[OutData] = (
                cache.destinations(block_ids)
                if cache.loads_in_place
                else list(staging[: stop - start])
            )
            try:
                chunks = self._store.get(namespace, keys[start:stop], out=out)
            except KVStoreError as error:
                log.warning("kvstore load of request %s failed: %s", transfer.req_id, error)
                chunks = [None] * (stop - start)
            loaded = [i for i, chunk in enumerate(chunks) if chunk is not None]
            failed += [block_ids[i] for i, chunk in enumerate(chunks) if chunk is None]
            if loaded and not cache.loads_in_place:
                cache.scatter(staging, loaded, [block_ids[i] for i in loaded])
        return failed

    def take_failed_blocks(self) -> set[int]:
        """The block ids that failed to load this step; clears the step's failures."""
        failed = self.failed_blocks
        self.failed_blocks = set()
        self.failed_requests = set()
        return failed

    # -- save --------------------------------------------------------------------

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """Queue every transfer's blocks, except those of requests whose load failed."""
        saves = self.saves
        for transfer in transfers:
            if transfer.req_id in self.failed_requests:
                saves.hold(transfer.req_id)
            else:
                saves.submit(transfer)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``get_finished``: the finished requests whose saves are out, and the requests
        whose asynchronous loads are done (their failed blocks join ``failed_blocks``,
        reported in this same pass)."""
        if self._saves is None or self._loads is None:
            return set(), set()
        loaded, failed = self._loads.finished()
        self.failed_blocks |= failed
        return self._saves.finished(finished_req_ids), loaded

    def close(self) -> None:
        if self._loads is not None:
            self._loads.close()
        if self._saves is not None:
            self._saves.close()

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
  free their blocks, and the requests whose asynchronous loads are done, with
  those that failed (``get_transfer_results``).

A model of several KV cache groups has a ``CachePages`` a group; each transfer
names its group (``client.vllm.pages``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
"""Default: KV one get of a load into pages asks for. A get costs a round trip of a few
ms of client and daemon CPU whatever its size, and a load into pages needs no staging
to bound it: 64 MiB of 256-KiB blocks loaded in 30 ms as one get, 38-66 ms as eight
(2 cores). 256 MiB copies in well under a lease's 10 s."""
IN_PLACE_BATCH_BLOCKS = 1024
"""Default: at most this many blocks a get, under the daemon's ``max_batch_chunks``
(4,096 unless configured lower; then set ``load_batch_blocks``)."""


@dataclass
class Transfers:
    """What ``WorkerSide.finished`` reports: vLLM's ``KVConnectorTransferResults``."""

    saved: set[str]  # finished requests whose saves are out: vLLM may free their blocks
    loaded: set[str]  # requests whose asynchronous loads are done, failed or not
    failed: set[str]  # those of them whose load failed somewhere


class WorkerSide:
    """Loads and saves of block pages; see the module docstring."""

    def __init__(
        self,
        store: KVClient,
        groups: Sequence[PageFormat],
        batch_blocks: int = 32,
        save_pool_bytes: int = POOL_BYTES,
        load_batch_blocks: int | None = None,
    ) -> None:
        """``batch_blocks``: blocks a put, or a get through staging, names;
        ``load_batch_blocks``: blocks a get into a CPU cache's pages names (default:
        ``IN_PLACE_BATCH_BYTES`` of them, at most ``IN_PLACE_BATCH_BLOCKS``)."""
        if batch_blocks <= 0 or (load_batch_blocks is not None and load_batch_blocks <= 0):
            raise ConfigError("batch_blocks and load_batch_blocks must be positive")
        self._store = store
        self._groups = tuple(groups)
        self._keys = [BlockKeys(pages) for pages in groups]
        self._batch_blocks = batch_blocks
        self._load_batch_blocks = load_batch_blocks
        self._save_pool_bytes = save_pool_bytes
        self._caches: list[CachePages] = []
        self._saves: Saves | None = None
        self._loads: AsyncLoads | None = None
        self._staging: list[torch.Tensor] = []  # a group's, for loads before the forward
        self._async_staging: list[torch.Tensor] = []  # a group's, for the load thread
        self.failed_blocks: set[int] = set()
        self.failed_requests: set[str] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's KV caches (``register_kv_caches``); loads and saves start here."""
        self._caches = [CachePages(pages, kv_caches) for pages in self._groups]
        self._staging = [self._load_staging(cache) for cache in self._caches]
        self._async_staging = [self._load_staging(cache) for cache in self._caches]
        self._saves = Saves(
            self._store, self._caches, self._keys, self._batch_blocks, self._save_pool_bytes
        )
        self._loads = AsyncLoads(
            lambda transfer: self._load(transfer, self._async_staging[transfer.group]),
            self._caches[0].device,
        )

    def _load_staging(self, cache: CachePages) -> torch.Tensor:
        """A load's staging for ``cache``: none (no rows) where loads land in the pages."""
        return cache.staging(0 if cache.loads_in_place else self._batch_blocks)

    @property
    def caches(self) -> list[CachePages]:
        """Each KV cache group's pages, in vLLM's group order."""
        if not self._caches:
            raise ConfigError("vLLM has not registered its KV caches with the connector")
        return self._caches

    @property
    def saves(self) -> Saves:
        if self._saves is None:
            raise ConfigError("vLLM has not registered its KV caches with the connector")
        return self._saves

    # -- load --------------------------------------------------------------------

    def load(self, transfers: Sequence[BlockTransfer]) -> None:
        """Load every transfer's blocks before the forward; failures land in
        ``failed_blocks`` and ``failed_requests``."""
        for transfer in transfers:
            failed = self._load(transfer, self._staging[transfer.group])
            if failed:
                self.failed_blocks.update(failed)
                self.failed_requests.add(transfer.req_id)

    def load_async(self, transfers: Sequence[BlockTransfer]) -> None:
        """Hand every transfer to the load thread (``client.vllm.loads``)."""
        if self._loads is None:
            raise ConfigError("vLLM has not registered its KV caches with the connector")
        self._loads.submit(transfers)

    def _load(self, transfer: BlockTransfer, staging: torch.Tensor) -> list[int]:
        """Bring ``transfer``'s blocks in, into their pages or through ``staging``; the
        vLLM block ids that failed."""
        cache = self.caches[transfer.group]
        pages = cache.pages
        keys = self._keys[transfer.group].keys(transfer.salt, transfer.hashes)
        namespace = pages.namespace(transfer.salt)
        batch = self._batch_blocks
        if cache.loads_in_place:
            batch = self._load_batch_blocks or max(
                1, min(IN_PLACE_BATCH_BLOCKS, IN_PLACE_BATCH_BYTES // pages.block_bytes)
            )
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

    def finished(self, finished_req_ids: set[str]) -> Transfers:
        """``get_transfer_results``: the finished requests whose saves are out, and the
        requests whose asynchronous loads are done. With one KV cache group the blocks
        that failed join ``failed_blocks``, reported in this same pass, and vLLM
        recomputes from the first; with several, vLLM cannot map a block id back to
        its request, so the requests are named failed instead and recomputed whole."""
        if self._saves is None or self._loads is None:
            return Transfers(set(), set(), set())
        loads = self._loads.finished()
        failed: set[str] = set()
        if len(self._groups) == 1:
            self.failed_blocks |= loads.failed_blocks
        else:
            failed = loads.failed_requests
        return Transfers(self._saves.finished(finished_req_ids), loads.requests, failed)

    def close(self) -> None:
        if self._loads is not None:
            self._loads.close()
        if self._saves is not None:
            self._saves.close()

"""The worker side of the vLLM connector: copy block pages between vLLM's KV cache and the store.

It runs in each vLLM worker process. Loads run before the forward that needs
them (vLLM schedules them as synchronous loads); saves run after the forward,
in ``wait_for_save``. Each direction goes in batches through one host staging
buffer laid out ``(blocks, layers, page)``, one chunk per block:

* load: ``get(..., out=staging)`` verifies every block into the staging buffer,
  then each layer's pages are scattered into the KV cache with one indexed
  copy. A block that misses, fails its checksum or cannot be fetched is never
  copied: its vLLM block id is reported as a load error, and vLLM recomputes
  from it (``kv_load_failure_policy: "recompute"``).
* save: each layer's pages are gathered with one indexed copy into the staging
  buffer and put as opaque bytes. A request whose load failed in this step
  saves nothing in it: its forward ran on a block that was not loaded and vLLM
  discards that step's work for it.

The save is synchronous: when ``wait_for_save`` returns the blocks are in the
store (or dropped and counted by the client if the daemon is down), so vLLM
may reuse the pages at once and the next request finds them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from kvstore.client.connect import KVClient
from kvstore.client.vllm.pages import BlockTransfer, PageFormat
from kvstore.errors import ConfigError, KVStoreError

log = logging.getLogger("kvstore.client.vllm")


class WorkerSide:
    """Loads and saves of block pages; see the module docstring."""

    def __init__(self, store: KVClient, pages: PageFormat, batch_blocks: int = 32) -> None:
        if batch_blocks <= 0:
            raise ConfigError("batch_blocks must be positive")
        self._store = store
        self._pages = pages
        self._batch_blocks = batch_blocks
        self._caches: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None
        self.failed_blocks: set[int] = set()
        self.failed_requests: set[str] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keep each layer's ``[B, H, N, C]`` view, in the KV cache group's layer order."""
        pages = self._pages
        missing = [name for name in pages.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing}")
        caches = [kv_caches[name] for name in pages.layer_names]
        for name, cache in zip(pages.layer_names, caches, strict=True):
            if cache.dtype != pages.torch_dtype or cache[0].numel() != pages.page_elements:
                raise ConfigError(
                    f"layer {name}: KV cache of {cache.dtype} with pages of shape "
                    f"{tuple(cache.shape[1:])}, expected {pages.dtype} pages of "
                    f"{pages.page_elements} elements"
                )
        self._caches = caches

    def _staging_for(self, blocks: int) -> torch.Tensor:
        """The host staging buffer ``(blocks, layers, page)``, grown on demand and reused."""
        staging = self._staging
        if staging is None or staging.shape[0] < blocks:
            pin = torch.cuda.is_available() and self._caches[0].is_cuda
            staging = torch.empty(
                (
                    max(blocks, self._batch_blocks),
                    self._pages.num_layers,
                    self._pages.page_elements,
                ),
                dtype=self._pages.torch_dtype,
                pin_memory=pin,
            )
            self._staging = staging
        return staging[:blocks]

    # -- load --------------------------------------------------------------------

    def load(self, transfers: Sequence[BlockTransfer]) -> None:
        """Load every transfer's blocks; failures land in ``failed_blocks``/``failed_requests``."""
        for transfer in transfers:
            keys = self._pages.keys(transfer.salt, transfer.hashes[transfer.first :])
            namespace = self._pages.namespace(transfer.salt)
            for start, stop in self._batches(len(keys)):
                staging = self._staging_for(stop - start)
                block_ids = transfer.block_ids[start:stop]
                try:
                    chunks = self._store.get(namespace, keys[start:stop], out=list(staging))
                except KVStoreError as error:
                    log.warning("kvstore load of request %s failed: %s", transfer.req_id, error)
                    chunks = [None] * (stop - start)
                loaded = [i for i, chunk in enumerate(chunks) if chunk is not None]
                failed = [block_ids[i] for i, chunk in enumerate(chunks) if chunk is None]
                if failed:
                    self.failed_blocks.update(failed)
                    self.failed_requests.add(transfer.req_id)
                if loaded:
                    self._scatter(staging, loaded, [block_ids[i] for i in loaded])

    def _scatter(self, staging: torch.Tensor, rows: list[int], block_ids: list[int]) -> None:
        device = self._caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        source = staging[torch.tensor(rows, dtype=torch.long)]
        for layer, cache in enumerate(self._caches):
            pages = source[:, layer].reshape((len(rows), *cache.shape[1:]))
            cache.index_copy_(0, ids, pages.to(device, non_blocking=True))

    # -- save --------------------------------------------------------------------

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """Save every transfer's blocks, except those of requests whose load failed."""
        for transfer in transfers:
            if transfer.req_id in self.failed_requests:
                continue
            namespace = self._pages.namespace(transfer.salt)
            # Each put names its batch from the parent of its first block on: the parent
            # link is all the store needs of the prefix, so a put stays one batch long
            # (and only these keys are derived) however deep in a long context it lands.
            base = max(0, transfer.first - 1)
            keys = self._pages.keys(transfer.salt, transfer.hashes[base:])  # block base + i
            for start, stop in self._batches(len(transfer.block_ids)):
                staging = self._gather(transfer.block_ids[start:stop])
                first = transfer.first + start - base  # the batch's first block, in keys
                parent = max(0, first - 1)
                chunks: list[np.ndarray | None] = [None] * (first - parent)
                chunks += [row.view(torch.uint8).reshape(-1).numpy() for row in staging]
                try:
                    self._store.put(namespace, keys[parent : first + stop - start], chunks)
                except KVStoreError as error:
                    log.warning("kvstore save of request %s failed: %s", transfer.req_id, error)

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        staging = self._staging_for(len(block_ids))
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self._caches[0].device)
        for layer, cache in enumerate(self._caches):
            pages = cache.index_select(0, ids).reshape(len(block_ids), -1)
            staging[:, layer].copy_(pages)
        return staging

    def _batches(self, count: int) -> Iterator[tuple[int, int]]:
        for start in range(0, count, self._batch_blocks):
            yield start, min(count, start + self._batch_blocks)

    def take_failed_blocks(self) -> set[int]:
        """The block ids that failed to load this step; clears the step's failures."""
        failed = self.failed_blocks
        self.failed_blocks = set()
        self.failed_requests = set()
        return failed

"""vLLM's KV cache as the worker side sees it: one tensor per attention layer, a page per block.

The one module that reads or writes vLLM's KV memory. A kvstore chunk is one
vLLM block, the block's page of every layer in the KV cache group's layer
order (``client.vllm.pages``), and it travels through host staging laid out
``(blocks, layers, page)``, one row a block:

* ``gather`` copies blocks' pages out of the cache into staging rows;
* ``scatter`` copies staging rows into blocks' pages.

Each is one indexed copy per layer. Staging for a cache on a CUDA device is
pinned, so the copies run as DMA; they are queued on the caller's current
stream (``client.vllm.saves`` gathers on a side stream of its own).

A cache in host memory also gives its blocks' pages as a get's destinations
(``destinations``: one ``ChunkPages`` a block), so a load from the daemon's
shared-memory arena lands each page where it belongs with one copy, where
staging and a scatter take two (measured by ``bench/vllm_loads.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvstore.client.vllm.pages import PageFormat
from kvstore.errors import ConfigError
from kvstore.store.chunk import ChunkPages


class CachePages:
    """The registered KV caches of one worker, in ``pages``' layer order."""

    def __init__(self, pages: PageFormat, kv_caches: Mapping[str, torch.Tensor]) -> None:
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
        self.pages = pages
        self._caches = caches
        # Each layer's pages as rows of bytes, for a cache in host memory whose pages
        # are each one run of bytes (every layout vLLM gives a connector on CPU).
        in_place = self.device.type == "cpu" and all(cache[0].is_contiguous() for cache in caches)
        self._rows = [_page_rows(cache) for cache in caches] if in_place else []

    @property
    def device(self) -> torch.device:
        return self._caches[0].device

    @property
    def loads_in_place(self) -> bool:
        """Whether a get can land blocks in their pages (``destinations``)."""
        return bool(self._rows)

    def destinations(self, block_ids: Sequence[int]) -> list[ChunkPages]:
        """The pages of ``block_ids``, as a get's ``out=`` (``loads_in_place``)."""
        assert self._rows, "only a cache in host memory gives its pages"
        return [ChunkPages(tuple(rows[block] for rows in self._rows)) for block in block_ids]

    def staging(self, blocks: int) -> torch.Tensor:
        """A host buffer of ``blocks`` rows, pinned when the cache is on a CUDA device."""
        return torch.empty(
            (blocks, self.pages.num_layers, self.pages.page_elements),
            dtype=self.pages.torch_dtype,
            pin_memory=self.device.type == "cuda",
        )

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` into rows ``0 .. len(block_ids) - 1`` of ``out``.

        On CPU each layer's pages go straight into their rows. On a CUDA device they
        are gathered into device rows first, then copied to host in one transfer."""
        count = len(block_ids)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        rows = (
            out[:count]
            if self.device.type == "cpu"
            else torch.empty_like(out[:count], device=self.device)
        )
        for layer, cache in enumerate(self._caches):
            rows[:, layer].copy_(cache.index_select(0, ids).reshape(count, -1))
        if rows.device != out.device:
            out[:count].copy_(rows, non_blocking=True)

    def scatter(self, source: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy rows ``rows`` of ``source`` into the pages of ``block_ids``, in pairs.

        Rows ``0 .. n - 1`` (a batch that loaded whole) are read in place, with no copy
        on the host; on a CUDA device they go over in one transfer from the pinned
        staging, then each layer's pages are placed device to device."""
        count = len(block_ids)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if list(rows) == list(range(count)):
            picked = source[:count]
        else:  # some blocks of the batch failed: only the others are copied
            picked = source[torch.tensor(list(rows), dtype=torch.long)]
        picked = picked.to(self.device, non_blocking=True)
        for layer, cache in enumerate(self._caches):
            cache.index_copy_(0, ids, picked[:, layer].reshape((count, *cache.shape[1:])))


def _page_rows(cache: torch.Tensor) -> np.ndarray:
    """One layer's cache, its pages contiguous, as a ``(blocks, page bytes)`` array of
    its memory: each row a block's page, in place (blocks may lie any stride apart)."""
    raw = cache.view(torch.uint8)
    page_bytes = raw[0].numel()
    return torch.as_strided(raw, (raw.shape[0], page_bytes), (raw.stride(0), 1)).numpy()

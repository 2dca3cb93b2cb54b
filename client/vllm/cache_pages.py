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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvstore.client.vllm.pages import PageFormat
from kvstore.errors import ConfigError


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

    @property
    def device(self) -> torch.device:
        return self._caches[0].device

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

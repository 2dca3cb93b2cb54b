"""``KVStoreHiCache``: SGLang's ``HiCacheStorage`` (its L3 tier) on a kvstore daemon or store.

SGLang builds it through its dynamic backend option; ``StorageBackendFactory``
calls ``KVStoreHiCache(storage_config, {})`` and the controller then registers
its host pool (``register_mem_pool_host``), which fixes the page format and so
the namespace. What the controller calls, from which of its threads::

    prefetch thread   batch_exists(hashes)            -> leading run of held pages
    prefetch I/O      batch_get_v1(hashes, host_idx)  -> [bool]   ("interface_v1": 1)
                      batch_get(hashes, pages)        -> [page | None]   (otherwise)
    backup thread     batch_set_v1(hashes, host_idx)  -> [bool]   ("interface_v1": 1)
                      batch_set(hashes, pages)        -> bool            (otherwise)

The ``_v1`` calls name host-pool slots instead of tensors: pages are read from
the pool with ``get_data_page(flat=True)`` and written back with
``set_from_flat_data_page``, the pool's own page methods, so every host
layout and pool kind (MHA, MLA) works unchanged. A get lands in a host staging
buffer first and only verified pages are written into the pool: a page whose
answer is ``False`` leaves its slot untouched.

The single-page ``get``/``set``/``exists`` are the batch calls on one page.
``clear`` keeps HiCacheStorage's default (nothing): the store is shared by
every engine and tenant, so one engine does not empty it; its pages leave by
the store's own eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as error:  # the main test suite and plain installs have no SGLang
    raise ImportError(
        "kvstore.client.sglang is an SGLang HiCache storage backend and needs SGLang "
        "installed (`make install-sglang` builds a virtual environment with it)"
    ) from error

import torch

from kvstore.client.address import engine_url
from kvstore.client.connect import connect
from kvstore.client.protocol import DEFAULTS
from kvstore.client.sglang.page_store import PageStore, PageStoreOptions, batches
from kvstore.client.sglang.pages import PageFormat
from kvstore.errors import ConfigError

__all__ = ["KVStoreHiCache"]


class KVStoreHiCache(HiCacheStorage):
    """HiCache's L3 on kvstore; see the module docstring and ``client.sglang``."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        """``storage_config``: SGLang's ``HiCacheStorageConfig``, its ``extra_config``
        the JSON of ``--hicache-storage-backend-extra-config``; ``kwargs``: what the
        factory forwards from ``create_backend`` (the controller passes none)."""
        extra = storage_config.extra_config or {}
        self.storage_config = storage_config
        self._client = connect(
            engine_url(extra.get("url")),
            timeout_s=float(extra.get("timeout_s", DEFAULTS.timeout_s)),
            backoff_s=float(extra.get("backoff_s", DEFAULTS.backoff_s)),
        )
        self._tenant_salt: str | None = extra.get("tenant_salt")
        self._options = PageStoreOptions.from_config(extra)
        self._store: PageStore | None = None  # set by register_mem_pool_host

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = PageFormat.from_sglang(self.storage_config, mem_pool_host, self._tenant_salt)
        self._store = PageStore(self._client, pages, self._options)

    @property
    def store(self) -> PageStore:
        if self._store is None:
            raise ConfigError("SGLang registered no host pool with the kvstore backend yet")
        return self._store

    # -- exists ----------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self.store.exists(keys)

    def exists(self, key: str) -> bool:
        return self.store.exists([key]) == 1

    # -- pages as tensors --------------------------------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        pool = self.mem_pool_host
        targets = list(target_locations or [pool.get_dummy_flat_data_page() for _ in keys])
        loaded = self.store.get(keys, targets)
        return [target if ok else None for target, ok in zip(targets, loaded, strict=True)]

    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None:
            raise ConfigError("the kvstore backend stores the pages it is given (values=)")
        return all(self.store.put(keys, values))

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    # -- pages as host-pool slots (the zero-copy interface, "interface_v1": 1) ----------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pool = self.mem_pool_host
        page = pool.get_dummy_flat_data_page()
        staging = torch.empty((self._options.batch_pages, page.numel()), dtype=page.dtype)
        loaded: list[bool] = []
        for start, stop in batches(len(keys), self._options.batch_pages):
            rows = list(staging[: stop - start])
            batch = self.store.get(keys[start:stop], rows)
            for offset, ok in enumerate(batch):
                if ok:
                    pool.set_from_flat_data_page(
                        self._slot(host_indices, start + offset), rows[offset]
                    )
            loaded += batch
        return loaded

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pool = self.mem_pool_host
        stored: list[bool] = []
        for start, stop in batches(len(keys), self._options.batch_pages):
            pages = [
                pool.get_data_page(self._slot(host_indices, page), flat=True)
                for page in range(start, stop)
            ]
            stored += self.store.put(keys[start:stop], pages)
        return stored

    def _slot(self, host_indices: torch.Tensor, page: int) -> int:
        """The host-pool index of page ``page``'s first token."""
        return int(host_indices[page * self.store.pages.page_size].item())

    def close(self) -> None:
        self._client.close()

"""HiCache's three questions to L3, answered by any kvstore client: exists, get, set.

Nothing here imports SGLang; ``backend.KVStoreHiCache`` adapts SGLang's calls to
these, and the main suite tests them against real stores.

::

    exists(hashes)        lookup, a slice at a time, while the deadline lasts
        -> n              the leading run of held pages (what prefetch asks)

    get(hashes, out)      get(out=) in batches, every page verified
        -> [bool]         True: the page's bytes are in out[i]; False: never use out[i]

    put(hashes, pages)    put in batches, then lookup of what was put
        -> [bool]         True: the store holds page i now

Invariants:

* A page that misses, fails its checksum or cannot be fetched (the daemon down,
  slow or restarting) is ``False``: the client turns a corrupt block into a
  miss, and the store drops it, so the next ``exists`` stops before it. A
  failed page is never reported loaded, so HiCache never computes on it.
* ``exists`` answers a prefix that is really held at the moment it was asked
  (the store's lookup is a leading run), possibly shorter than the whole when
  its deadline passes: the first slice is always asked, a later one only while
  time is left. A shorter answer costs a recompute, never a wrong page.
* ``put`` answers ``True`` only for pages a lookup finds afterwards: a put the
  client dropped (daemon down) or a store that evicted at once is a failed
  write, so HiCache does not count those pages as backed up.
* A request the store refuses (``KVStoreError``: a page of the wrong size, a
  bad token) is logged and answered as all-failed; the engine never stops for
  its cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.client.connect import KVClient
from kvstore.client.sglang.pages import PageFormat
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey

log = logging.getLogger("kvstore.client.sglang")


@dataclass(frozen=True)
class PageStoreOptions:
    """How the backend talks to the store; each is a key of SGLang's extra config."""

    batch_pages: int = 32  # pages per get or put request
    exists_slice_pages: int = 32  # pages per lookup while answering exists
    exists_deadline_s: float = 0.05  # exists asks no further slice after this

    def __post_init__(self) -> None:
        if self.batch_pages <= 0 or self.exists_slice_pages <= 0:
            raise ConfigError("batch_pages and exists_slice_pages must be positive")
        if self.exists_deadline_s < 0:
            raise ConfigError("exists_deadline_s must not be negative")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PageStoreOptions:
        """The options ``config`` (SGLang's extra config) names; the others default."""
        defaults = cls()
        return cls(
            batch_pages=int(config.get("batch_pages", defaults.batch_pages)),
            exists_slice_pages=int(config.get("exists_slice_pages", defaults.exists_slice_pages)),
            exists_deadline_s=float(config.get("exists_deadline_s", defaults.exists_deadline_s)),
        )


class PageStore:
    """SGLang pages in one namespace of a kvstore client; see the module docstring."""

    def __init__(
        self, client: KVClient, pages: PageFormat, options: PageStoreOptions = PageStoreOptions()
    ) -> None:
        self._client = client
        self.pages = pages
        self._options = options

    def exists(self, page_hashes: Sequence[str]) -> int:
        """How many leading pages of ``page_hashes`` the store holds (see the deadline)."""
        keys = self.pages.keys(page_hashes)
        step = self._options.exists_slice_pages
        deadline = time.monotonic() + self._options.exists_deadline_s
        held = 0
        for start in range(0, len(keys), step):
            if start and time.monotonic() >= deadline:
                break
            found = self._held(keys[start : start + step])
            held += found
            if found < len(keys[start : start + step]):
                break
        return held

    def get(self, page_hashes: Sequence[str], out: Sequence[torch.Tensor]) -> list[bool]:
        """Read each page into ``out[i]`` (host memory, contiguous, one page's bytes)."""
        if len(out) != len(page_hashes):
            raise ConfigError(f"{len(out)} buffers for {len(page_hashes)} pages")
        keys = self.pages.keys(page_hashes)
        loaded: list[bool] = []
        for start, stop in batches(len(keys), self._options.batch_pages):
            buffers = [buffer.view(torch.uint8) for buffer in out[start:stop]]
            try:
                chunks = self._client.get(self.pages.namespace, keys[start:stop], out=buffers)
            except KVStoreError as error:
                log.warning("kvstore get of %d pages failed: %s", stop - start, error)
                chunks = [None] * (stop - start)
            loaded += [chunk is not None for chunk in chunks]
        return loaded

    def put(self, page_hashes: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store ``pages[i]`` under ``page_hashes[i]``; which of them the store holds after."""
        if len(pages) != len(page_hashes):
            raise ConfigError(f"{len(pages)} pages for {len(page_hashes)} page hashes")
        keys = self.pages.keys(page_hashes)
        stored: list[bool] = []
        for start, stop in batches(len(keys), self._options.batch_pages):
            batch = keys[start:stop]
            payloads = [_page_bytes(page) for page in pages[start:stop]]
            try:
                self._client.put(self.pages.namespace, batch, payloads)
            except KVStoreError as error:
                log.warning("kvstore put of %d pages failed: %s", len(batch), error)
                stored += [False] * len(batch)
                continue
            held = self._held(batch)
            stored += [i < held for i in range(len(batch))]
        return stored

    def _held(self, keys: list[ChunkKey]) -> int:
        try:
            return self._client.lookup(self.pages.namespace, keys).num_chunks
        except KVStoreError as error:
            log.warning("kvstore lookup of %d pages failed: %s", len(keys), error)
            return 0


def batches(count: int, step: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each run of at most ``step`` of ``count`` pages."""
    for start in range(0, count, step):
        yield start, min(count, start + step)


def _page_bytes(page: torch.Tensor) -> np.ndarray:
    """A page's bytes as a flat uint8 array (a copy only when it is not contiguous on host)."""
    return page.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()

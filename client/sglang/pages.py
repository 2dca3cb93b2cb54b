"""How an SGLang HiCache page becomes a kvstore chunk: the namespace and the keys.

Nothing here imports SGLang, so the key mapping is tested in the main suite.

* A chunk is one HiCache page, as the host pool's "flat data page" (what
  ``get_data_page(index, flat=True)`` returns and ``set_from_flat_data_page``
  takes back): its bytes are opaque to kvstore and round-trip exactly. The
  chunk layout is ``uint8`` of the page's byte size; the layout's name carries
  the host pool's memory layout and dtype (``"sglang-page:page_first:bfloat16"``),
  because a flat page's byte order follows the pool's layout: a page written
  under ``layer_first`` read back under ``page_first`` would be other numbers.
  Changing the layout, the dtype or the page size therefore turns old pages
  into misses, never into wrong KV, and a new layout needs no change here.
* A page's key is ``external_keys(namespace, [hash.encode()])`` of SGLang's own
  page hash (the hex string ``get_hash_str`` chains over the page's tokens and
  its prefix; a request's ``cache_salt`` and ``extra_key`` already seed it).
  SHA-256 places it: SGLang's hashes are SHA-256 themselves.
* The namespace binds the model (``HiCacheStorageConfig.model_name``, which
  SGLang tags with a pool's own page format when it has one), the page size,
  the pipeline stage, the tensor-parallel rank and size, and the deployment's
  tenant salt. MLA pools are the same on every TP rank, and SGLang lets only
  one rank write them (``is_storage_writer``), so their namespace leaves the TP
  rank out: every rank reads what the writer stored. Context-parallel shards
  (``attn_cp``, ``dcp``) hold different slices of a page and keep their rank.

::

    "sglang:Qwen/Qwen3-8B:pp0/1:tp1/2"  +  KVLayout(uint8, page bytes,
                                           "sglang-page:page_first:bfloat16")
                                        +  tenant salt
        │
        └── Namespace ──► external_keys(ns, [b"3f9a...e1"]) ──► ChunkKey (16 bytes)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, HashAlgo, KVLayout, Namespace, external_keys

PAGE_LAYOUT_PREFIX = "sglang-page"


@dataclass(frozen=True)
class PageFormat:
    """One HiCache page of one rank, as a kvstore namespace (``namespace``, ``keys``)."""

    model: str
    page_size: int  # tokens per page
    page_bytes: int  # bytes of one flat data page
    pool_layout: str  # the host pool's ``layout`` ("page_first", "layer_first", ...)
    dtype: str  # the host pool's dtype, torch's name without "torch."
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    replicated: bool = False  # MLA: the same page on every TP rank
    shard: str = ""  # context-parallel shard ("cp1/2", "dcp0/2@128"), "" without one
    tenant_salt: str | None = None

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_bytes <= 0:
            raise ConfigError("a HiCache page needs a positive size in tokens and bytes")
        if self.page_bytes % (2 * self.page_size):
            # KVLayout has a K|V axis: its byte size is 2 * tokens * head_dim for uint8.
            raise ConfigError(
                f"a page of {self.page_bytes} bytes for {self.page_size} tokens has no "
                "kvstore layout (its bytes must divide into 2 x tokens)"
            )

    @classmethod
    def from_sglang(
        cls, storage_config: Any, host_pool: Any, tenant_salt: str | None = None
    ) -> PageFormat:
        """The format of ``host_pool``'s pages on the rank ``storage_config`` describes.

        ``storage_config`` is SGLang's ``HiCacheStorageConfig``; ``host_pool`` is
        the ``HostKVCache`` the controller registers (``register_mem_pool_host``).
        """
        config = storage_config
        page = host_pool.get_dummy_flat_data_page()
        shard = []
        if config.attn_cp_size > 1:
            shard.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
        if config.dcp_size > 1:
            shard.append(f"dcp{config.dcp_rank}/{config.dcp_size}@{config.logical_page_size}")
        return cls(
            model=config.model_name or "",
            page_size=int(host_pool.page_size),
            page_bytes=page.numel() * page.element_size(),
            pool_layout=str(host_pool.layout),
            dtype=str(host_pool.dtype).removeprefix("torch."),
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            pp_rank=config.pp_rank,
            pp_size=config.pp_size,
            replicated=bool(config.is_mla_model),
            shard=":".join(shard),
            tenant_salt=tenant_salt,
        )

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=1,
            num_kv_heads=1,
            head_dim=self.page_bytes // (2 * self.page_size),
            dtype="uint8",
            chunk_tokens=self.page_size,
            name=f"{PAGE_LAYOUT_PREFIX}:{self.pool_layout}:{self.dtype}",
            page_tokens=self.page_size,
        )

    @functools.cached_property
    def namespace(self) -> Namespace:
        parts = ["sglang", self.model, f"pp{self.pp_rank}/{self.pp_size}"]
        if not self.replicated:
            parts.append(f"tp{self.tp_rank}/{self.tp_size}")
        if self.shard:
            parts.append(self.shard)
        return Namespace(
            ":".join(parts), self.layout, tenant_salt=self.tenant_salt, hash_algo=HashAlgo.SHA256
        )

    def keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """The chunk key of each SGLang page hash, in order."""
        return external_keys(self.namespace, [page_hash.encode() for page_hash in page_hashes])

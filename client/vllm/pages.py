"""What the vLLM connector's two sides agree on: the page format, the namespace, the plan.

Nothing here imports vLLM, so the scheduler side, the worker side and their
tests share one definition of how a vLLM KV block becomes a kvstore chunk:

* A chunk is one vLLM block of ``block_size`` tokens: the block's page of every
  attention layer, in the KV cache group's layer order, each page copied as
  the ``[H, N, C]`` logical view vLLM hands connectors (``C`` is K's and V's
  head sizes together; for MLA, one latent vector a token and no V). The
  bytes are opaque to kvstore and round-trip exactly, whatever physical order
  the attention backend keeps (``KVLayout.name`` is ``"vllm-page"``, with the
  K and V head sizes where they differ, so such chunks never mix with chunks
  in kvstore's own ``LKTHD`` order or with another page shape).
* A chunk's key is ``external_keys(namespace, [block_hash])`` of vLLM's own
  chained block hash (``request.block_hashes``), so kvstore agrees with vLLM's
  prefix cache on what a block is, ``cache_salt`` and multimodal inputs
  included. The namespace binds the model, its revision, the tensor-parallel
  rank, the page shape and dtype, the block size and the request's
  ``cache_salt``.
* ``BlockTransfer`` is what travels from the scheduler to the workers in the
  connector metadata: which blocks of which request move, by hash and by
  vLLM block id, in which KV cache group.

A model whose layers vLLM's hybrid KV cache manager splits into several KV
cache groups (full attention and sliding-window layers: ``page_formats``) is
stored as one ``PageFormat`` a group: a block's chunk is the block's page of
that group's layers, in a namespace that names the group (its first layer),
so two groups of the same shape never share keys. A sliding-window group
holds pages only for the blocks in its window; the others are vLLM's null
block (``NULL_BLOCK_ID``), which is neither loaded nor saved.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.keys import DTYPE_SIZES, ChunkKey, HashAlgo, KVLayout, Namespace, external_keys

PAGE_LAYOUT = "vllm-page"
NULL_BLOCK_ID = 0
"""vLLM's null block (``BlockPool.null_block``, the first block of its pool): where a
sliding-window group's blocks outside the window point. It holds no KV."""
_STORED_SPECS = ("FullAttentionSpec", "AttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks ``first .. first + len(hashes) - 1`` of one request, to load or to save this step.

    ``hashes[i]`` is vLLM's hash of block ``first + i``, ``block_ids[i]`` the vLLM
    block that holds it. ``parent`` is the hash of block ``first - 1`` (``None``
    for block 0; a load ignores it): a put names it ahead of its batch, so the
    store links the batch to the prefix it extends. Only the moving blocks' hashes
    travel: a request deep in a long context saves a block every few steps, and
    its whole chain would be thousands of hashes in every step's metadata.
    ``asynchronous``: a load made off the step (``client.vllm.loads``).
    ``group``: the KV cache group whose pages move (``page_formats``).
    """

    req_id: str
    salt: str | None
    first: int
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes | None = None
    asynchronous: bool = False
    group: int = 0

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.hashes) or self.first < 0:
            raise ConfigError(
                f"transfer of request {self.req_id!r} names {len(self.block_ids)} block ids "
                f"for {len(self.hashes)} blocks from block {self.first}"
            )


@dataclass(frozen=True)
class PageFormat:
    """One vLLM block's pages across all layers, as a kvstore layout.

    Built from vLLM's ``KVCacheConfig`` on both sides, so the scheduler's
    lookups and the workers' loads and saves use the same namespace.
    """

    model: str
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    head_size_v: int | None = None  # None: V's head size is K's; 0: MLA's latent, no V
    # Of a model with several KV cache groups: the group's first layer, which its
    # namespace names (None: the model's only group).
    group_layer: str | None = None
    sliding_window: int | None = None  # tokens a sliding-window group attends to

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"kvstore cannot store vLLM KV of dtype {self.dtype!r}; "
                f"supported: {sorted(DTYPE_SIZES)}"
            )
        if self.state_size % 2:
            raise ConfigError(
                f"a page of K head size {self.head_size} and V head size {self.v_size} "
                "has an odd width; kvstore lays a chunk out in K and V halves"
            )

    @property
    def v_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def state_size(self) -> int:
        """Elements a token keeps per head: K's and V's head sizes together."""
        return self.head_size + self.v_size

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def page_elements(self) -> int:
        """Elements of one layer's page: ``H * N * (D_k + D_v)``."""
        return self.num_kv_heads * self.block_size * self.state_size

    @property
    def page_bytes(self) -> int:
        return self.page_elements * DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """One block of every layer: one kvstore chunk."""
        return self.num_layers * self.page_bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def layout(self) -> KVLayout:
        """The chunk as kvstore's ``(L, 2, N, H, D)``: ``2D`` is K's and V's head sizes
        together (``state_size``), which the layout's name spells out where they differ."""
        name = PAGE_LAYOUT
        if self.v_size != self.head_size:
            name = f"{PAGE_LAYOUT}:k{self.head_size}v{self.v_size}"
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.state_size // 2,
            dtype=self.dtype,
            chunk_tokens=self.block_size,
            name=name,
            page_tokens=self.block_size,
        )

    @functools.lru_cache(maxsize=256)  # noqa: B019  (a few salts per deployment; frozen self)
    def namespace(self, salt: str | None) -> Namespace:
        """The namespace of requests with ``cache_salt`` ``salt``.

        SHA-256 places vLLM's hashes inside it: they are SHA-256 themselves by
        default, and wrapping them in a weaker hash would undo that.
        """
        group = "" if self.group_layer is None else f":{self.group_layer}"
        return Namespace(
            f"vllm:{self.model}:tp{self.tp_rank}/{self.tp_size}{group}",
            self.layout,
            tenant_salt=salt,
            hash_algo=HashAlgo.SHA256,
        )

    def keys(self, salt: str | None, hashes: tuple[bytes, ...] | list[bytes]) -> list[ChunkKey]:
        return external_keys(self.namespace(salt), list(hashes))


def page_formats(vllm_config: Any, kv_cache_config: Any, tp_rank: int) -> tuple[PageFormat, ...]:
    """The format of each of ``kv_cache_config``'s KV cache groups, in vLLM's group order.

    Full attention, MLA (``MLAAttentionSpec``: one latent a token) and sliding
    windows are stored. Other specs (SSM state, chunked local attention, cross
    attention), groups of different block sizes and padded pages are refused
    with a ``ConfigError`` naming them, rather than stored in a shape the other
    side could misread.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    model_config = vllm_config.model_config
    formats = []
    for group in groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind not in _STORED_SPECS or not all(
            hasattr(spec, attribute) for attribute in ("num_kv_heads", "head_size", "dtype")
        ):
            raise ConfigError(
                f"the kvstore vLLM connector stores full-attention, sliding-window and MLA "
                f"pages, not {kind} (layers {list(group.layer_names)})"
            )
        head_size_v = getattr(spec, "head_size_v", None)
        window = getattr(spec, "sliding_window", None) if kind == "SlidingWindowSpec" else None
        pages = PageFormat(
            model=f"{model_config.model}@{model_config.revision or 'main'}",
            layer_names=tuple(group.layer_names),
            num_kv_heads=int(spec.num_kv_heads),
            head_size=int(spec.head_size),
            dtype=str(spec.dtype).removeprefix("torch."),
            block_size=int(spec.block_size),
            tp_rank=tp_rank,
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            head_size_v=None if head_size_v is None else int(head_size_v),
            group_layer=group.layer_names[0] if len(groups) > 1 else None,
            sliding_window=None if window is None else int(window),
        )
        if int(spec.page_size_bytes) != pages.page_bytes:
            raise ConfigError(
                f"vLLM pages of {spec.page_size_bytes} bytes are padded or packed; the "
                f"connector stores plain pages of {pages.page_bytes} bytes"
            )
        formats.append(pages)
    if len({pages.block_size for pages in formats}) != 1:
        raise ConfigError(
            "the kvstore vLLM connector needs one block size for every KV cache group, not "
            f"{[pages.block_size for pages in formats]}"
        )
    return tuple(formats)


def lookup_group(formats: Sequence[PageFormat]) -> int:
    """The group whose chain a lookup asks for: the first of full attention (every block
    of a prefix is in its pages), else the first."""
    return next((i for i, pages in enumerate(formats) if pages.sliding_window is None), 0)

"""What callers hand the store and get back: KV chunks and cached prefixes.

A chunk is the KV of ``chunk_tokens`` tokens in the namespace's layout,
``(num_layers, 2, chunk_tokens, num_kv_heads, head_dim)`` of its dtype. Callers
may pass a torch tensor (any device), a numpy array or raw bytes of exactly
the right size; anything else is refused with ``LayoutMismatch`` before any
byte is stored. torch is imported only to make a tensor (``KVChunk.tensor``):
a value is recognised as one without it (``kvstore.tensors``), so a store
that is only ever handed bytes, the daemon's, never loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from kvstore.block import copy_into
from kvstore.errors import LayoutMismatch
from kvstore.keys import ChunkKey, KVLayout
from kvstore.kinds import TierKind
from kvstore.tensors import is_tensor

if TYPE_CHECKING:
    import torch

ChunkData: TypeAlias = "torch.Tensor | np.ndarray | bytes | bytearray | memoryview"


@dataclass(frozen=True, slots=True)
class ChunkPages:
    """A get's destination for one chunk whose bytes go to several places, in order.

    A paged KV cache keeps a block's KV as one page per layer, each layer in an
    array of its own (vLLM's per-layer views of its CPU cache): ``pages[i]``
    takes the chunk's next ``pages[i].size`` bytes. A get into ``ChunkPages``
    lands each payload straight in the pages where it can (a daemon's
    shared-memory arena), instead of in a staging row that is then scattered
    page by page: one copy of the KV, not two (``kvstore.store.out_buffers``).
    Each page is a flat, writable, contiguous uint8 array in host memory.
    """

    pages: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(page.size for page in self.pages)

    def check(self, layout: KVLayout) -> None:
        """Refuse pages that are not flat writable uint8 arrays of one chunk in all."""
        for page in self.pages:
            if page.dtype != np.uint8 or page.ndim != 1 or not page.flags.c_contiguous:
                raise LayoutMismatch("chunk pages must be flat contiguous uint8 arrays")
            if not page.flags.writeable:
                raise LayoutMismatch("chunk pages must be writable")
        if self.nbytes != layout.chunk_nbytes:
            raise LayoutMismatch(
                f"chunk pages hold {self.nbytes} bytes, one chunk needs {layout.chunk_nbytes}"
            )

    def fill(self, payload: memoryview | np.ndarray) -> None:
        """Copy one chunk's raw bytes into the pages."""
        copy_into(payload, self.pages)


OutData: TypeAlias = "ChunkData | ChunkPages"
"""What a get's ``out=`` takes for each key: a buffer or tensor of one chunk, or pages."""


def chunk_bytes(data: ChunkData, layout: KVLayout) -> memoryview:
    """A flat byte view of one chunk, validated against ``layout`` (copies only off-CPU)."""
    if is_tensor(data):
        import torch  # imported already: the caller holds a tensor

        if str(data.dtype).removeprefix("torch.") != layout.dtype:
            raise LayoutMismatch(f"chunk dtype {data.dtype} is not the namespace's {layout.dtype}")
        if tuple(data.shape) != layout.chunk_shape:
            raise LayoutMismatch(
                f"chunk shape {tuple(data.shape)} is not the namespace's {layout.chunk_shape}"
            )
        flat = data.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        return flat.numpy().data
    if isinstance(data, np.ndarray):
        if data.dtype.name != layout.dtype and data.dtype != np.uint8:
            raise LayoutMismatch(f"chunk dtype {data.dtype} is not the namespace's {layout.dtype}")
        if data.dtype != np.uint8 and data.shape != layout.chunk_shape:
            raise LayoutMismatch(
                f"chunk shape {data.shape} is not the namespace's {layout.chunk_shape}"
            )
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    elif isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data).cast("B") if memoryview(data).ndim else memoryview(data)
    else:
        raise LayoutMismatch(f"unsupported chunk type {type(data).__name__}")
    if view.nbytes != layout.chunk_nbytes:
        raise LayoutMismatch(
            f"chunk has {view.nbytes} bytes, the namespace's layout needs {layout.chunk_nbytes}"
        )
    return view


@dataclass(frozen=True, slots=True)
class KVChunk:
    """One chunk read from the store: verified payload bytes plus where they came from.

    ``payload`` is owned by the chunk (never a view into a tier's memory), so
    it stays valid after the store evicts or overwrites the block. ``block`` is
    the whole verified stored block (header and payload) when the payload was
    stored raw, so a server can forward it as it is, checksum included.
    A chunk that a get put in an ``out=`` tensor on a device holds that tensor
    (``out``) and an empty payload, as does one that landed in ``ChunkPages``
    (``pages``) (``kvstore.store.out_buffers``).
    """

    key: ChunkKey
    tier: TierKind
    layout: KVLayout
    payload: memoryview
    block: memoryview | None = None
    out: torch.Tensor | None = None  # the device tensor holding the payload, flat uint8
    pages: ChunkPages | None = None  # the pages holding the payload

    def tensor(self) -> torch.Tensor:
        """The chunk as a tensor of the layout's shape and dtype: a view of the device
        tensor it landed in, a copy of the pages it landed in, else on the CPU (no
        copy when possible)."""
        import torch

        dtype: Any = getattr(torch, self.layout.dtype)
        if self.out is not None:
            return self.out.view(dtype).reshape(self.layout.chunk_shape)
        if self.pages is not None:
            raw = torch.from_numpy(np.concatenate(self.pages.pages))
            return raw.view(dtype).reshape(self.layout.chunk_shape)
        if self.payload.readonly:
            raw = torch.from_numpy(np.frombuffer(self.payload, dtype=np.uint8).copy())
        else:
            raw = torch.frombuffer(self.payload, dtype=torch.uint8)
        return raw.view(dtype).reshape(self.layout.chunk_shape)


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The answer to ``lookup``: how many leading tokens are cached, and where.

    ``keys`` and ``tiers`` cover the cached chunks only (the leading run);
    ``tiers[i]`` is the fastest tier holding chunk ``i``. ``load_chunks`` says
    how many of them are worth loading: where loading from a slow tier takes
    longer than recomputing (``config.CostModel``), the engine should load the
    first ``load_chunks`` and recompute the rest. ``None`` means all of them.
    """

    chunk_tokens: int
    keys: tuple[ChunkKey, ...]
    tiers: tuple[TierKind, ...]
    total_chunks: int
    load_chunks: int | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return self.num_chunks * self.chunk_tokens

    @property
    def load_tokens(self) -> int:
        """Leading tokens worth loading rather than recomputing."""
        chunks = self.num_chunks if self.load_chunks is None else self.load_chunks
        return chunks * self.chunk_tokens

"""A get's ``out=`` buffers: every payload lands and is verified in host memory, then,
for a tensor on a CUDA device, is copied to it.

Every check of a block (its checksum, its key and layout, an extent's
generation) reads host bytes, the same for every tier and both the embedded
store and the daemon's client. So each ``out=`` buffer gives the get a host
array its payload lands in (``host``), and the get runs exactly as it does
for host buffers::

    out[i]                              host[i]                  once the get is verified
    in host memory (a CPU tensor,       that buffer itself       nothing more: the payload
      numpy array, bytearray, view)                              is in place (one copy)
    a tensor on a CUDA device           a row of the get's own   each hit copied to its
                                        pinned staging           tensor (``deliver``)
    ``ChunkPages`` (a paged cache's     a row of the get's own   each hit copied to its
      pages, in host memory)              host staging             pages (``deliver``)

A staged block reaches its tensor only after it was proven, so one that fails
a check, or was missed, never does: that tensor keeps what it held (a host
buffer's content is unspecified after a miss, as it may hold the failed
copy). The daemon's HBM blocks that the client copies device to device
(``client.device``) are the exception that skips the staging: they go
straight into the tensor and are proven by their extent's generation after
the copy (``landed``). So are the DRAM blocks a shared-memory client copies
into ``ChunkPages`` (``direct``): each lands in its pages and is proven there,
one copy where staging would take two; a block that fails a check there is a
miss whose pages hold unspecified bytes, as a host buffer's do.

A chunk that landed in a device tensor carries it (``KVChunk.out``;
``KVChunk.tensor()`` is it) and an empty payload: its bytes do not stay in
host memory, the staging is dropped when the get returns. A chunk that landed
in pages carries them (``KVChunk.pages``) and an empty payload. The device copy is
``copy_to_device``, the one function here that runs only with CUDA; the rest
runs on CPU tensors too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore.errors import LayoutMismatch
from kvstore.keys import ChunkKey, KVLayout
from kvstore.kinds import TierKind
from kvstore.store.chunk import ChunkData, ChunkPages, KVChunk, OutData
from kvstore.tensors import is_tensor

if TYPE_CHECKING:
    import torch

# Where an ``out=`` tensor may lie: host memory, or a device its payload is copied to.
_DEVICE_TYPES = ("cpu", "cuda")
# The payload of a chunk whose bytes are only in a device tensor or in pages.
_ELSEWHERE = memoryview(b"")


@dataclass(frozen=True)
class OutBuffers:
    """The ``out=`` buffers of one get, as the module docstring draws them."""

    # Where payload ``i`` lands and is verified: the caller's buffer, or staging.
    host: list[np.ndarray]
    # A flat uint8 view of every buffer, on its own device, when every one is a
    # tensor (``None`` otherwise): what device-to-device copies go into.
    tensors: list[torch.Tensor] | None
    # The positions whose ``host`` array is staging, and the device tensor of each.
    devices: dict[int, torch.Tensor]
    # The positions whose ``host`` array is staging for pages, and their pages.
    pages: dict[int, ChunkPages]

    @classmethod
    def of(cls, out: Sequence[OutData], layout: KVLayout, count: int) -> OutBuffers:
        """The buffers for a get of ``count`` keys; raises ``LayoutMismatch`` for a
        count, size, dtype or device that does not fit, before any I/O."""
        if len(out) != count:
            raise LayoutMismatch(f"{len(out)} destinations for {count} keys")
        targets = [destination_tensor(data, layout) if is_tensor(data) else None for data in out]
        devices = {
            i: target
            for i, target in enumerate(targets)
            if target is not None and target.device.type != "cpu"
        }
        pages = {i: data for i, data in enumerate(out) if isinstance(data, ChunkPages)}
        for data in pages.values():
            data.check(layout)
        device_rows = iter(_staging(len(devices), layout.chunk_nbytes))
        page_rows = iter(np.empty((len(pages), layout.chunk_nbytes), dtype=np.uint8))
        host = [
            next(device_rows)
            if i in devices
            else next(page_rows)
            if i in pages
            else _host_bytes(cast(ChunkData, data), target, layout)
            for i, (data, target) in enumerate(zip(out, targets, strict=True))
        ]
        tensors = [t for t in targets if t is not None]
        return cls(host, tensors if len(tensors) == count else None, devices, pages)

    @property
    def direct(self) -> list[np.ndarray | ChunkPages]:
        """Where a copy that can write pages lands each payload: ``host``, but the pages
        themselves where the caller gave pages (``client.blocks.copy_leased``)."""
        return [self.pages.get(i, array) for i, array in enumerate(self.host)]

    def landed(self, index: int, key: ChunkKey, tier: TierKind, layout: KVLayout) -> KVChunk:
        """The chunk of a block copied straight into tensor ``index`` and proven there."""
        if index in self.devices:
            return KVChunk(key, tier, layout, _ELSEWHERE, out=self.devices[index])
        return KVChunk(key, tier, layout, self.host[index].data)

    def deliver(self, chunks: Sequence[KVChunk | None]) -> list[KVChunk | None]:
        """Copy each verified staged payload into its device tensor or its pages (a
        miss is not copied); the chunks, those in device tensors and pages as the
        module docstring says."""
        pending = {
            index: chunk
            for index in sorted(self.devices)
            if (chunk := chunks[index]) is not None and chunk.out is None
        }
        targets = [self.devices[index] for index in pending]
        copy_to_device([self.host[index] for index in pending], targets)
        delivered = list(chunks)
        for (index, chunk), target in zip(pending.items(), targets, strict=True):
            delivered[index] = dataclasses.replace(
                chunk, payload=_ELSEWHERE, block=None, out=target
            )
        for index, pages in self.pages.items():
            chunk = chunks[index]
            if chunk is not None and chunk.pages is None:  # staged: fetched as bytes
                pages.fill(self.host[index])
                delivered[index] = in_pages(chunk, pages)
        return delivered


def in_pages(chunk: KVChunk, pages: ChunkPages) -> KVChunk:
    """``chunk``, its payload proven to be in ``pages``."""
    return dataclasses.replace(chunk, payload=_ELSEWHERE, block=None, pages=pages)


def host_arrays(buffers: OutBuffers | None) -> list[np.ndarray] | None:
    """Where a get's payloads land and are verified (``OutBuffers.host``), if it has
    ``out=`` buffers at all."""
    return None if buffers is None else buffers.host


def destination_tensor(data: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A caller's ``out=`` tensor as a flat uint8 view of one chunk, where it lies: a
    contiguous tensor of the layout's dtype and exactly one chunk's size, in host
    memory or on a CUDA device (``LayoutMismatch`` otherwise)."""
    import torch  # imported already: the caller holds a tensor

    if data.device.type not in _DEVICE_TYPES:
        raise LayoutMismatch(
            f"destination tensors must be in host memory or on a CUDA device, not on "
            f"{data.device.type!r}"
        )
    if str(data.dtype).removeprefix("torch.") != layout.dtype or not data.is_contiguous():
        raise LayoutMismatch(f"destination must be a contiguous {layout.dtype} tensor")
    flat = data.view(torch.uint8).reshape(-1)
    _check_size(flat.numel(), layout)
    return flat


def copy_to_device(sources: Sequence[np.ndarray], targets: Sequence[torch.Tensor]) -> None:
    """Copy verified host payloads into their tensors, landed when this returns.

    Each copy is queued on its device's current stream, so it runs after the
    caller's work already queued there, which may still read the tensor; then
    the stream is waited for, so any stream sees the payload once the get
    returns, as it would a host buffer's.
    """
    if not targets:
        return
    import torch  # imported already: the caller holds the tensors

    for source, target in zip(sources, targets, strict=True):
        target.copy_(torch.from_numpy(source), non_blocking=True)
    for device in {target.device for target in targets}:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _staging(count: int, nbytes: int) -> list[np.ndarray]:
    """``count`` host rows of ``nbytes``, in one pinned allocation (the device copies
    then run as DMA; torch caches pinned blocks, so a get does not pay to pin)."""
    if not count:
        return []
    import torch  # imported already: the caller holds a device tensor

    return list(torch.empty((count, nbytes), dtype=torch.uint8, pin_memory=True).numpy())


def _host_bytes(data: ChunkData, target: torch.Tensor | None, layout: KVLayout) -> np.ndarray:
    """A writable flat uint8 view of a host buffer for one chunk: a CPU tensor
    (``target``, its view), a contiguous numpy array, a ``bytearray`` or a writable
    ``memoryview``; written in place, never copied."""
    if target is not None:
        return target.numpy()
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise LayoutMismatch("destination arrays must be contiguous")
        array = data.reshape(-1).view(np.uint8)
    elif isinstance(data, bytearray | memoryview):
        array = np.frombuffer(data, dtype=np.uint8)
    else:
        raise LayoutMismatch(f"unsupported destination type {type(data).__name__}")
    if not array.flags.writeable:
        raise LayoutMismatch("destination buffer is read-only")
    _check_size(array.nbytes, layout)
    return array


def _check_size(nbytes: int, layout: KVLayout) -> None:
    if nbytes != layout.chunk_nbytes:
        raise LayoutMismatch(
            f"destination has {nbytes} bytes, one chunk needs {layout.chunk_nbytes}"
        )

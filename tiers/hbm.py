"""GPU HBM tier: an arena in one pre-allocated device tensor, shareable with local clients.

Blocks are copied in and out on a dedicated CUDA stream through pinned host
staging buffers, so transfers run as DMA and do not serialise behind the
engine's compute stream. The same class runs with ``device="cpu"`` (tests
only): the arena is then a tensor over a host shared-memory segment and the
copies are plain memcpy, which lets the tier's logic, and the sharing below,
be tested on machines without a GPU.

Sharing with a same-host engine (the daemon's ``"shm"`` gets, ``client.device``)::

    device memory                      host shared memory (kvstore-<pid>-<hex>)
    [0, capacity)  blocks (extents)    [0, 8 * pages)  extent generations, a u64
                                                       per 4 KiB page of the blocks
    exported once as an ``ArenaHandle`` (``kvstore.tiers.arena_handle``):
      CUDA: a CUDA IPC handle of the arena's storage
      CPU:  the name of its segment

The generations are the DRAM tier's seqlock (``kvstore.tiers.arena_tier``),
kept in host memory even though the blocks are on the device: a client that
copied a block device to device synchronises its copy, then reads the
counter; unchanged means the extent was not freed, so not rewritten,
meanwhile. The daemon bumps a counter (a host store) before the freed extent
can be written again (a host-issued copy), so the order is the one the DRAM
path relies on.

An arena is shared only if its tier config allows it (``share``): a CUDA IPC
handle opens the memory read-write in the client, unlike the DRAM arena's
read-only mapping, so an operator who does not trust every local engine turns
it off, and HBM blocks then travel as bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.kinds import TierKind
from kvstore.tiers.arena_handle import ArenaHandle, HandleKind
from kvstore.tiers.arena_tier import ArenaTier
from kvstore.tiers.dram import SharedMemoryArena
from kvstore.tiers.extents import PAGE_BYTES


class DeviceArena:
    """A flat uint8 tensor on ``device``; copies go through pinned staging on CUDA.
    On the CPU the tensor lies in a host shared-memory segment (``shared``)."""

    def __init__(self, nbytes: int, device: str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("HBM tier configured on CUDA but no CUDA device is available")
        self.nbytes = nbytes
        self._cuda = self.device.type == "cuda"
        self.shared: SharedMemoryArena | None = None
        if self._cuda:
            self._tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            self.shared = SharedMemoryArena(nbytes, pin=False)
            self._tensor = torch.from_numpy(self.shared.array(0, nbytes, np.uint8))
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._staging_lock = threading.Lock()
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=self._cuda)

    def write(self, offset: int, parts: Sequence[memoryview | bytes]) -> None:
        for part in parts:
            source = np.frombuffer(part, dtype=np.uint8)
            length = source.size
            if self._cuda:
                with self._staging_lock:
                    staging = self._staging_of(length)
                    staging.numpy()[:] = source
                    assert self._stream is not None
                    with torch.cuda.stream(self._stream):
                        self._tensor[offset : offset + length].copy_(staging, non_blocking=True)
                    self._stream.synchronize()
            else:
                self._tensor.numpy()[offset : offset + length] = source
            offset += length

    def read_into(self, offset: int, out: np.ndarray) -> None:
        nbytes = out.size
        target = torch.from_numpy(out)
        if self._cuda:
            with self._staging_lock:
                staging = self._staging_of(nbytes)
                assert self._stream is not None
                with torch.cuda.stream(self._stream):
                    staging.copy_(self._tensor[offset : offset + nbytes], non_blocking=True)
                self._stream.synchronize()
                target.copy_(staging)
        else:
            target.copy_(self._tensor[offset : offset + nbytes])

    def export(self) -> tuple[HandleKind, str | None, dict[str, Any] | None]:
        """How a client opens this arena: its kind, segment name (CPU) or IPC fields
        (CUDA). Raises ``RuntimeError`` where the allocator cannot export it."""
        if self.shared is not None:
            return HandleKind.SHM, self.shared.name, None
        (
            device,
            handle,
            size,
            offset,
            ref_counter,
            ref_counter_offset,
            event,
            event_sync,
        ) = self._tensor.untyped_storage()._share_cuda_()
        ipc = {
            "device": int(device),
            "handle": bytes(handle).hex(),
            "storage_bytes": int(size),
            "storage_offset": int(offset),
            "ref_counter": bytes(ref_counter).hex(),
            "ref_counter_offset": int(ref_counter_offset),
            "event": bytes(event).hex() if event else "",
            "event_sync": bool(event_sync),
        }
        return HandleKind.CUDA_IPC, None, ipc

    def close(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.uint8)
        self._staging = torch.empty(0, dtype=torch.uint8)
        if self.shared is not None:
            self.shared.close()

    def _staging_of(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of at least ``nbytes``, grown on demand and reused."""
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes]


class HBMTier(ArenaTier):
    """Device-memory tier; ``device="cpu"`` runs the same logic without a GPU.
    ``share``: whether local clients may open the arena (``handle``)."""

    def __init__(self, capacity_bytes: int, *, device: str = "cuda", share: bool = True) -> None:
        self.arena = DeviceArena(capacity_bytes, device=device)
        pages = capacity_bytes // PAGE_BYTES
        self._counters = SharedMemoryArena(8 * max(pages, 1), pin=False)
        self._handle: ArenaHandle | None = None
        self._share = share
        super().__init__(
            TierKind.HBM,
            self.arena,
            generations=self._counters.array(0, max(pages, 1), np.uint64),
        )

    def handle(self) -> ArenaHandle | None:
        """How local clients open this arena (made once, then the same), or ``None``
        where it may not or cannot be shared."""
        if not self._share:
            return None
        if self._handle is None:
            try:
                kind, name, ipc = self.arena.export()
            except RuntimeError:  # e.g. an allocator whose memory IPC cannot export
                self._share = False
                return None
            self._handle = ArenaHandle(kind, self.capacity_bytes(), self._counters.name, name, ipc)
        return self._handle

    def generation_offset(self, offset: int) -> int:
        """Byte offset in the generations segment of the extent at ``offset``'s counter."""
        return 8 * self.generation_index(offset)

    def close(self) -> None:
        super().close()
        self._counters.close()

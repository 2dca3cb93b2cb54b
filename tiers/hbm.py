"""GPU HBM tier: an arena in one pre-allocated device tensor.

Blocks are copied in and out on a dedicated CUDA stream through pinned host
staging buffers, so transfers run as DMA and do not serialise behind the
engine's compute stream. The same class runs with ``device="cpu"``: the arena
is then an ordinary tensor and the copies are plain memcpy, which lets the
tier's logic be tested on machines without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.tiers.arena_tier import ArenaTier
from kvstore.tiers.kinds import TierKind


class DeviceArena:
    """A flat uint8 tensor on ``device``; copies go through pinned staging on CUDA."""

    def __init__(self, nbytes: int, device: str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("HBM tier configured on CUDA but no CUDA device is available")
        self.nbytes = nbytes
        self._tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._cuda = self.device.type == "cuda"
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

    def close(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.uint8)
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _staging_of(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of at least ``nbytes``, grown on demand and reused."""
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes]


class HBMTier(ArenaTier):
    """Device-memory tier; ``device="cpu"`` runs the same logic without a GPU."""

    def __init__(self, capacity_bytes: int, *, device: str = "cuda") -> None:
        self.arena = DeviceArena(capacity_bytes, device=device)
        super().__init__(TierKind.HBM, self.arena)

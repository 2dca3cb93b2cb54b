"""Copying a shared-memory get's leased blocks out of the daemon's arenas.

A ``"shm"`` get is answered with a lease: where each DRAM block lies in the daemon's
shared-memory segment and, for a get into ``out=`` tensors, where each HBM block
lies in its device arena. ``LeasedCopier`` keeps the two mappings and copies the
blocks out of them:

* DRAM blocks through the mapped segment (``client.shm``), checked as ``Verify``
  says, large batches of large blocks on a helper thread too (``blocks.copy_leased``),
  straight into the caller's pages where it gave ``ChunkPages``;
* HBM blocks device to device by CUDA IPC, proven by their generations
  (``client.device``). An arena that does not open here turns device memory off
  for good (``device_memory``), and its blocks come as bytes.

Each mapping is opened at first use and again when the daemon restarted with a new
one; the one it replaces is left to its last reference, since another thread may
still be copying out of it. What cannot be copied is marked inline, for the
protocol to fetch as bytes. Nothing here talks to the daemon: ``ClientProtocol``
asks for the lease and gives it back.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.client.blocks import LeasedBlock, Received, Verify, copy_leased
from kvstore.client.buffers import BufferPool
from kvstore.client.device import HBMArena, copy_device
from kvstore.client.failures import answer_field, unavailable
from kvstore.client.shm import SharedArena
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.store.out_buffers import OutBuffers
from kvstore.tiers.arena_handle import ArenaHandle

log = logging.getLogger("kvstore.client")


class LeasedCopier:
    """The daemon's arenas as this client maps them, and the copies out of them."""

    def __init__(self, verify: Verify, buffers: BufferPool) -> None:
        self.verify = verify
        self.device_memory = True
        self.arena: SharedArena | None = None
        self._hbm: HBMArena | None = None
        self._buffers = buffers
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-copy")

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.close()
        hbm, self._hbm = self._hbm, None
        if hbm is not None:
            hbm.close()

    def open_arena(self, name: str) -> SharedArena:
        """Map the daemon's DRAM segment ``name``; ``TierUnavailable`` if it cannot be."""
        try:
            arena = SharedArena(name)
        except (OSError, ValueError) as error:
            raise unavailable(f"cannot map the daemon's arena {name!r}: {error}") from None
        self.arena = arena
        return arena

    def copy(
        self, lease: Any, namespace: Namespace, keys: list[ChunkKey], buffers: OutBuffers | None
    ) -> tuple[Received, int]:
        """The blocks of ``lease`` copied out (those left ``inline`` to fetch as bytes),
        and how many HBM blocks fell back to bytes."""
        name = answer_field(lease, "shm", str)
        arena = self.arena
        if arena is None or arena.name != name:  # the daemon restarted: a new segment
            arena = self.open_arena(name)
        entries = [LeasedBlock.parse(entry) for entry in answer_field(lease, "blocks", list)]
        on_device = [
            (index, entry)
            for index, entry in enumerate(entries)
            if entry.tier is TierKind.HBM and not entry.inline
        ]
        copied: list[int] = []
        fallen: set[int] = set()
        if on_device:
            fallen = set(self._copy_device(lease, namespace, keys, on_device, buffers))
            copied = [index for index, _ in on_device if index not in fallen]
            for index, _ in on_device:  # left to copy_leased: inline, or done already
                entries[index] = LeasedBlock(None, None, None, inline=index in fallen)
        out = None if buffers is None else buffers.direct
        received = copy_leased(
            arena, namespace, keys, entries, out, self._buffers, self._copier, self.verify
        )
        for index in copied:
            assert buffers is not None
            received.chunks[index] = buffers.landed(
                index, keys[index], TierKind.HBM, namespace.layout
            )
        return received, len(fallen)

    def _copy_device(
        self,
        lease: Any,
        namespace: Namespace,
        keys: list[ChunkKey],
        on_device: list[tuple[int, LeasedBlock]],
        buffers: OutBuffers | None,
    ) -> list[int]:
        """Copy the leased HBM blocks into the ``out=`` tensors; the positions to fetch
        as bytes instead, every one of them if the arena does not open."""
        try:
            handle = ArenaHandle.from_json(lease.get("hbm"))
        except ValueError as error:
            raise unavailable(f"malformed lease: {error}") from None
        arena = self._hbm
        if arena is None or arena.handle != handle:
            arena = self._open_hbm(handle)
        tensors = None if buffers is None else buffers.tensors
        if arena is None or tensors is None:
            return [index for index, _ in on_device]
        return copy_device(arena, namespace, keys, on_device, tensors)

    def _open_hbm(self, handle: ArenaHandle) -> HBMArena | None:
        """Open the daemon's HBM arena, or stop asking for device memory for good."""
        try:
            arena = HBMArena.open(handle)
        except (OSError, ValueError, RuntimeError) as error:
            log.warning("getting HBM blocks as bytes: cannot open the daemon's arena: %s", error)
            self.device_memory = False
            return None
        self._hbm = arena
        return arena

"""HBM blocks copied device to device out of the daemon's HBM arena, for local engines.

A ``"shm"`` get that says ``device_memory`` may be shown blocks held in the
daemon's HBM tier like DRAM ones (offset, length, generation, generation_at),
under the same lease, with a handle that opens the arena
(``kvstore.tiers.arena_handle``). The client opens it once and keeps it
(``HBMArena.open``), then for each get::

    headers   copied to the host, one step for the batch; each parsed and
              checked (key, namespace, raw codec, one chunk's size)
    payloads  copied arena -> the caller's out= tensors, one step
    check     the copies synchronised, then each extent's generation read
              from the host segment: unchanged means the extent was not
              freed, so not rewritten, since the lease (``client.blocks``' FAST
              proof, the device copy complete before the counter's load)

A block that fails any step, and every block when the arena cannot be opened
or an ``out=`` tensor lies on another device than the arena, is fetched as
bytes instead (``fall_back``): never a wrong block. The payload is not
checksummed here (that would mean bringing it back to the host), so the
client asks for device memory only when it checks FAST; a FULL client gets HBM
blocks as bytes, checksummed.

Two kinds of arena, one path: ``CUDA_IPC`` opens torch's CUDA IPC handle and
copies on a stream of its own; ``SHM`` (a CPU HBM arena, which only tests
build) maps the segment read-only and copies with numpy, so everything but
the CUDA calls themselves runs on machines without a GPU. torch is imported
only by a client whose caller passed tensors.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.block import HEADER_BYTES, Codec, check_identity, check_payload_size, parse_header
from kvstore.client.blocks import LeasedBlock
from kvstore.client.shm import SharedArena
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import ChunkKey, Namespace
from kvstore.tiers.arena_handle import ArenaHandle, HandleKind

if TYPE_CHECKING:
    import torch


class HBMArena(abc.ABC):
    """The daemon's HBM arena opened in this process, and its generation counters."""

    def __init__(self, handle: ArenaHandle, generations: SharedArena) -> None:
        self.handle = handle
        self.generations = generations

    @staticmethod
    def open(handle: ArenaHandle) -> HBMArena:
        """Open the arena ``handle`` names; ``OSError``, ``ValueError`` or
        ``RuntimeError`` (CUDA) where this process cannot."""
        generations = SharedArena(handle.generations)
        try:
            if handle.kind is HandleKind.SHM:
                return _MappedArena(handle, generations)
            return _IpcArena(handle, generations)
        except BaseException:
            generations.close()
            raise

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the arena's memory is, and so where ``out=`` tensors must be."""

    @abc.abstractmethod
    def headers(self, offsets: Sequence[int]) -> list[bytes]:
        """The block header at each offset (in bounds), copied to the host (one step)."""

    @abc.abstractmethod
    def copy(self, offset: int, destination: torch.Tensor) -> None:
        """Start copying ``destination.numel()`` bytes at ``offset`` (in bounds) into it."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until every copy started has landed."""

    def close(self) -> None:
        self.generations.close()


class _MappedArena(HBMArena):
    """A CPU arena in a host segment, mapped read-only (``HandleKind.SHM``)."""

    def __init__(self, handle: ArenaHandle, generations: SharedArena) -> None:
        assert handle.name is not None
        super().__init__(handle, generations)
        self._arena = SharedArena(handle.name)

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def headers(self, offsets: Sequence[int]) -> list[bytes]:
        found = []
        for offset in offsets:
            with self._arena.block(offset, HEADER_BYTES) as view:
                found.append(bytes(view))
        return found

    def copy(self, offset: int, destination: torch.Tensor) -> None:
        with self._arena.block(offset, destination.numel()) as view:
            np.copyto(destination.numpy(), np.frombuffer(view, dtype=np.uint8))

    def synchronize(self) -> None:
        """Nothing to wait for: a CPU copy has landed when ``copy`` returns."""

    def close(self) -> None:
        self._arena.close()
        super().close()


class _IpcArena(HBMArena):
    """A CUDA arena opened by its IPC handle (``HandleKind.CUDA_IPC``); copies run on
    a stream of this client's own."""

    def __init__(self, handle: ArenaHandle, generations: SharedArena) -> None:
        import torch

        ipc = handle.ipc
        assert ipc is not None
        super().__init__(handle, generations)
        storage = _open_ipc(ipc)
        self._tensor = torch.empty(0, dtype=torch.uint8, device=storage.device)
        self._tensor.set_(storage, 0, (handle.size,), (1,))
        self._stream = torch.cuda.Stream(device=storage.device)

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    def headers(self, offsets: Sequence[int]) -> list[bytes]:
        import torch

        staging = torch.empty((len(offsets), HEADER_BYTES), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self._stream):
            for row, offset in enumerate(offsets):
                staging[row].copy_(self._tensor[offset : offset + HEADER_BYTES], non_blocking=True)
        self._stream.synchronize()
        return [bytes(row.numpy()) for row in staging]

    def copy(self, offset: int, destination: torch.Tensor) -> None:
        import torch

        source = self._tensor[offset : offset + destination.numel()]
        # The caller's tensor is used on its current stream once this returns.
        self._stream.wait_stream(torch.cuda.current_stream(destination.device))
        with torch.cuda.stream(self._stream):
            destination.copy_(source, non_blocking=True)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        import torch

        self._tensor = torch.empty(0, dtype=torch.uint8)
        super().close()


def _open_ipc(ipc: dict[str, Any]) -> Any:
    """The daemon's arena storage, opened from the fields of its ``_share_cuda_()``."""
    import torch

    torch.cuda.init()
    return torch.UntypedStorage._new_shared_cuda(
        int(ipc["device"]),
        bytes.fromhex(ipc["handle"]),
        int(ipc["storage_bytes"]),
        int(ipc["storage_offset"]),
        bytes.fromhex(ipc["ref_counter"]),
        int(ipc["ref_counter_offset"]),
        bytes.fromhex(ipc["event"]) if ipc["event"] else None,
        bool(ipc["event_sync"]),
    )


@dataclass(frozen=True, slots=True)
class _Pending:
    """A block being copied: its position in the get, where it lies in the arena and
    its generation counter, the generation leased, and its ``out=`` tensor."""

    index: int
    offset: int
    generation_at: int
    generation: int
    destination: torch.Tensor


def copy_device(
    arena: HBMArena,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    entries: Sequence[tuple[int, LeasedBlock]],
    out: Sequence[torch.Tensor],
) -> list[int]:
    """Copy the leased HBM blocks ``entries`` (``(position, entry)``) into the flat
    uint8 tensors ``out[position]``, as the module docstring says; the positions
    that must be fetched as bytes instead (the others hold their chunk)."""
    fall_back: list[int] = []
    pending: list[_Pending] = []
    chunk_nbytes = namespace.layout.chunk_nbytes
    for index, entry in entries:
        block = _pending(arena, index, entry, out[index], chunk_nbytes)
        if block is None:
            fall_back.append(index)
        else:
            pending.append(block)
    if not pending:
        return fall_back
    copying: list[_Pending] = []
    headers = arena.headers([block.offset for block in pending])
    for block, header in zip(pending, headers, strict=True):
        if _names(header, namespace, keys[block.index], chunk_nbytes):
            copying.append(block)
            arena.copy(block.offset + HEADER_BYTES, block.destination)
        else:
            fall_back.append(block.index)
    arena.synchronize()
    for block in copying:
        if arena.generations.generation(block.generation_at) != block.generation:
            fall_back.append(block.index)  # freed since the lease: what landed is unknown
    return sorted(fall_back)


def _pending(
    arena: HBMArena,
    index: int,
    entry: LeasedBlock,
    destination: torch.Tensor,
    chunk_nbytes: int,
) -> _Pending | None:
    """Block ``index`` to copy, if it can be: one chunk inside the arena, with a
    generation to check, bound for a tensor of one chunk on the arena's device."""
    offset, generation, at = entry.offset, entry.generation, entry.generation_at
    if (
        offset is None
        or generation is None
        or at is None
        or destination.device != arena.device
        or destination.numel() != chunk_nbytes
        or entry.length != HEADER_BYTES + chunk_nbytes
        or not 0 <= offset <= arena.handle.size - entry.length
    ):
        return None
    return _Pending(index, offset, at, generation, destination)


def _names(header: bytes, namespace: Namespace, key: ChunkKey, chunk_nbytes: int) -> bool:
    """Whether a block's header names this key and namespace and a raw payload of one
    chunk, so the payload may be copied into an ``out=`` tensor as it lies."""
    try:
        parsed = parse_header(header)
        check_identity(parsed, namespace, key)
        check_payload_size(parsed, chunk_nbytes)
    except (CorruptBlock, LayoutMismatch):
        return False
    return parsed.codec is Codec.NONE

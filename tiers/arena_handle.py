"""How a local client opens the daemon's HBM arena: the handle a ``"shm"`` get carries.

Torch-free on purpose: the daemon sends it and the client parses it
(``client.device``) without either importing torch to do so. The tier that
makes one is ``kvstore.tiers.hbm``::

    {"kind": "cuda_ipc" | "shm",
     "size": bytes of blocks,
     "generations": "<host shared-memory segment of the extent generations>",
     "name": "<the arena's segment>"          (shm: a CPU arena, tests only)
     "ipc": {"device", "handle", "storage_bytes", "storage_offset",
             "ref_counter", "ref_counter_offset", "event", "event_sync"}}
                                              (cuda_ipc: UntypedStorage._share_cuda_(),
                                               byte strings as hex)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class HandleKind(enum.Enum):
    """How a client opens an HBM arena (``ArenaHandle.kind``)."""

    CUDA_IPC = "cuda_ipc"  # torch's CUDA IPC handle of the arena's storage
    SHM = "shm"  # a CPU arena (tests): the name of its shared-memory segment


@dataclass(frozen=True)
class ArenaHandle:
    """An HBM arena as a client opens it; ``to_json`` / ``from_json`` are the wire form."""

    kind: HandleKind
    size: int  # bytes of blocks (the arena's capacity)
    generations: str  # the host shared-memory segment of the extent generations
    name: str | None = None  # SHM: the arena's segment
    ipc: dict[str, Any] | None = None  # CUDA_IPC: the fields of ``_share_cuda_()``

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind.value,
            "size": self.size,
            "generations": self.generations,
        }
        if self.name is not None:
            data["name"] = self.name
        if self.ipc is not None:
            data["ipc"] = self.ipc
        return data

    @classmethod
    def from_json(cls, data: Any) -> ArenaHandle:
        """The handle a daemon sent; ``ValueError`` if it is not one."""
        try:
            handle = cls(
                HandleKind(data["kind"]),
                int(data["size"]),
                str(data["generations"]),
                None if data.get("name") is None else str(data["name"]),
                None if data.get("ipc") is None else dict(data["ipc"]),
            )
        except (AttributeError, KeyError, TypeError) as error:
            raise ValueError(f"not an arena handle: {data!r:.200}") from error
        needs = handle.name if handle.kind is HandleKind.SHM else handle.ipc
        if needs is None:
            raise ValueError(f"a {handle.kind.value} handle without its arena: {data!r:.200}")
        return handle


@runtime_checkable
class SharedDeviceTier(Protocol):
    """A tier whose arena local clients may open (``kvstore.tiers.hbm.HBMTier``): the
    daemon tells one apart by this, without importing torch to do so."""

    def handle(self) -> ArenaHandle | None:
        """How clients open the arena, or ``None`` where it is not shared."""

    def generation_offset(self, offset: int) -> int:
        """Byte offset in ``generations`` of the counter of the extent at ``offset``."""

"""``Reservation``: space in an arena tier that one writer fills before anyone may read it.

The daemon writes a put's blocks straight into the DRAM arena as they come off
the socket (``kvstore.server.landing``), so space for a block is taken before
its bytes are known to be good. The write therefore has two phases::

    SharedServing.reserve ──► Reservation: counted against the tier's capacity,
        │                     in no index (no reader finds it, no eviction takes it)
        │ view(): the writer fills and verifies the block there
        ▼
    SharedServing.put_landed(... Filled ...): published with the rest of its put,
    into the tier's index, then the store's ── or ── abort(): the space goes back

Every reservation ends exactly once, published or given back; the store does
either under its lock, and a second ``abort`` (or one after publishing) does
nothing. The arena lives in this process and the index in memory, so a daemon
killed mid-write leaves nothing of a reservation anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind


class ReservationOwner(Protocol):
    """The store that handed reservations out, and takes them back."""

    def give_back(self, reservations: Sequence[Reservation]) -> None: ...


class Reservation:
    """``nbytes`` of arena tier ``kind`` at ``offset``, reserved for one writer (module
    docstring). ``open`` until its owner publishes it or it is given back."""

    def __init__(
        self,
        kind: TierKind,
        offset: int,
        nbytes: int,
        space: memoryview,
        owner: ReservationOwner,
    ) -> None:
        self.kind = kind
        self.offset = offset
        self.nbytes = nbytes
        self._space = space
        self._owner = owner
        self.open = True  # changed by the owner only, under its lock

    def view(self) -> memoryview:
        """The reserved bytes, writable: the writer's until the reservation ends."""
        return self._space

    def abort(self) -> None:
        """Give the space back (nothing, if it was published or given back already)."""
        self._owner.give_back([self])


@dataclass(frozen=True, slots=True)
class Filled:
    """A block written and verified in ``reservation``, waiting to be published as
    ``key`` (``parent``: its parent in the chain)."""

    key: ChunkKey
    parent: ChunkKey | None
    reservation: Reservation

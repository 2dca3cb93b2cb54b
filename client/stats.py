"""What a client did instead of raising: the counters of its failure model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ClientStats:
    """Counts since the client was created; mutated by ``ClientProtocol`` under its lock.

    ``*_failed`` / ``*_dropped`` count calls that degraded because the daemon
    could not serve them (down, too slow, 5xx, a malformed answer): a failed
    lookup answered "nothing cached", a failed get answered misses, a dropped
    put or event was not stored. ``corrupt_blocks`` counts received blocks
    that failed verification and were turned into misses.
    """

    lookups_failed: int = 0
    gets_failed: int = 0
    puts_dropped: int = 0
    events_dropped: int = 0
    corrupt_blocks: int = 0

    def snapshot(self) -> ClientStats:
        return dataclasses.replace(self)

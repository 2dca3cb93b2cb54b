"""The leases a client has finished copying out of, given back with its next get.

One job: which finished leases are still to be released, and by whom
(``ClientProtocol`` hands them to a get's body or to a delayed release call).
"""

from __future__ import annotations

import threading

# How long a finished lease waits to ride on this client's next get before it
# is released by a request of its own (``FinishedLeases``).
RELEASE_DELAY_S = 0.2


class FinishedLeases:
    """Leases this client has finished copying out of, not yet given back.

    Releasing a lease by a request of its own costs the client and the daemon
    a whole HTTP exchange per get, sent by a background thread that takes
    the GIL and a core from the next get's copy (2-4 ms for 128 MiB gets of
    2 MiB chunks on a 2-core host, against a 12-18 ms copy). A daemon that
    offers it (``release_with_get`` in the lease) takes them back in the
    body of the next get instead (its ``"release"`` list), which a busy
    engine sends within milliseconds. The bound: each finished lease is also
    handed to the shell as a release call delayed by ``RELEASE_DELAY_S``,
    sent only if no get took the lease first (``claim``), so a lease is held
    at most that much longer than its copy, and never past the daemon's TTL
    however this client fails.

    Exactly one of a get (``take``) and the delayed call (``claim``) gives a
    lease back: both remove it from the set under the lock. Thread safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, None] = {}  # insertion-ordered: the oldest first

    def add(self, lease_id: str) -> None:
        with self._lock:
            self._ids[lease_id] = None

    def claim(self, lease_id: str) -> bool:
        """Take ``lease_id`` to release it alone; ``False`` if a get took it already."""
        with self._lock:
            if lease_id not in self._ids:
                return False
            del self._ids[lease_id]
            return True

    def take(self) -> list[str]:
        """Take every finished lease, to release them with a get."""
        with self._lock:
            ids, self._ids = list(self._ids), {}
        return ids

    def __len__(self) -> int:
        return len(self._ids)

"""A body of known length read off a socket: what was read past its head first, then
the socket, ``recv_into`` the caller's buffers.

One reader for both ends: the daemon reads put bodies this way
(``kvstore.server.borrowed_body``), the blocking client get bodies
(``kvstore.client.get_body``). Each says how one read of its socket waits
and fails (``_receive``); the bookkeeping is here.
"""

from __future__ import annotations

import abc

from kvstore.wire.codes import ErrorCode, WireError

# The send buffer either end gives a Unix-socket connection before it sends KV (client
# puts, daemon gets): the default, ~208 KiB, is a tenth of a 2 MiB block, so sender
# and receiver would take turns. Linux caps it at net.core.wmem_max; TCP keeps its
# autotuning, which setting a size would turn off.
UNIX_SEND_BUFFER_BYTES = 4 << 20

_SKIP_BYTES = 1 << 20


class BodyReader(abc.ABC):
    """The ``length`` bytes of a body, none consumed yet: ``ahead`` (already read off
    the socket), then the socket. One thread at a time."""

    def __init__(self, ahead: bytes, length: int) -> None:
        self._ahead = memoryview(ahead)
        self.remaining = length

    def read_exact(self, nbytes: int) -> bytes:
        """The next ``nbytes`` of the body (small reads: lengths, metadata, headers)."""
        data = bytearray(nbytes)
        self.readinto(memoryview(data))
        return bytes(data)

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the body, or raise (a body shorter
        than its frames say is ``WireError(MALFORMED_BODY)``; a failing socket
        raises whatever ``_receive`` raises)."""
        if view.nbytes > self.remaining:
            raise WireError(ErrorCode.MALFORMED_BODY, "body ended before its last block")
        filled = 0
        if self._ahead.nbytes:
            filled = min(view.nbytes, self._ahead.nbytes)
            view[:filled] = self._ahead[:filled]
            self._ahead = self._ahead[filled:]
        while filled < view.nbytes:
            filled += self._receive(view[filled:])
        self.remaining -= view.nbytes

    def skip(self, nbytes: int) -> None:
        """Read and drop the next ``nbytes``."""
        scratch = memoryview(bytearray(min(nbytes, _SKIP_BYTES)))
        while nbytes:
            step = min(nbytes, scratch.nbytes)
            self.readinto(scratch[:step])
            nbytes -= step

    @abc.abstractmethod
    def _receive(self, view: memoryview) -> int:
        """Read at least one byte of the socket into ``view``; how many, or raise."""

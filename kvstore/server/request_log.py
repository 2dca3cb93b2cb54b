"""How the daemon logs a request it refuses: one line at debug level, never a traceback.

A client's mistake (a 4xx: a malformed request line, oversize headers, a body
that is not JSON) is the client's to read, in the answer; the daemon's log is
for the daemon's own faults. A client sending garbage in a loop must not fill
the disk, so a refusal costs at most one debug line. A bug (a 500) still goes
to the log with its traceback, at error level (``kvstore.server.app``).

Two sources of refusals:

* the ``errors`` middleware, for everything a route refuses (``refused``);
* aiohttp itself, for a request it could not parse, which it would log with
  its traceback at error level. Its request handler logs through
  ``AIOHTTP_LOG`` instead (``handler_args["logger"]``), which turns those
  records into ``refused`` lines and passes every other record on as it came.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("kvstore.server.requests")


def refused(what: str, status: int, message: str) -> None:
    """One debug line for a request answered with an error that is not a bug."""
    log.debug("refused %s: %d %s", what, status, message[:200])


class _AiohttpLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's request-handler logger, with parse errors logged as refusals."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        # aiohttp: exception("Error handling request from %s", remote, exc_info=error)
        if isinstance(exc_info, HttpProcessingError) and exc_info.code < 500:
            sender = f"a request from {args[0]}" if args else "a request"
            refused(sender, exc_info.code, exc_info.message or type(exc_info).__name__)
            return
        # aiohttp: exception("Unhandled exception", exc_info=error), reading what is left
        # of a body it cannot decode (a Content-Encoding that lies) after its answer.
        if isinstance(exc_info, RequestPayloadError):
            refused("the rest of a body", 400, str(exc_info))
            return
        # A client that hung up mid-request: nobody to answer, nothing to fix here.
        if isinstance(exc_info, ConnectionResetError):
            sender = f"a request from {args[0]}" if args else "a request"
            refused(sender, 499, "the client hung up before its request was read")
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


AIOHTTP_LOG = _AiohttpLog(logging.getLogger("aiohttp.server"))

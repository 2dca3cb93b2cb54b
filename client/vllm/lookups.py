"""The scheduler's lookups: sent when a request arrives, answered within a deadline.

vLLM asks a connector how much of a new request it holds
(``get_num_new_matched_tokens``) on its scheduler's thread, while it builds a
step: whatever that call waits, every running request waits with it. So the
lookup is never made there::

    request arrives ─► send(): queued for the lookup thread (one round trip each)
          │
    scheduler asks ─► answer(): waits for it at most what is left of this step's
          │                     wait_s (shared by every request asked about in the step)
          ├─ answered ─────────► the cached chunks: vLLM loads them
          ├─ not yet ──────────► None: vLLM skips the request this step, asks again
          │                      next step; the others run
          └─ deadline_s passed ► 0: nothing beyond vLLM's own hit, the request is
             since it was sent     computed (and counted late)

On a busy engine a lookup is answered before the scheduler reaches its request,
and the ask costs nothing. A daemon that stalls costs each step at most
``wait_s`` and each new request at most ``deadline_s`` of waiting, never a
wrong block. A lookup that fails answers 0 at once (the client counts it).

Threads: ``send``, ``answer``, ``new_step`` and ``forget`` are the scheduler
thread's; the lookup thread runs only the ``lookup`` function it is given.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvstore.client.vllm")

WAIT_S = 0.002
"""Default: what the scheduler waits for lookups in one step, all requests together."""
DEADLINE_S = 0.1
"""Default: how long after it was sent a lookup's answer is still taken."""


@dataclass(slots=True)
class LookupCounts:
    """What the scheduler's lookups came to, since the connector started."""

    sent: int = 0
    answered: int = 0  # asked about and answered in time
    not_yet: int = 0  # asks answered None: vLLM asked again later
    late: int = 0  # requests computed because their lookup missed its deadline
    waited_s: float = 0.0  # the scheduler thread's time in ``answer``


@dataclass(slots=True)
class _Pending:
    future: concurrent.futures.Future[int]
    sent: float


class Lookups:
    """Lookups run ahead on a thread of their own; see the module docstring.

    ``lookup(request)`` returns how many of the request's leading blocks are
    cached and worth loading; it must not raise (it answers 0 for a failure).
    """

    def __init__(
        self,
        lookup: Callable[[Any], int],
        wait_s: float = WAIT_S,
        deadline_s: float = DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if wait_s < 0 or deadline_s < 0:
            raise ValueError("a lookup's wait and deadline cannot be negative")
        self._lookup = lookup
        self._wait_s = wait_s
        self._deadline_s = deadline_s
        self._clock = clock
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "kvstore-lookup")
        self._pending: dict[str, _Pending] = {}  # req id -> its lookup
        self._waited = 0.0  # in this step
        self.counts = LookupCounts()

    def send(self, request: Any) -> None:
        """Start ``request``'s lookup, unless one is already on its way."""
        if request.request_id not in self._pending:
            future = self._thread.submit(self._lookup, request)
            self._pending[request.request_id] = _Pending(future, self._clock())
            self.counts.sent += 1

    def answer(self, request: Any) -> int | None:
        """The blocks ``request``'s lookup found; ``None``: not yet, ask again."""
        self.send(request)  # a request asked about again after a preemption
        pending = self._pending[request.request_id]
        start = self._clock()
        try:
            cached = pending.future.result(timeout=max(0.0, self._wait_s - self._waited))
        except concurrent.futures.TimeoutError:
            cached = None
        now = self._clock()
        self._waited += now - start
        self.counts.waited_s += now - start
        if cached is not None:
            self.counts.answered += 1
            return cached
        if now - pending.sent < self._deadline_s:
            self.counts.not_yet += 1
            return None
        self.counts.late += 1
        log.debug("kvstore lookup of request %s missed its deadline", request.request_id)
        return 0

    def new_step(self) -> None:
        """The scheduler finished a step: the next one may wait ``wait_s`` again."""
        self._waited = 0.0

    def forget(self, req_id: str) -> None:
        """``req_id`` was scheduled or ended: a later ask sends a fresh lookup."""
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            pending.future.cancel()

    def close(self) -> None:
        """Drop the lookups not yet sent; one on the wire ends with the client's timeout."""
        self._thread.shutdown(wait=False, cancel_futures=True)

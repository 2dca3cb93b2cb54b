"""The scheduler's lookups: sent when a request arrives, answered within a deadline.

vLLM asks a connector how much of a new request it holds
(``get_num_new_matched_tokens``) on its scheduler's thread, while it builds a
step: whatever that call waits, every running request waits with it. So the
lookup is never made there::

    request arrives ─► send(): queued for the lookup thread (one round trip each)
          │
    scheduler asks ─► answer(): what the scheduler remembers the store holds, if
          │                     anything, while the lookup is on its way
          │                     (``client.vllm.held_blocks``); else waits for it at
          │                     most what is left of this step's wait (shared by
          │                     every request asked about in the step)
          ├─ answered ─────────► the cached chunks: vLLM loads them
          ├─ not yet ──────────► None: vLLM skips the request this step, asks again
          │                      next step; the others run
          └─ its deadline passed ► 0: nothing beyond vLLM's own hit, the request is
             since it was sent     computed (and counted late)

vLLM adds a request and builds the next step right after, so a lookup has the
step's wait to be answered in, or its request waits a whole step. Waiting costs
every running request the time waited; skipping costs the new request a step.
So a step waits ``wait_s`` or ``wait_share`` of a step's time at vLLM's recent
pace, whichever is longer: on an engine whose steps take 60 ms (vLLM-CPU) a
lookup of a few ms is taken in the step it arrives in, while on one whose steps
take 20 ms the wait stays at ``wait_s``; the running requests' tokens come at
most that share later. A lookup that not even the fastest of the recent ones
would have answered within what is left of the wait (their time from send to
answer, less the time this one has been on its way) is not waited for at all: a
daemon slowed by other work would otherwise cost every step its whole wait for
nothing, while lookups that sometimes make it are still waited for.

Beyond the step's wait an ask never holds the step, so a late answer costs only
its own request, while giving up costs that request the prefill of its whole
prompt (and every request queued behind it that prefill's time: on vLLM-CPU an
8K-token prompt takes about 15 s). So a request's deadline is ``deadline_s`` or
``share`` of its prompt's prefill time, whichever is longer, the prefill time at
vLLM's own recent pace (``StepPace``). A daemon that stalls costs each step at
most its wait and each new request at most its deadline, never a wrong block.
A lookup that fails answers 0 at once (the client counts it).

An answer from memory is taken once per request (asked again, after a load
that failed or a preemption, it waits for its lookup) and only while the daemon
keeps up: once the lookup on the wire has waited past ``deadline_s``, the
daemon may be stalled, and a load planned from memory would wait for it until
the client's timeout. So a daemon that stalls may cost one load that timeout,
then answers from memory stop until it answers again.

Threads: ``send``, ``answer``, ``new_step`` and ``forget`` are the scheduler
thread's; the lookup thread runs only the ``lookup`` function it is given.
"""

from __future__ import annotations

import concurrent.futures
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.throttled_log import ThrottledLog

log = logging.getLogger("kvstore.client.vllm")

WAIT_S = 0.002
"""Default: what the scheduler waits for lookups in one step, all requests together,
at least."""
WAIT_SHARE = 0.05
"""Default: the part of a step's time the scheduler may wait for lookups, if longer."""
DEADLINE_S = 0.1
"""Default: how long after it was sent a lookup's answer is still taken, at least."""
SHARE = 0.1
"""Default: the part of its prompt's prefill time a request may wait for its lookup."""
PACE_MIN_TOKENS = 256
"""Steps that schedule fewer tokens (decode steps) say little about prefill speed."""
PACE_STEPS = 16
"""The pace is the median over this many recent steps (prefill steps, for the prefill
pace)."""
REPORT_S = 60.0
"""How often, at most, the lookups' counts are logged (while they change)."""


@dataclass(slots=True)
class LookupCounts:
    """What the scheduler's lookups came to, since the connector started."""

    sent: int = 0
    recalled: int = 0  # answered from what the scheduler remembers, lookup on its way
    answered: int = 0  # asked about and answered in time
    not_yet: int = 0  # asks answered None: vLLM asked again later
    late: int = 0  # requests computed because their lookup missed its deadline
    waited_s: float = 0.0  # the scheduler thread's time in ``answer``

    def __str__(self) -> str:
        return (
            f"{self.sent} sent, {self.recalled} answered from memory, "
            f"{self.answered} answered in time, {self.not_yet} asks "
            f"put off a step, {self.late} late; the scheduler waited "
            f"{1e3 * self.waited_s:.1f} ms in all"
        )


@dataclass(slots=True)
class _Pending:
    future: concurrent.futures.Future[int]
    sent: float
    deadline_s: float  # after ``sent``


class StepPace:
    """How long vLLM's steps take, and its seconds per scheduled token in prefill.

    The scheduler side sees a step's tokens when it builds the step's metadata and
    the next step's start when it builds the next one: their distance is the step's
    execution. A step after which the engine sat idle reads slower than it was, so
    both paces are medians of recent steps, not means; until a step is seen there
    is no pace, and waits and deadlines are their floors.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: tuple[float, int] | None = None  # (when, tokens) of the step before
        self._steps: deque[float] = deque(maxlen=PACE_STEPS)  # seconds each
        self._per_token: deque[float] = deque(maxlen=PACE_STEPS)  # of prefill steps

    def step(self, tokens: int) -> None:
        """A step that schedules ``tokens`` starts now."""
        now = self._clock()
        if self._last is not None:
            took = now - self._last[0]
            self._steps.append(took)
            if self._last[1] >= PACE_MIN_TOKENS:
                self._per_token.append(took / self._last[1])
        self._last = (now, tokens)

    def step_s(self) -> float | None:
        """What a step takes at the recent pace; ``None``: none seen yet."""
        return statistics.median(self._steps) if self._steps else None

    def seconds(self, tokens: int) -> float | None:
        """What prefilling ``tokens`` takes at the recent pace; ``None``: none seen yet."""
        return statistics.median(self._per_token) * tokens if self._per_token else None


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
        share: float = SHARE,
        clock: Callable[[], float] = time.monotonic,
        wait_share: float = WAIT_SHARE,
    ) -> None:
        if min(wait_s, deadline_s, share, wait_share) < 0:
            raise ValueError("a lookup's waits, deadline and shares cannot be negative")
        self._lookup = lookup
        self._wait_s = wait_s
        self._wait_share = wait_share
        self._deadline_s = deadline_s
        self._share = share
        self._clock = clock
        self.pace = StepPace(clock)
        self._late = ThrottledLog(log, every_s=60.0)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "kvstore-lookup")
        self._pending: dict[str, _Pending] = {}  # req id -> its lookup
        self._waited = 0.0  # in this step
        self._took: deque[float] = deque(maxlen=PACE_STEPS)  # recent lookups, sent to answered
        self._in_flight: float | None = None  # when the lookup on the wire was started
        self._recalled: set[str] = set()  # requests answered from memory once
        self._step_wait = wait_s  # what this step may wait (``step_wait_s``)
        self.counts = LookupCounts()
        self._reported = (self._clock(), str(self.counts))

    def send(self, request: Any) -> None:
        """Start ``request``'s lookup, unless one is already on its way."""
        if request.request_id not in self._pending:
            sent = self._clock()
            future = self._thread.submit(self._run, request)
            future.add_done_callback(lambda done: self._answered(done, sent))
            deadline_s = self.deadline_s(request.num_tokens)
            self._pending[request.request_id] = _Pending(future, sent, deadline_s)
            self.counts.sent += 1

    def _run(self, request: Any) -> int:
        """The lookup thread's work: one lookup, its start on record for ``_stalled``."""
        self._in_flight = self._clock()
        try:
            return self._lookup(request)
        finally:
            self._in_flight = None

    def _answered(self, future: concurrent.futures.Future[int], sent: float) -> None:
        """A lookup came back (on the lookup thread): how long it took, for ``answer``'s
        guess of when the next ones come."""
        if not future.cancelled():
            self._took.append(self._clock() - sent)

    def deadline_s(self, tokens: int) -> float:
        """How long after it is sent the lookup of a ``tokens``-token prompt is waited for."""
        prefill_s = self.pace.seconds(tokens)
        if prefill_s is None:
            return self._deadline_s
        return max(self._deadline_s, self._share * prefill_s)

    def step_wait_s(self) -> float:
        """What one step may wait for lookups, all requests together."""
        step_s = self.pace.step_s()
        if step_s is None:
            return self._wait_s
        return max(self._wait_s, self._wait_share * step_s)

    def answer(self, request: Any, recall: Callable[[], int] | None = None) -> int | None:
        """The blocks ``request``'s lookup found; ``None``: not yet, ask again.
        ``recall``: the blocks the scheduler remembers the store holds, the answer while
        the lookup is on its way, if any and the daemon keeps up (module docstring)."""
        self.send(request)  # a request asked about again after a preemption
        pending = self._pending[request.request_id]
        start = self._clock()
        if (
            recall is not None
            and not pending.future.done()
            and request.request_id not in self._recalled
            and not self._stalled(start)
        ):
            recalled = recall()
            if recalled:
                self._recalled.add(request.request_id)
                self.counts.recalled += 1
                return recalled
        wait = max(0.0, self._step_wait - self._waited)
        if not pending.future.done() and self._comes_in(pending, start) > wait:
            wait = 0.0
        try:
            cached = pending.future.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            cached = None
        now = self._clock()
        self._waited += now - start
        self.counts.waited_s += now - start
        if cached is not None:
            self.counts.answered += 1
            return cached
        if now - pending.sent < pending.deadline_s:
            self.counts.not_yet += 1
            return None
        self.counts.late += 1
        self._late.warning(
            "kvstore lookup of request %s had no answer %.0f ms after it was sent: "
            "computed without the store",
            request.request_id,
            (now - pending.sent) * 1e3,
        )
        return 0

    def _stalled(self, now: float) -> bool:
        """Whether the lookup on the wire has been waiting for the daemon over
        ``deadline_s``."""
        in_flight = self._in_flight  # one read: the lookup thread sets it
        return in_flight is not None and now - in_flight > self._deadline_s

    def _comes_in(self, pending: _Pending, now: float) -> float:
        """The soonest ``pending``'s answer may come, from now, at the fastest of recent
        lookups (0: none seen yet, or any time now)."""
        took = self._took.copy()  # one step under the GIL: the lookup thread appends
        return min(took) - (now - pending.sent) if took else 0.0

    def took_ms(self) -> float | None:
        """The median time from send to answer of recent lookups (``None``: none yet)."""
        took = self._took.copy()
        return 1e3 * statistics.median(took) if took else None

    def new_step(self, tokens: int) -> None:
        """The scheduler built a step of ``tokens``: the next one may wait again."""
        self._waited = 0.0
        self.pace.step(tokens)
        self._step_wait = self.step_wait_s()
        self._report()

    def _report(self) -> None:
        """Log the counts every ``REPORT_S`` while they change: an operator sees how
        often requests waited a step for their lookup, or went without it."""
        now = self._clock()
        if now - self._reported[0] < REPORT_S:  # every step comes here: format nothing
            return
        counts = str(self.counts)
        if counts != self._reported[1]:
            took = self.took_ms()
            recent = f"; recent lookups took {took:.1f} ms (median)" if took is not None else ""
            log.info("kvstore lookups: %s%s", counts, recent)
            self._reported = (now, counts)

    def forget(self, req_id: str, ended: bool = False) -> None:
        """``req_id`` was scheduled, or ``ended``: a later ask sends a fresh lookup."""
        if ended:
            self._recalled.discard(req_id)
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            pending.future.cancel()

    def close(self) -> None:
        """Drop the lookups not yet sent; one on the wire ends with the client's timeout."""
        self._thread.shutdown(wait=False, cancel_futures=True)

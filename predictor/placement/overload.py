"""When the engine cannot keep up: the admission queue as a placement policy sees it.

A forecast says when a session is *back*; placement pays off when its chain is
*read*. While the engine keeps up the two are moments apart. Once requests queue
for admission they are hours apart, and an engine that reports a request's
start as it arrives (rather than once admitted, as vLLM's connector does) makes
every queued session look back: its chain is ranked as running, prefetched,
promoted, and pushed out again by the chains admission loads before it is read.
On a coding-agent workload one GPU could not serve (``bench/overload.py``), that
cost 36% more GPU-seconds than LRU, and the oracle fed true arrivals lost as much:
the forecasts were right about the wrong event.

A policy cannot see the engine's queue, but it can see its shadow: the chains
of the sessions that started and have not finished. Running requests keep
theirs in the fastest tier, so the blocks beyond what that tier holds belong to
requests that wait, and they drain at the rate chains finish. While draining
them would take longer than SSD's horizon (``enter_wait_s``: a chain placed now
is then read later than any local tier plans for), for ``sustain_s``, the policy
falls back to LRU, the best simple rule there, until the wait is back under
DRAM's horizon (``leave_wait_s``) for as long. Shorter queues are left to the
forecasts: on kv-cache-tester's conversations with about 8 minutes of queue, a
fallback at DRAM's horizon cost the predictor 37% more GPU-seconds. A daemon
behind vLLM, which reports a start at admission, counts only running requests,
and so falls back only if they alone overflow the tier and finish too slowly to
drain it.

The same wait guards every prefetch, fallen back or not: a chain brought into a
tier whose blocks stay there a shorter time than its request will wait for
admission is pushed out unread, and its copy takes the tier's link from the
loads of the requests admitted meanwhile, so none is made (``late``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OverloadConfig:
    """When ``AdmissionWatch`` calls the engine overloaded, and when no longer."""

    enter_wait_s: float = 3600.0
    """The admission wait above which placement falls back: SSD's horizon, the longest a
    local tier plans a chain's return for."""
    leave_wait_s: float = 600.0
    """The wait below which it places by forecast again: DRAM's horizon."""
    sustain_s: float = 600.0
    """How long a wait must hold before the watch changes its mind, and how long the
    rate at which chains finish is smoothed over: a burst that the engine drains
    within minutes costs the forecasts nothing."""


@dataclass
class AdmissionWatch:
    """The blocks of the sessions started and not yet finished, beyond what the fastest
    tier holds, and how long the engine takes to drain them at the rate their chains
    finish; ``overloaded`` while that wait is long (module docstring)."""

    config: OverloadConfig = field(default_factory=OverloadConfig)
    overloaded: bool = False
    entered: int = 0  # times it fell back to LRU
    overloaded_s: float = 0.0  # time spent fallen back
    held_back: int = 0  # placements and prefetches not made while fallen back
    late: int = 0  # prefetches not made because admission would come after they left
    _started: dict[str, int] = field(default_factory=dict)  # session -> its chain's blocks
    _blocks: int = 0
    _drained: int = 0  # blocks of the sessions finished since the last update
    _rate: float | None = None  # blocks finished a second, smoothed
    _since: float | None = None  # when the wait first crossed toward a change
    _last: float | None = None  # the last update

    def started(self, session: str, blocks: int) -> None:
        self._blocks += blocks - self._started.get(session, 0)
        self._started[session] = blocks

    def finished(self, session: str) -> None:
        blocks = self._started.pop(session, 0)
        self._blocks -= blocks
        self._drained += blocks

    def wait_s(self, room: float) -> float:
        """How long a request started now waits for the blocks ahead of it beyond
        ``room`` (the fastest tier's blocks) to drain; 0 while they fit."""
        excess = self._blocks - room
        if excess <= 0:
            return 0.0
        return excess / self._rate if self._rate else math.inf

    def update(self, now: float, room: float) -> bool:
        """Look at the wait at ``now`` against ``room`` (the fastest tier's blocks);
        whether the engine is overloaded from here on."""
        if self._last is not None and now > self._last:
            elapsed = now - self._last
            drained = self._drained / elapsed
            sustain = self.config.sustain_s
            share = min(1.0, elapsed / sustain) if sustain > 0 else 1.0
            before = drained if self._rate is None else self._rate
            self._rate = before + share * (drained - before)
            if self.overloaded:
                self.overloaded_s += elapsed
        self._drained = 0
        self._last = now
        wait = self.wait_s(room)
        if self.overloaded:
            crossing = wait <= self.config.leave_wait_s
        else:
            crossing = wait >= self.config.enter_wait_s
        if not crossing:
            self._since = None
        elif self._since is None:
            self._since = now
        elif now - self._since >= self.config.sustain_s:
            self.overloaded = not self.overloaded
            self.entered += self.overloaded
            self._since = None
        return self.overloaded

    def to_dict(self) -> dict[str, float]:
        return {
            "entered": self.entered,
            "overloaded_s": self.overloaded_s,
            "held_back": self.held_back,
            "late": self.late,
        }

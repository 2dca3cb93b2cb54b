"""The daemon's garbage collection: full passes on a timer, not whenever the heap grows.

CPython's cyclic collector runs a full pass (every tracked object, every
thread stopped while it does) whenever the objects promoted to its oldest
generation since the last one reach a quarter of it. A store's index is
several tracked objects per block, and a store that takes puts promotes
blocks all the time: with 60,000 blocks indexed, full passes of 50-140 ms ran
every few seconds under an agentic load, and each was a lookup that missed
its deadline (``bench/vllm_scheduler.py``). Nothing the daemon keeps for long
is cyclic: blocks, keys and sessions are freed by reference counting. So:

* ``freeze_heap``, once the daemon has started and once the predictor has loaded
  torch: what exists then (modules, about 200,000 objects with torch) leaves
  the collector's passes for good, after one last collection;
* ``defer_full_passes``: the two young generations are collected as CPython does
  (cheap: they hold only recent objects), the oldest only by
  ``full_passes``, the daemon's task that collects it every
  ``FULL_PASS_EVERY_S``;
* ``skip_exit_pass``, once the daemon has stopped: the process exits without
  the full pass CPython would make over all of it. Cyclic garbage that
  lived long enough to be promoted waits that long to be freed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("kvstore.server")

FULL_PASS_EVERY_S = 600.0
_NEVER = 1 << 30  # young collections between automatic full passes: never, in practice


def defer_full_passes() -> None:
    """Leave full passes to ``full_passes`` (module docstring)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)


def freeze_heap() -> None:
    """Collect, then take every object that exists now out of all later passes."""
    gc.collect()
    gc.freeze()


def skip_exit_pass() -> None:
    """Take every object out of the full pass CPython makes as the interpreter exits:
    without the timer's passes the oldest generation holds all the daemon ever made
    (and torch's import, if still under way), and that pass added 1.5 s to a stop
    on a busy host. The process's memory goes with it; nothing is left to free."""
    gc.freeze()


async def full_passes(every_s: float = FULL_PASS_EVERY_S) -> None:
    """A full pass every ``every_s``, until cancelled (the daemon's task while it serves)."""
    while True:
        await asyncio.sleep(every_s)
        start = time.perf_counter()
        freed = gc.collect()
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        log.debug("full garbage collection: %d freed in %.1f ms", freed, elapsed_ms)

"""A log line that repeats at most once per interval, with a count of the ones held back.

A fault that hits every request (a full disk, a tier that is down, a client
sending garbage) would otherwise write one line per request and bury the
first, useful one. Counters in ``stats`` keep the exact numbers; the log
says that it is happening and how often.
"""

from __future__ import annotations

import logging
import threading
import time


class ThrottledLog:
    """Logs through ``logger`` at most once every ``every_s`` seconds per call site."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        self.log(logging.WARNING, message, *args)

    def log(self, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        if held:
            message += " (%d similar message(s) held back)"
            args = (*args, held)
        self.logger.log(level, message, *args)

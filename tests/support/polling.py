"""Waiting in a test for what another thread or process does, within a bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(condition: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    """``condition()``'s first true value, polled every 10 ms; fails the test with
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
    return value

"""JSON as the daemon accepts it: numbers a double holds exactly, nesting Python can parse.

``json.loads`` takes more than any kvstore message needs, and each surplus
surfaced far from the parser: ``NaN`` and ``Infinity`` (not JSON at all),
``1e400`` (read as infinity), integers of thousands of digits (``float()``
of one raises ``OverflowError``), and ``[[[[...`` a few thousand deep
(``RecursionError``). ``loads`` refuses them all while parsing, each as a
``ValueError`` saying what was wrong, so every reader of a request body
answers ``400`` instead of failing somewhere past its checks.

Integers are bounded by 2**53, the range in which a JSON number is exact in
every client (a double): no kvstore field needs more.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_EXACT_INT = 1 << 53
# The digits of MAX_EXACT_INT: a longer literal is out of range before int() reads it.
_MAX_INT_DIGITS = len(str(MAX_EXACT_INT))


def loads(text: str | bytes) -> Any:
    """``json.loads`` refusing non-finite numbers, integers past ``MAX_EXACT_INT`` and
    nesting too deep to parse; every refusal is a ``ValueError``."""
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _int(literal: str) -> int:
    if len(literal.lstrip("-")) <= _MAX_INT_DIGITS:
        value = int(literal)
        if -MAX_EXACT_INT <= value <= MAX_EXACT_INT:
            return value
    raise ValueError(f"integer {_shown(literal)} is out of range (|n| <= 2**53)")


def _float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {_shown(literal)} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _shown(literal: str, limit: int = 24) -> str:
    return literal if len(literal) <= limit else f"{literal[:limit]}..."

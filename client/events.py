"""Session events: what the engine tells the daemon about each request (``POST /v1/events``).

The return-time predictor learns from them, and the daemon's hit-rate
metrics count ``loaded_tokens`` against ``recomputed_tokens``. They are
advisory: a client drops an event (and counts it) rather than delay the
engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from time import time as wall_clock
from typing import Any


class Trigger(enum.Enum):
    """Who started a request: the user, or a tool call returning into the agent loop."""

    USER = "user"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class RequestStarted:
    session: str
    trigger: Trigger
    prompt_tokens: int
    cached_tokens: int
    time: float | None = None  # seconds since the epoch; None: when it is sent

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "request_started",
            "session": self.session,
            "trigger": self.trigger.value,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "time": wall_clock() if self.time is None else self.time,
        }


@dataclass(frozen=True, slots=True)
class RequestFinished:
    session: str
    steps: int
    output_tokens: int
    context_tokens: int
    tool_running: bool
    loaded_tokens: int
    recomputed_tokens: int
    time: float | None = None  # seconds since the epoch; None: when it is sent

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "request_finished",
            "session": self.session,
            "steps": self.steps,
            "output_tokens": self.output_tokens,
            "context_tokens": self.context_tokens,
            "tool_running": self.tool_running,
            "loaded_tokens": self.loaded_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "time": wall_clock() if self.time is None else self.time,
        }


SessionEvent = RequestStarted | RequestFinished

"""A trace's requests as the session events the replay feeds the tracker and the policy.

Each request becomes a start at its arrival and a finish after its modeled
decode (``output_tokens / decode_tokens_per_s``), or at its session's next
arrival if that is sooner. Events run in time order; at equal times a finish
comes before a start, so a session that returns the instant it went idle is
seen idle first. A finish carries when the session is next back (``None``:
not within the trace): the oracle reads it, the predictor never does.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.keys import ChunkKey, Namespace, external_keys
from kvstore.predictor.replay.costs import DECODE_TOKENS_PER_S
from kvstore.predictor.replay.traces import Trace, TraceRequest
from kvstore.wire.events import RequestFinished, Trigger


class Step(enum.IntEnum):
    """Order of simultaneous events."""

    FINISH = 0
    START = 1


@dataclass(frozen=True, slots=True)
class ReplayEvent:
    """A request starting or finishing; for a finish, when its session is next back."""

    time: float
    step: Step
    request: int  # index into the replayed requests
    next_start: float | None = None
    tool_next: bool = False  # the session's next request is a tool result


def requests_of(trace: Trace, max_requests: int | None = None) -> tuple[TraceRequest, ...]:
    return trace.requests if max_requests is None else trace.requests[:max_requests]


def session_events(
    requests: Sequence[TraceRequest], decode_tokens_per_s: float = DECODE_TOKENS_PER_S
) -> list[ReplayEvent]:
    """Start and finish events of ``requests`` in replay order."""
    following: dict[int, int] = {}
    last: dict[str, int] = {}
    for index, request in enumerate(requests):
        if request.session in last:
            following[last[request.session]] = index
        last[request.session] = index
    events: list[ReplayEvent] = []
    for index, request in enumerate(requests):
        events.append(ReplayEvent(request.time, Step.START, index))
        after = following.get(index)
        end = request.time + request.output_tokens / decode_tokens_per_s
        next_start = requests[after].time if after is not None else None
        if next_start is not None:
            end = min(end, next_start)
        tool_next = after is not None and requests[after].trigger is Trigger.TOOL
        events.append(ReplayEvent(end, Step.FINISH, index, next_start, tool_next))
    events.sort(key=lambda e: (e.time, e.step, e.request))
    return events


def finished_event(
    request: TraceRequest, event: ReplayEvent, loaded: int, recomputed: int
) -> RequestFinished:
    """The ``RequestFinished`` a client would send for ``request``.

    ``tool_running`` is whether the request ended in a tool call: the trace
    says so through its session's next request being a tool result, and a
    real client knows it when the request ends (the model asked for the tool).
    """
    return RequestFinished(
        session=request.session,
        steps=1,
        output_tokens=request.output_tokens,
        context_tokens=request.prompt_tokens + request.output_tokens,
        tool_running=event.tool_next,
        loaded_tokens=loaded,
        recomputed_tokens=recomputed,
        time=event.time,
    )


class BlockKeys:
    """A trace's block ids as chunk keys of one namespace (``external_keys``), memoised."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self._keys: dict[int | str, ChunkKey] = {}

    def of(self, request: TraceRequest) -> list[ChunkKey]:
        keys = []
        for block in request.blocks:
            key = self._keys.get(block)
            if key is None:
                raw = block if isinstance(block, int) else block.encode()
                key = self._keys[block] = external_keys(self.namespace, [raw])[0]
            keys.append(key)
        return keys

"""A workload: the sessions a replay plays, and when each may begin.

Two shapes, one description::

    open loop    a request trace (Mooncake, TraceLab): every call arrives at the
                 time the trace says, however the replay served the one before
    closed loop  conversations (kv-cache-tester): a call is sent ``think_s`` after
                 the response before it ended *as the replay served it*, so slow
                 reloads push a session's later calls later

A ``Script`` is one session: its steps (calls and groups of subagents), and
for an open-loop one the arrival of every call. A ``Lane`` is one user
playing conversations one after another: the next starts when the last one
ended. ``compose_users`` deals the conversations to a fixed number of users;
``compose_arrivals`` starts each conversation at a seeded Poisson time, each
its own user. Both are pure functions of the conversations and the seed, so
every policy of a replay plays exactly the same workload.

The *nominal* timeline (``nominal_seconds``) is the one where every response
takes what the trace measured (``api_s``) and nothing waits: it sizes the
predictor's horizons and the blurred oracle's base rates, and orders the
offline bound's accesses.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.errors import ConfigError
from kvstore.predictor.replay.conversations import (
    Call,
    Conversation,
    Stop,
    Subagents,
    is_conversations,
    load_conversations,
)
from kvstore.predictor.replay.costs import DECODE_TOKENS_PER_S
from kvstore.predictor.replay.traces import Trace, TraceFormat, load_trace
from kvstore.wire.events import Trigger

Step = Call | Subagents

DEFAULT_USERS = 24
"""Users playing conversations at once when neither ``--users`` nor ``--rate`` is given."""


@dataclass(frozen=True, slots=True)
class Script:
    """One session as the replay plays it. ``arrivals`` (open loop): each call's arrival,
    in trace seconds; ``None`` (closed loop): each call ``think_s`` after the last
    response."""

    session: str
    user: str | None
    steps: tuple[Step, ...]
    arrivals: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Lane:
    """One user's sessions, played one after another from ``start``."""

    user: str | None
    start: float
    scripts: tuple[Script, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    """Everything a replay plays: its lanes, the block size its ids count in, a name."""

    name: str
    block_tokens: int
    lanes: tuple[Lane, ...]

    @property
    def closed_loop(self) -> bool:
        return any(script.arrivals is None for lane in self.lanes for script in lane.scripts)

    def calls(self) -> int:
        return sum(_calls(script.steps) for lane in self.lanes for script in lane.scripts)


def _calls(steps: Sequence[Step]) -> int:
    total = 0
    for step in steps:
        if isinstance(step, Call):
            total += 1
        else:
            total += sum(_calls(child.steps) for child in step.conversations)
    return total


def from_trace(trace: Trace, decode_tokens_per_s: float = DECODE_TOKENS_PER_S) -> Workload:
    """An open-loop workload: each session of ``trace`` one lane, calls at trace times.

    A trace says nothing of how long a response took; it is
    ``output_tokens / decode_tokens_per_s``, and a call that ended in a tool
    call (its session's next call is a tool result) is marked ``TOOL_USE``."""
    lanes = []
    for session, requests in trace.sessions().items():
        calls = []
        for index, request in enumerate(requests):
            following = requests[index + 1] if index + 1 < len(requests) else None
            tool_next = following is not None and following.trigger is Trigger.TOOL
            calls.append(
                Call(
                    blocks=tuple(str(block) for block in request.blocks),
                    prompt_tokens=request.prompt_tokens,
                    output_tokens=request.output_tokens,
                    trigger=request.trigger,
                    stop=Stop.TOOL_USE if tool_next else Stop.OTHER,
                    think_s=0.0,
                    api_s=request.output_tokens / decode_tokens_per_s,
                )
            )
        script = Script(
            session, requests[0].user, tuple(calls), tuple(r.time for r in requests)
        )
        lanes.append(Lane(requests[0].user, requests[0].time, (script,)))
    lanes.sort(key=lambda lane: (lane.start, lane.scripts[0].session))
    return Workload(trace.name, trace.block_tokens, tuple(lanes))


def _script(conversation: Conversation, user: str | None) -> Script:
    return Script(conversation.name, user, conversation.steps)


def compose_users(
    conversations: Sequence[Conversation], users: int, seed: int = 0, name: str = "workload"
) -> Workload:
    """``users`` users, each playing conversations back to back: the conversations in a
    seeded shuffle, each dealt to the user whose list ends first on the nominal
    timeline, so the users stay about equally busy."""
    if users <= 0:
        raise ConfigError("--users must be positive")
    order = _shuffled(conversations, seed)
    ends = [(0.0, user) for user in range(users)]
    dealt: list[list[Conversation]] = [[] for _ in range(users)]
    for conversation in order:
        end, user = heapq.heappop(ends)
        dealt[user].append(conversation)
        heapq.heappush(ends, (end + nominal_seconds(conversation.steps), user))
    lanes = tuple(
        Lane(f"user-{user}", 0.0, tuple(_script(c, f"user-{user}") for c in dealt[user]))
        for user in range(users)
        if dealt[user]
    )
    return Workload(name, _block_tokens(conversations), lanes)


def compose_arrivals(
    conversations: Sequence[Conversation],
    per_hour: float,
    seed: int = 0,
    name: str = "workload",
) -> Workload:
    """Each conversation its own user, starting at the arrivals of a seeded Poisson
    process of ``per_hour`` conversations an hour, in a seeded shuffle."""
    if not per_hour > 0:
        raise ConfigError("--rate must be a positive number of conversations an hour")
    order = _shuffled(conversations, seed)
    gaps = np.random.default_rng(seed + 1).exponential(3600.0 / per_hour, size=len(order))
    starts = np.cumsum(gaps) - gaps[0]
    lanes = tuple(
        Lane(c.name, float(start), (_script(c, c.name),))
        for c, start in zip(order, starts, strict=True)
    )
    return Workload(name, _block_tokens(conversations), lanes)


def _shuffled(conversations: Sequence[Conversation], seed: int) -> list[Conversation]:
    if not conversations:
        raise ConfigError("the workload has no conversations")
    ordered = sorted(conversations, key=lambda c: c.name)
    permutation = np.random.default_rng(seed).permutation(len(ordered))
    return [ordered[i] for i in permutation]


def _block_tokens(conversations: Sequence[Conversation]) -> int:
    sizes = {c.block_tokens for c in conversations}
    if len(sizes) != 1:
        raise ConfigError(f"conversations with different block sizes: {sorted(sizes)}")
    return sizes.pop()


def nominal_seconds(steps: Sequence[Step]) -> float:
    """How long ``steps`` take when every response takes its ``api_s`` and nothing waits;
    a group of subagents takes as long as its longest member."""
    total = 0.0
    for step in steps:
        if isinstance(step, Call):
            total += step.think_s + step.api_s
        else:
            longest = max(nominal_seconds(c.steps) for c in step.conversations)
            total += step.think_s + longest
    return total


def load_workload(
    paths: Sequence[Path],
    trace_format: TraceFormat | None = None,
    *,
    users: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    warm_prefix: bool = False,
) -> Workload:
    """The workload at ``paths``: one request trace (Mooncake, TraceLab: open loop), or
    kv-cache-tester conversations (files or folders: closed loop, ``users`` users or
    arrivals at ``rate`` an hour). The format is guessed when not given: a folder or a
    ``.json``/``.json.gz`` file holds conversations."""
    paths = [Path(path) for path in paths]
    if trace_format is None:
        conversational = any(is_conversations(p) for p in paths)
        trace_format = TraceFormat.KV_CACHE_TESTER if conversational else None
    if trace_format is not TraceFormat.KV_CACHE_TESTER:
        if len(paths) != 1:
            raise ConfigError("a request trace is one file")
        if users is not None or rate is not None or warm_prefix:
            raise ConfigError("--users, --rate and --warm-prefix are for conversations")
        return from_trace(load_trace(paths[0], trace_format))
    conversations = load_conversations(paths, warm_prefix=warm_prefix)
    name = paths[0].name if len(paths) == 1 else f"{len(paths)} paths"
    if rate is not None:
        if users is not None:
            raise ConfigError("give --users or --rate, not both")
        return compose_arrivals(conversations, rate, seed, name)
    return compose_users(conversations, users or DEFAULT_USERS, seed, name)


# -- the nominal timeline -------------------------------------------------------------


def nominal_idle(workload: Workload, max_requests: int | None = None) -> list[tuple[float, float]]:
    """(when a session went idle, how long until it was back) of every call on the
    nominal timeline (``workload.nominal_seconds``); ``math.inf``: not back."""
    periods: list[tuple[float, float]] = []
    for lane in workload.lanes:
        start = lane.start
        for script in lane.scripts:
            if script.arrivals is not None:
                periods += _open_idle(script)
                continue
            periods += _closed_idle(script.steps, start)
            start += nominal_seconds(script.steps)
    periods.sort()
    return periods if max_requests is None else periods[:max_requests]


def _open_idle(script: Script) -> list[tuple[float, float]]:
    assert script.arrivals is not None
    out = []
    for index, (step, arrival) in enumerate(zip(script.steps, script.arrivals, strict=True)):
        assert isinstance(step, Call), "an open-loop session has calls only"
        end = arrival + step.api_s
        following = script.arrivals[index + 1] if index + 1 < len(script.arrivals) else None
        out.append((end, math.inf if following is None else max(0.0, following - end)))
    return out


def _closed_idle(steps: Sequence[Step], start: float) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    now = start
    for index, step in enumerate(steps):
        if isinstance(step, Call):
            now += step.think_s + step.api_s
            out.append((now, gap_after(steps, index)))
        else:
            for child in step.conversations:
                out += _closed_idle(child.steps, now + step.think_s)
            now += step.think_s + max(nominal_seconds(c.steps) for c in step.conversations)
    return out


def gap_after(steps: Sequence[Step], index: int) -> float:
    """How long after step ``index`` ended its session's next call arrives (nominal)."""
    gap = 0.0
    for step in steps[index + 1 :]:
        if isinstance(step, Call):
            return gap + step.think_s
        gap += step.think_s + max(nominal_seconds(c.steps) for c in step.conversations)
    return math.inf

"""Request traces as the replay sees them: one ``TraceRequest`` per LLM call.

Two formats (``../shared/data/traces/README.md``):

* **Mooncake** JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``
  and ``hash_ids``, one id per 512-token block, chained (equal ids mean equal
  content and equal prefix). No sessions: a request continues a session when
  its ``hash_ids`` start with an earlier request's ``hash_ids`` (whose last,
  possibly partial, block is left out). Only chains of at least
  ``MIN_SHARED_BLOCKS`` count, so a system prompt shared by every request does
  not glue unrelated conversations together. The gap between the two is a real
  human return time.
* **TraceLab** round JSONL: one row per LLM call of a coding-agent session
  with ``session_id``; a round whose first timing event is ``user_message``
  starts a human request (the gap before it is think time), one starting with
  ``tool_result`` continues the agent loop. There are no block ids: each
  session's prompt is one growing chain, so block ``i`` of session ``s`` has
  id ``(s, i)``.

Block ids become chunk keys in the replay (``kvstore.keys.external_keys``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.wire.events import Trigger

MOONCAKE_BLOCK_TOKENS = 512
MIN_SHARED_BLOCKS = 2


class TraceFormat(enum.Enum):
    MOONCAKE = "mooncake"
    TRACELAB = "tracelab"
    KV_CACHE_TESTER = "kv-cache-tester"  # conversations: ``replay.conversations``


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One LLM call: when it arrived, which session, and its prompt as block ids."""

    time: float  # seconds from the start of the trace
    session: str
    blocks: tuple[int | str, ...]  # one id per full block of the prompt, head first
    prompt_tokens: int
    output_tokens: int
    trigger: Trigger
    user: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]  # sorted by time

    @property
    def duration(self) -> float:
        return self.requests[-1].time - self.requests[0].time if self.requests else 0.0

    def sessions(self) -> dict[str, list[TraceRequest]]:
        grouped: dict[str, list[TraceRequest]] = {}
        for request in self.requests:
            grouped.setdefault(request.session, []).append(request)
        return grouped


def load_trace(path: str | Path, trace_format: TraceFormat | None = None) -> Trace:
    """Load a trace; the format is guessed from the first row when not given."""
    path = Path(path)
    rows = list(_rows(path))
    if not rows:
        raise ConfigError(f"trace {path} has no requests")
    if trace_format is None:
        trace_format = TraceFormat.MOONCAKE if "hash_ids" in rows[0] else TraceFormat.TRACELAB
    if trace_format is TraceFormat.MOONCAKE:
        return Trace(path.name, MOONCAKE_BLOCK_TOKENS, tuple(_mooncake(rows)))
    if trace_format is TraceFormat.TRACELAB:
        return Trace(path.name, _TRACELAB_BLOCK_TOKENS, tuple(_tracelab(rows)))
    raise ConfigError(f"{trace_format.value} holds conversations, not a request trace")


def _rows(path: Path) -> Iterator[dict]:
    try:
        with path.open() as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ConfigError(f"{path}:{number}: not JSON: {error}") from None
    except OSError as error:
        raise ConfigError(f"cannot read trace {path}: {error}") from None


def _mooncake(rows: list[dict]) -> Iterator[TraceRequest]:
    """Requests with sessions inferred from prefix extension (see the module docstring)."""
    chains: dict[tuple[int, ...], str] = {}  # full-block prefix of a request -> its session
    for number, row in enumerate(sorted(rows, key=lambda r: r["timestamp"])):
        hash_ids = tuple(int(h) for h in row["hash_ids"])
        full = hash_ids if row["input_length"] % MOONCAKE_BLOCK_TOKENS == 0 else hash_ids[:-1]
        session = None
        for length in range(len(hash_ids), MIN_SHARED_BLOCKS - 1, -1):
            session = chains.get(hash_ids[:length])
            if session is not None:
                break
        trigger = Trigger.USER
        if session is None:
            session = f"mooncake-{number}"
        if len(full) >= MIN_SHARED_BLOCKS:
            chains[full] = session
        yield TraceRequest(
            time=row["timestamp"] / 1000.0,
            session=session,
            blocks=full,
            prompt_tokens=int(row["input_length"]),
            output_tokens=int(row["output_length"]),
            trigger=trigger,
        )


# TraceLab prompts have no block ids; the replay keys them in chunks of this size.
_TRACELAB_BLOCK_TOKENS = 512


def _tracelab(rows: list[dict]) -> Iterator[TraceRequest]:
    """Rounds in time order; each session's prompt is one growing chain of blocks."""
    parsed: list[TraceRequest] = []
    start: float | None = None
    for row in rows:
        events = row.get("timing_events") or []
        if not events:
            continue
        when = _seconds(events[0]["timestamp"])
        start = when if start is None else min(start, when)
        tokens = int(row["input_tokens_total"])
        session = str(row["session_id"])
        parsed.append(
            TraceRequest(
                time=when,
                session=session,
                blocks=tuple(f"{session}/{i}" for i in range(tokens // _TRACELAB_BLOCK_TOKENS)),
                prompt_tokens=tokens,
                output_tokens=int(row.get("output_tokens") or 0),
                trigger=Trigger.USER if events[0]["event_type"] == "user_message" else Trigger.TOOL,
                user=row.get("project"),
            )
        )
    assert start is not None or not parsed
    for request in sorted(parsed, key=lambda r: r.time):
        yield TraceRequest(
            time=request.time - (start or 0.0),
            session=request.session,
            blocks=request.blocks,
            prompt_tokens=request.prompt_tokens,
            output_tokens=request.output_tokens,
            trigger=request.trigger,
            user=request.user,
        )


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

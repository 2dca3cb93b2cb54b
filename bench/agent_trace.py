"""Write an open-loop coding-agent trace in Mooncake's format, from a seed.

The replay's overload scenarios need workloads the project has not tuned on:
sessions that start at Poisson times, whatever the engine does, share one long
system prompt and grow their context to where it no longer fits. Each session::

    start ─► human turn: a message, then an agent loop of calls, each adding
             its output and a tool's result to the context, a few seconds apart
          ─► the human thinks (lognormal: median 2 minutes, p90 25) ─► next turn
          ─► ... ─► its last turn

A call's prompt is its whole context: the shared system prompt, then the
session's history. Block ids follow Mooncake's rule, one per 512-token block,
equal ids meaning equal prefixes: a block gets its id when it fills, and the
partial block at a prompt's end a fresh one each call. A context that would pass
``--max-context`` is compacted as coding agents do: the next prompt is the
system prompt and a summary, a new chain. Times are nominal (each response
takes ``RESPONSE_S`` plus its output at ``DECODE_TOKENS_PER_S``): an open-loop
trace arrives as written, however the engine keeps up.

``python bench/agent_trace.py --out FILE`` writes the JSON Lines and prints
what it wrote; ``kvstore replay FILE --format mooncake`` reads it.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import bench_arguments, emit_json

BLOCK_TOKENS = 512  # Mooncake's tokens per hash_id
RESPONSE_S = 2.0  # a response's fixed part, before its tokens
DECODE_TOKENS_PER_S = 50.0


@dataclass(frozen=True, slots=True)
class Shape:
    """What the sessions look like; medians and lognormal sigmas of each draw."""

    sessions_per_hour: float = 200.0
    hours: float = 3.0
    system_tokens: int = 12_288  # shared by every session (24 blocks)
    max_context: int = 200_000
    summary_tokens: int = 16_384  # a compacted context's history
    human_turns: float = 6.0  # mean, geometric
    calls_per_turn: float = 8.0  # mean, geometric: the agent loop after a message
    message_tokens: tuple[float, float] = (2_000.0, 1.0)
    tool_tokens: tuple[float, float] = (875.0, 1.2)
    output_tokens: tuple[float, float] = (300.0, 0.8)
    tool_s: tuple[float, float] = (3.0, 1.0)
    think_s: tuple[float, float] = (120.0, 1.97)  # p90 about 25 minutes
    max_think_s: float = 6 * 3600.0


@dataclass(frozen=True, slots=True)
class Call:
    """One request, as Mooncake writes it, and the chain it extends (not written: a
    session's context since it started or was last compacted)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chain: int

    def row(self) -> dict[str, object]:
        return {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


class _Ids:
    """Block ids: the system prompt's first, then fresh ones as blocks are written."""

    def __init__(self, system_blocks: int) -> None:
        self.system = tuple(range(system_blocks))
        self._next = system_blocks

    def fresh(self, count: int = 1) -> list[int]:
        ids = list(range(self._next, self._next + count))
        self._next += count
        return ids


class _Context:
    """A session's prompt as it grows: full blocks keep their ids, the tail is new."""

    def __init__(self, ids: _Ids, chain: int, system_tokens: int, history_tokens: int) -> None:
        self._ids = ids
        self.chain = chain
        self.tokens = system_tokens
        self.full = list(ids.system[: system_tokens // BLOCK_TOKENS])
        self.add(history_tokens)

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.full += self._ids.fresh(self.tokens // BLOCK_TOKENS - len(self.full))

    def hash_ids(self) -> tuple[int, ...]:
        partial = self._ids.fresh() if self.tokens % BLOCK_TOKENS else []
        return (*self.full, *partial)


def _lognormal(
    rng: np.random.Generator, median_sigma: tuple[float, float], most: float = math.inf
) -> float:
    median, sigma = median_sigma
    return min(most, float(median * math.exp(sigma * rng.standard_normal())))


def _geometric(rng: np.random.Generator, mean: float) -> int:
    return int(rng.geometric(1.0 / mean))


def _session(
    rng: np.random.Generator, ids: _Ids, chains: Iterator[int], shape: Shape, start: float
) -> Iterator[Call]:
    # A session's first call fills a block past the system prompt: a reader that
    # finds sessions by prefix (the replay's) would otherwise take the system
    # prompt alone for a session's context and glue every later session to it.
    context = _Context(ids, next(chains), shape.system_tokens, BLOCK_TOKENS)
    most = shape.max_context // 8  # one message, tool result or output
    now = start
    for turn in range(_geometric(rng, shape.human_turns)):
        if turn:
            now += _lognormal(rng, shape.think_s, shape.max_think_s)
        added = max(1, round(_lognormal(rng, shape.message_tokens, most)))
        for call in range(_geometric(rng, shape.calls_per_turn)):
            if call:
                now += _lognormal(rng, shape.tool_s)
                added = max(1, round(_lognormal(rng, shape.tool_tokens, most)))
            if context.tokens + added + most > shape.max_context:  # room for the output
                context = _Context(ids, next(chains), shape.system_tokens, shape.summary_tokens)
            context.add(added)
            output = max(1, round(_lognormal(rng, shape.output_tokens, most)))
            hash_ids = context.hash_ids()
            yield Call(round(now * 1e3), context.tokens, output, hash_ids, context.chain)
            now += RESPONSE_S + output / DECODE_TOKENS_PER_S
            context.add(output)


def generate(shape: Shape, seed: int) -> list[Call]:
    """Every call of the trace, in time order: sessions start within ``shape.hours``,
    and their calls after it are not in the trace (the window a recording covers)."""
    rng = np.random.default_rng(seed)
    ids, chains = _Ids(shape.system_tokens // BLOCK_TOKENS), itertools.count()
    calls: list[Call] = []
    start, end = 0.0, shape.hours * 3600.0
    while True:
        start += float(rng.exponential(3600.0 / shape.sessions_per_hour))
        if start >= end:
            break
        session = _session(rng, ids, chains, shape, start)
        calls.extend(call for call in session if call.timestamp_ms < end * 1e3)
    calls.sort(key=lambda call: call.timestamp_ms)
    return calls


def write(calls: Sequence[Call], path: Path) -> None:
    with path.open("w") as out:
        for call in calls:
            out.write(json.dumps(call.row()) + "\n")


def describe(calls: Sequence[Call]) -> dict[str, float]:
    """What a trace holds, for its reader to check against the shape asked for."""
    prompts = np.array([call.input_length for call in calls])
    return {
        "requests": len(calls),
        "hours": (calls[-1].timestamp_ms - calls[0].timestamp_ms) / 3.6e6 if calls else 0.0,
        "prompt_tokens_p50": float(np.median(prompts)) if calls else 0.0,
        "prompt_tokens_max": int(prompts.max()) if calls else 0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    default = Shape()
    parser = bench_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON Lines file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions-per-hour", type=float, default=default.sessions_per_hour)
    parser.add_argument("--hours", type=float, help=f"default {default.hours}, quick 0.25")
    parser.add_argument("--system-tokens", type=int, default=default.system_tokens)
    parser.add_argument("--max-context", type=int, default=default.max_context)
    args = parser.parse_args(argv)
    shape = Shape(
        sessions_per_hour=args.sessions_per_hour,
        hours=args.hours or (0.25 if args.quick else default.hours),
        system_tokens=args.system_tokens,
        max_context=args.max_context,
    )
    calls = generate(shape, args.seed)
    write(calls, args.out)
    figures = describe(calls)
    if args.json:
        emit_json(figures)
    else:
        print(", ".join(f"{name} {value:,.6g}" for name, value in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

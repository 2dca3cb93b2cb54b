"""The workloads of ``bench/serving.py``: sessions of turns, as token ids, from a seed.

A workload is a set of sessions (users, agents). Each session is a closed loop:
a turn is sent when the session's previous turn has finished and its think
time has passed, and at most ``in_flight`` requests of the whole workload are
out at once (a FIFO gate, so sessions take turns in the order they queued)::

    chat      8 users x 5 rounds; a 512-token system prompt shared by all; each
              round is the previous prompt + the previous output + a new user
              message, so histories grow to 2K-3.7K tokens; 2 in flight.
    noreuse   the same 40 prompt lengths, every prompt fresh random tokens: no
              prefix in common, so a store can only cost (the overhead case).
    busy      longer histories (8K-32K tokens times --busy-scale), 4 in flight:
              some requests decode while others load a returning context.
    agentic   kv-cache-tester conversations (real Claude Code sessions): each
              (conversation, 64-token block hash_id) becomes --agentic-block-tokens
              pseudo-random tokens, so a request whose hash_ids extend the last
              one's repeats its prompt; think times scaled down.

What a turn's prompt is may depend on the engine's output (chat and busy append
it), so prompts are built while the workload runs; only their lengths, which
size vLLM's cache, are known beforehand (``ignore_eos``: every output has
exactly ``max_tokens`` tokens). A turn is "returning" when its prompt starts
with a context the engine has seen before: those are the turns an external
store serves once vLLM's own cache has evicted them.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FIRST_TOKEN = 10  # token ids start above the model's special ones (bos 1, eos 2)
TRACE_BLOCK = 64  # kv-cache-tester's tokens per hash_id


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    ``extends``: its prompt is the previous turn's prompt and output followed by
    ``tokens``; otherwise ``tokens`` is the whole prompt."""

    tokens: tuple[int, ...]
    extends: bool
    max_tokens: int
    returning: bool
    think_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[tuple[Turn, ...], ...]
    in_flight: int

    def prompt_lengths(self) -> Iterator[tuple[int, int]]:
        """``(prompt tokens, output tokens)`` of every turn, session by session."""
        for turns in self.sessions:
            prompt = output = 0
            for turn in turns:
                prompt = prompt + output + len(turn.tokens) if turn.extends else len(turn.tokens)
                output = turn.max_tokens
                yield prompt, output

    @property
    def max_context(self) -> int:
        """The longest prompt plus its output: what vLLM's ``--max-model-len`` must hold."""
        return max(prompt + output for prompt, output in self.prompt_lengths())

    @property
    def session_contexts(self) -> list[int]:
        """The largest context (prompt plus output) of each session."""
        contexts = []
        for turns in self.sessions:
            single = Workload(self.name, (turns,), self.in_flight)
            contexts.append(single.max_context)
        return contexts

    @property
    def requests(self) -> int:
        return sum(len(turns) for turns in self.sessions)


@dataclass(frozen=True)
class ChatShape:
    users: int = 8
    rounds: int = 5
    system_tokens: int = 512
    message_tokens: tuple[int, int] = (250, 590)  # each user's messages, drawn per round
    output_tokens: int = 64
    in_flight: int = 2


@dataclass(frozen=True)
class AgenticShape:
    # 8, as chat's users: vLLM's cache then holds 3 of them, which is at least the 2 in
    # flight at the longest context. With 4 it held 1.5, so a second request waited for
    # the first one's blocks and TTFT measured admission, not the store.
    sessions: int = 8
    requests: int = 6  # the first requests of each conversation (subagents left out)
    block_tokens: int = 8  # tokens per trace block (64 in the trace): contexts shrink 8x
    max_context: int = 8192  # prompts are cut to this minus the output
    max_output: int = 64
    think_scale: float = 0.02
    max_think_s: float = 5.0
    in_flight: int = 2


def _random_tokens(rng: np.random.Generator, count: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN, vocab, count))


def chat(shape: ChatShape, vocab: int, seed: int, name: str = "chat") -> Workload:
    """Multi-turn chat: a shared system prompt, then each user's growing history."""
    rng = np.random.default_rng([seed, 1])
    system = _random_tokens(rng, shape.system_tokens, vocab)
    low, high = shape.message_tokens
    sessions = []
    for _ in range(shape.users):
        turns = []
        for round_index in range(shape.rounds):
            message = _random_tokens(rng, int(rng.integers(low, high + 1)), vocab)
            first = round_index == 0
            turns.append(
                Turn(
                    tokens=system + message if first else message,
                    extends=not first,
                    max_tokens=shape.output_tokens,
                    returning=not first,
                )
            )
        sessions.append(tuple(turns))
    return Workload(name, tuple(sessions), shape.in_flight)


def busy(shape: ChatShape, scale: float, vocab: int, seed: int) -> Workload:
    """Chat with long histories (8K-32K tokens at scale 1) and more requests in flight."""
    first_low, first_high = (max(1, int(8192 * scale)), max(2, int(32768 * scale)))
    rng = np.random.default_rng([seed, 3])
    sessions = []
    for _ in range(shape.users):
        turns = []
        for round_index in range(shape.rounds):
            first = round_index == 0
            low, high = (first_low, first_high) if first else shape.message_tokens
            turns.append(
                Turn(
                    tokens=_random_tokens(rng, int(rng.integers(low, high + 1)), vocab),
                    extends=not first,
                    max_tokens=shape.output_tokens,
                    returning=not first,
                )
            )
        sessions.append(tuple(turns))
    return Workload("busy", tuple(sessions), shape.in_flight)


def noreuse(like: Workload, vocab: int, seed: int) -> Workload:
    """``like``'s prompt lengths and outputs, each prompt fresh random tokens."""
    rng = np.random.default_rng([seed, 2])
    lengths = iter(like.prompt_lengths())
    sessions = []
    for turns in like.sessions:
        fresh = []
        for turn in turns:
            prompt, _ = next(lengths)
            fresh.append(Turn(_random_tokens(rng, prompt, vocab), False, turn.max_tokens, False))
        sessions.append(tuple(fresh))
    return Workload("noreuse", tuple(sessions), like.in_flight)


# -- agentic -------------------------------------------------------------------


def trace_files(folder: Path) -> list[Path]:
    """The conversations in ``folder`` (or in its ``kv-cache-tester/``), sorted by name."""
    if (folder / "kv-cache-tester").is_dir():
        folder = folder / "kv-cache-tester"
    files = sorted(folder.glob("trace_*.json.gz")) + sorted(folder.glob("trace_*.json"))
    if not files:
        raise FileNotFoundError(f"no kv-cache-tester trace_*.json[.gz] in {folder}")
    return sorted(files, key=lambda path: path.name)


def load_conversation(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as text:
        conversation = json.load(text)
    assert isinstance(conversation, dict)
    return conversation


def agentic(shape: AgenticShape, traces: Path, vocab: int, seed: int) -> Workload:
    """Sessions from kv-cache-tester conversations chosen by ``seed``, cut to ``shape``."""
    files = trace_files(traces)
    order = np.random.default_rng([seed, 4]).permutation(len(files))
    sessions = []
    for index in order:
        conversation = load_conversation(files[int(index)])
        calls = [r for r in conversation["requests"] if r.get("type") != "subagent"]
        if len(calls) < 2:
            continue
        number = int(str(conversation["id"]).rsplit("_", 1)[-1])
        sessions.append(_agent_session(calls[: shape.requests], number, shape, vocab, seed))
        if len(sessions) == shape.sessions:
            break
    return Workload("agentic", tuple(sessions), shape.in_flight)


def _agent_session(
    calls: Sequence[dict[str, Any]], conversation: int, shape: AgenticShape, vocab: int, seed: int
) -> tuple[Turn, ...]:
    blocks: dict[int, tuple[int, ...]] = {}

    def block(hash_id: int) -> tuple[int, ...]:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, 5, conversation, hash_id])
            blocks[hash_id] = _random_tokens(rng, shape.block_tokens, vocab)
        return blocks[hash_id]

    turns = []
    for index, call in enumerate(calls):
        output = max(1, min(int(call["out"]), shape.max_output))
        keep = shape.max_context - output
        prompt = tuple(t for hash_id in call["hash_ids"] for t in block(int(hash_id)))[:keep]
        think = min(float(call.get("think_time") or 0.0) * shape.think_scale, shape.max_think_s)
        turns.append(Turn(prompt, False, output, index > 0, 0.0 if index == 0 else think))
    return tuple(turns)

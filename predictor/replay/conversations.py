"""kv-cache-tester traces as conversations: the calls of each agent, subagents nested.

The format (``../shared/data/traces/README.md``, "kv-cache-tester format") has one
JSON object per conversation, one file each (``.json`` or ``.json.gz``). Unlike the
flat ``traces.py`` request list, a conversation here keeps its order and its
structure, because a replay must send call ``n + 1`` only once call ``n`` has been
answered, and a parent's next call only once all its subagents have finished.

Choices this loader makes, and why:

* **Block ids are strings scoped per file**, ``f"{file id}/{hash id}"``: the files
  say ``hash_id_scope: "local"``, so two files' id 1 are different blocks. A
  subagent's calls share the file's scope (they come from the same file).
* **Warm prefix** (``warm_prefix=True``): the system prompt and tool definitions
  (``system_tokens + tool_tokens``) lead every conversation of the same client, but
  local scope hides that. With the option, the first ``(system_tokens +
  tool_tokens) // block_size`` blocks of each call get ids shared across files,
  ``warm/{i}`` (``warm/{subagent_type}/{i}`` in a subagent, whose tokens are its
  own), as long as the call's hash ids match the conversation's first call there.
  The shared run ends at the first position that differs: a block's KV depends on
  everything before it, so past a divergence nothing is shared, even if a later
  hash id happens to match again.
* **Only full blocks**: ``prompt_tokens // block_size`` of them (fewer if
  ``hash_ids`` is shorter); a partial last block is never cached on its own.
* **Subagent start times**: for a finished (``"status": "completed"``) subagent
  the entry's ``t`` is when it *finished*; ``t - duration_ms / 1000`` is its
  start, which lies within a second of the parent's previous response in this
  data set (checked on every group). The delay before a group starts is that
  start minus the parent's previous call's ``t + api_time``, clamped at 0 (an
  explicit ``think_time`` on the entry wins). Without ``duration_ms`` (the data's
  ``"async_launched"`` agents) ``t`` is taken as the start.
* **Missing times**: ``api_time`` absent is 0.0, and so is ``think_time`` absent
  (67 calls in the data set, each after an aborted stream with no ``api_time``);
  ``docs/predictor_results.md``'s figures count them the same way.
* A call is a human turn (``Trigger.USER``) when ``input_types`` is exactly
  ``["text"]``; that includes each subagent's first call (the parent's task
  prompt, ``think_time`` 0).
"""

from __future__ import annotations

import enum
import gc
import gzip
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.wire.events import Trigger

TRACE_SUFFIXES = (".json", ".json.gz")


def is_conversations(path: Path) -> bool:
    """Whether ``path`` is read as kv-cache-tester conversations when no format is given:
    a folder, or a ``.json`` / ``.json.gz`` file (request traces are JSON Lines)."""
    return path.is_dir() or path.name.endswith(TRACE_SUFFIXES)

_Json = dict[str, Any]  # one JSON object of a trace file


class Stop(enum.Enum):
    """Why the model stopped (the request's ``stop``): what the agent does next."""

    TOOL_USE = "tool_use"  # the agent goes on once a tool has run
    END_TURN = "end_turn"  # the agent hands back to the human
    OTHER = "other"  # anything else (max_tokens, an aborted stream, missing, ...)


_STOPS = {stop.value: stop for stop in Stop if stop is not Stop.OTHER}


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call of a conversation: the prompt as block ids, and its timing."""

    blocks: tuple[str, ...]  # ids of the prompt's full blocks, head first
    prompt_tokens: int  # "in"
    output_tokens: int  # "out"
    trigger: Trigger  # USER for a human message (input_types ["text"]), else TOOL
    stop: Stop
    think_s: float  # the client's delay before sending, after the previous response
    api_s: float  # the server's time for the call (0.0 if absent)


@dataclass(frozen=True, slots=True)
class Subagents:
    """Nested agents started together; the parent's next call waits until every one has finished.

    ``think_s`` is the delay before they start, after the parent's previous
    response (0.0: at once); see the module docstring for how it is derived.
    """

    conversations: tuple[Conversation, ...]
    think_s: float


@dataclass(frozen=True, slots=True)
class Conversation:
    """One agent's calls in order, with the subagent groups it waited for in between."""

    name: str  # the file's "id"; a subagent's is "<parent name>/<agent_id>"
    block_tokens: int  # "block_size"
    steps: tuple[Call | Subagents, ...]

    @property
    def calls(self) -> int:
        """Calls of this conversation, its subagents' included, recursively."""
        return sum(1 for _ in _calls(self))

    @property
    def human_turns(self) -> int:
        """Calls with trigger USER, recursively."""
        return sum(1 for call in _calls(self) if call.trigger is Trigger.USER)


def load_conversations(
    paths: Sequence[str | Path], *, warm_prefix: bool = False
) -> list[Conversation]:
    """Every conversation in ``paths`` (files, or folders of trace files), sorted by name.

    A conversation with no calls is left out. Raises ``ConfigError`` naming the
    path for anything that cannot be read as this format.
    """
    found: dict[str, Path] = {}
    conversations = []
    for path in _trace_files(paths):
        with _collector_paused():
            conversation = _Reader(path, warm_prefix).file(_read_json(path))
        if conversation is None:
            continue
        if conversation.name in found:
            raise ConfigError(
                f"{path}: conversation {conversation.name!r} is also in "
                f"{found[conversation.name]} (block ids would collide)"
            )
        found[conversation.name] = path
        conversations.append(conversation)
    return sorted(conversations, key=lambda c: c.name)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Loading a file makes millions of objects and no reference cycles, so the cyclic
    collector would only rescan them: about a third of the data set's load time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def workload_summary(conversations: Sequence[Conversation]) -> dict[str, float]:
    """Headline figures of a workload, subagents included.

    ``think_samples``, ``think_p50_s`` and ``think_p90_s`` are over the human
    turns with a think time above 0 (a conversation's opening message has none);
    the percentiles are 0.0 when there are no samples.
    """
    calls = [call for c in conversations for call in _calls(c)]
    think = sorted(c.think_s for c in calls if c.trigger is Trigger.USER and c.think_s > 0)
    return {
        "conversations": len(conversations),
        "calls": len(calls),
        "human_turns": sum(1 for c in calls if c.trigger is Trigger.USER),
        "subagent_groups": sum(_groups(c) for c in conversations),
        "prompt_tokens": sum(c.prompt_tokens for c in calls),
        "think_samples": len(think),
        "think_p50_s": _percentile(think, 0.5),
        "think_p90_s": _percentile(think, 0.9),
    }


def _calls(conversation: Conversation) -> Iterator[Call]:
    for step in conversation.steps:
        if isinstance(step, Call):
            yield step
        else:
            for nested in step.conversations:
                yield from _calls(nested)


def _groups(conversation: Conversation) -> int:
    return sum(
        1 + sum(_groups(nested) for nested in step.conversations)
        for step in conversation.steps
        if isinstance(step, Subagents)
    )


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not ordered:
        return 0.0
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _trace_files(paths: Sequence[str | Path]) -> Iterator[Path]:
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.name.endswith(TRACE_SUFFIXES))
            if not files:
                raise ConfigError(f"{path}: no trace files (*.json, *.json.gz) in this folder")
            yield from files
        elif path.is_file():
            yield path
        else:
            raise ConfigError(f"{path}: no such trace file or folder")


def _read_json(path: Path) -> Any:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as error:
        raise ConfigError(f"{path}: cannot read trace: {error}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not JSON: {error}") from None


@dataclass(slots=True)
class _Chain:
    """One conversation's prompt so far: its warm region, and its last call to extend."""

    names: tuple[str, ...]  # the shared ids of the leading blocks; empty without warm_prefix
    first: list[Any] | None = None  # the first call's hash ids, which the warm region matches
    last_ids: list[Any] = field(default_factory=list)
    last_shared: int = 0
    last_blocks: tuple[str, ...] = ()

    def shared(self, hash_ids: list[Any]) -> int:
        """How many leading blocks of a call keep the shared ids (see the module docstring)."""
        if self.first is None:
            self.first = hash_ids
        return min(len(self.names), _common(hash_ids, self.first))

    def known(self, hash_ids: list[Any], shared: int) -> tuple[str, ...]:
        """The call's leading blocks named already: as many as it has in common with the last.

        An agent's prompt mostly grows, so each call names only its new blocks;
        this keeps loading the data set fast. (With the same warm run, both calls
        match the first call there, so their common part is at least that run.)
        """
        if shared != self.last_shared:
            return self.names[:shared]
        return self.last_blocks[: _common(hash_ids, self.last_ids)]

    def extend(self, hash_ids: list[Any], shared: int, blocks: tuple[str, ...]) -> None:
        self.last_ids, self.last_shared, self.last_blocks = hash_ids, shared, blocks


def _common(one: list[Any], other: list[Any]) -> int:
    """The length of the common prefix (binary search: slices compare in C)."""
    if len(one) < len(other):
        one, other = other, one
    if one[: len(other)] == other:
        return len(other)
    same, differs = 0, len(other)
    while differs - same > 1:
        middle = (same + differs) // 2
        if one[:middle] == other[:middle]:
            same = middle
        else:
            differs = middle
    return same


@dataclass(slots=True)
class _Reader:
    """Reads one file: its block scope, and each distinct hash id's block id built once."""

    path: Path
    warm_prefix: bool
    scope: str = ""
    block_tokens: int = 0
    ids: dict[Any, str] = field(default_factory=dict)

    def file(self, data: Any) -> Conversation | None:
        data = self._object(data, "the file")
        self.scope = str(data.get("id", self.path.name.split(".")[0]))
        self.block_tokens = self._count(data, "block_size", "the file")
        if self.block_tokens == 0:
            raise self._error("the file", "'block_size' must be above 0")
        if data.get("hash_id_scope", "local") != "local":
            raise self._error("the file", f"hash_id_scope {data['hash_id_scope']!r} unsupported")
        return self._conversation(data, self.scope, "warm", "")

    def _conversation(self, data: _Json, name: str, warm: str, where: str) -> Conversation | None:
        requests = data.get("requests")
        if not isinstance(requests, list):
            raise self._error(where or "the file", "no 'requests' list")
        chain = _Chain(self._warm_names(data, warm, where))
        steps = tuple(self._steps(requests, name, chain, where, agent=bool(where)))
        conversation = Conversation(name, self.block_tokens, steps)
        return conversation if conversation.calls else None

    def _warm_names(self, data: _Json, warm: str, where: str) -> tuple[str, ...]:
        if not self.warm_prefix:
            return ()
        tokens = self._count(data, "system_tokens", where, 0)
        tokens += self._count(data, "tool_tokens", where, 0)
        return tuple(f"{warm}/{i}" for i in range(tokens // self.block_tokens))

    def _steps(
        self, requests: list[Any], name: str, chain: _Chain, where: str, *, agent: bool
    ) -> Iterator[Call | Subagents]:
        """Calls in order; consecutive subagent entries become one group. A subagent's
        calls (``agent``) come from its parent agent, never from a human."""
        previous_end = 0.0  # the parent's previous response: its call's t + api_time
        group: list[tuple[str, _Json]] = []
        for index, entry in enumerate(requests):
            at = f"{where}.requests[{index}]" if where else f"requests[{index}]"
            entry = self._object(entry, at)
            if entry.get("type") == "subagent":
                group.append((at, entry))
                continue
            yield from self._group(group, name, previous_end)
            group = []
            call = self._call(entry, chain, at, agent=agent)
            previous_end = self._seconds(entry, "t", at, 0.0) + call.api_s
            yield call
        yield from self._group(group, name, previous_end)

    def _group(
        self, entries: list[tuple[str, _Json]], parent: str, previous_end: float
    ) -> Iterator[Subagents]:
        """One step for the group, without its empty conversations (none if all are)."""
        kept: list[tuple[str, _Json, Conversation]] = []
        for at, entry in entries:
            conversation = self._subagent(entry, parent, at)
            if conversation is not None:
                kept.append((at, entry, conversation))
        if kept:
            at, entry, _ = kept[0]
            think_s = self._start_delay(entry, previous_end, at)
            yield Subagents(tuple(c for _, _, c in kept), think_s)

    def _subagent(self, entry: _Json, parent: str, where: str) -> Conversation | None:
        agent = entry.get("agent_id") or where.rsplit(".", 1)[-1]
        warm = f"warm/{entry.get('subagent_type') or 'agent'}"
        return self._conversation(entry, f"{parent}/{agent}", warm, where)

    def _start_delay(self, entry: _Json, previous_end: float, where: str) -> float:
        """The entry's think_time, else its start (see the module docstring) after previous_end."""
        if entry.get("think_time") is not None:
            return self._seconds(entry, "think_time", where)
        start = self._seconds(entry, "t", where, 0.0)
        if entry.get("duration_ms") is not None:
            start -= self._seconds(entry, "duration_ms", where) / 1000.0
        return max(0.0, start - previous_end)

    def _call(self, entry: _Json, chain: _Chain, where: str, *, agent: bool) -> Call:
        prompt_tokens = self._count(entry, "in", where)
        stop = entry.get("stop")
        human = not agent and entry.get("input_types") == ["text"]
        return Call(
            blocks=self._blocks(entry, prompt_tokens // self.block_tokens, chain, where),
            prompt_tokens=prompt_tokens,
            output_tokens=self._count(entry, "out", where),
            trigger=Trigger.USER if human else Trigger.TOOL,
            stop=_STOPS.get(stop, Stop.OTHER) if isinstance(stop, str) else Stop.OTHER,
            think_s=self._seconds(entry, "think_time", where, 0.0),
            api_s=self._seconds(entry, "api_time", where, 0.0),
        )

    def _blocks(self, entry: _Json, count: int, chain: _Chain, where: str) -> tuple[str, ...]:
        hash_ids = entry.get("hash_ids", [])
        if not isinstance(hash_ids, list):
            raise self._error(where, "'hash_ids' is not a list")
        hash_ids = hash_ids[:count]
        shared = chain.shared(hash_ids) if chain.names else 0
        known = chain.known(hash_ids, shared)
        blocks = known + self._scoped(hash_ids[len(known) :], where)
        chain.extend(hash_ids, shared, blocks)
        return blocks

    def _scoped(self, hash_ids: list[Any], where: str) -> tuple[str, ...]:
        try:
            new = set(hash_ids).difference(self.ids)
        except TypeError:
            raise self._error(where, "a hash id is not an integer or string") from None
        for hash_id in new:
            if isinstance(hash_id, bool) or not isinstance(hash_id, int | str):
                raise self._error(where, f"hash id {hash_id!r} is not an integer or string")
            self.ids[hash_id] = f"{self.scope}/{hash_id}"
        return tuple(map(self.ids.__getitem__, hash_ids))

    def _count(self, data: _Json, key: str, where: str, default: int | None = None) -> int:
        value = self._value(data, key, where, default)
        if not isinstance(value, int):
            raise self._error(where, f"{key!r} is {value!r}, not a whole number")
        return value

    def _seconds(self, data: _Json, key: str, where: str, default: float | None = None) -> float:
        value = self._value(data, key, where, default)
        if not math.isfinite(value):
            raise self._error(where, f"{key!r} is {value!r}, not a finite number")
        return float(value)

    def _value(self, data: _Json, key: str, where: str, default: float | None) -> Any:
        value = data.get(key)
        if value is None:
            if default is None:
                raise self._error(where, f"missing {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise self._error(where, f"{key!r} is {value!r}, not a non-negative number")
        return value

    def _object(self, data: Any, where: str) -> _Json:
        if not isinstance(data, dict):
            raise self._error(where, "not a JSON object")
        return data

    def _error(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {where}: {problem}")

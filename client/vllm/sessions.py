"""Session events from vLLM's scheduler: what lets the daemon's predictor see an agent.

The return-time predictor learns from ``request_started`` / ``request_finished``
(``kvstore.wire.events``), and places a session's KV by the chain those events carry.
vLLM knows nothing of sessions, so the connector reports every request it
allocates and finishes, with the request's chain (the keys of its full blocks, in
rank 0's namespace):

* By default the session is left ``UNNAMED``: the daemon infers it from the chain,
  since an agent's next call sends the previous prompt and output again plus what
  is new, and so extends the chain the last ``request_finished`` carried.
* A client that knows better names it per request, in vLLM's ``kv_transfer_params``
  (the OpenAI server's request field of that name, ``SamplingParams.extra_args``
  offline)::

      {"kvstore": {"session": "chat-42", "user": "alice", "trigger": "tool"}}

  ``session`` and ``user`` are 1 to ``MAX_SESSION_CHARS`` characters; ``trigger`` is
  ``"user"`` (the default: a person sent it) or ``"tool"`` (a tool's result came
  back). A malformed tag is logged and the request reported unnamed: a tag is
  advice, and never fails an engine request.
* Whether the agent now waits on a tool shows in how the output ended: with
  ``tool_call_end_token_ids`` in the connector's extra config (the token a chat
  template ends a tool call with, ``<|eom_id|>`` for Llama 3.1), a request whose
  last output token is one of them reports ``tool_running``.

The scheduler's loop only stamps an event with the time and queues it: one thread
of its own sends the events in order (a 119K-token context's event carries 7,438
keys, about as long to send as the lookup). A full queue (``QUEUE_EVENTS``) drops
the event, with a warning at most once a minute; a failed send is counted by the client
(``ClientStats``) and dropped. Nothing is raised into vLLM. ``session_events =
false`` in the extra config turns them off.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.client.connect import KVClient
from kvstore.client.vllm.pages import PageFormat
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey
from kvstore.throttled_log import ThrottledLog
from kvstore.wire.events import MAX_EVENT_KEYS, MAX_SESSION_CHARS, UNNAMED, Trigger

log = logging.getLogger("kvstore.client.vllm")

TAG_FIELD = "kvstore"
"""The key of kvstore's entry in a request's ``kv_transfer_params``."""
_TAG_KEYS = frozenset({"session", "user", "trigger"})
QUEUE_EVENTS = 1024
"""Events waiting to be sent at most; beyond it, the newest are dropped."""
CLOSE_WAIT_S = 2.0
"""How long ``close`` waits for the queued events to go out."""


@dataclass(frozen=True, slots=True)
class SessionTag:
    """Who a request belongs to, as its client said (``UNNAMED``: the daemon infers it)."""

    session: str = UNNAMED
    user: str | None = None
    trigger: Trigger = Trigger.USER


def session_tag(kv_transfer_params: Mapping[str, Any] | None) -> SessionTag:
    """The tag in ``kv_transfer_params``; an absent one is ``SessionTag()``.

    Raises ``ValueError`` naming what is wrong with a malformed tag."""
    raw = (kv_transfer_params or {}).get(TAG_FIELD)
    if raw is None:
        return SessionTag()
    if not isinstance(raw, Mapping):
        raise ValueError(f"kv_transfer_params[{TAG_FIELD!r}] must be an object, not {raw!r}")
    unknown = set(raw) - _TAG_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (known: {sorted(_TAG_KEYS)})")
    session, user = (_name(raw, field) for field in ("session", "user"))
    named = raw.get("trigger", Trigger.USER.value)
    trigger = next((t for t in Trigger if t.value == named), None)
    if trigger is None:
        raise ValueError(f"trigger must be one of {[t.value for t in Trigger]}, not {named!r}")
    return SessionTag(session or UNNAMED, user, trigger)


def _name(raw: Mapping[str, Any], field: str) -> str | None:
    value = raw.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
        raise ValueError(f"{field} must be a string of 1 to {MAX_SESSION_CHARS} characters")
    return value


def waits_on_tool(output_token_ids: Sequence[int], tool_call_end: Collection[int]) -> bool:
    """Whether an output ended with a tool call: its last token is one that ends one."""
    return bool(output_token_ids) and output_token_ids[-1] in tool_call_end


@dataclass(slots=True)
class _Started:
    tag: SessionTag
    loaded_tokens: int
    recomputed_tokens: int


class SessionEvents:
    """The scheduler side's session reports; see the module docstring."""

    def __init__(
        self, store: KVClient, pages: PageFormat, tool_call_end: Collection[int] = ()
    ) -> None:
        self._store = store
        self._pages = pages
        self._tool_call_end = frozenset(tool_call_end)
        self._started: dict[str, _Started] = {}  # req id -> what its start reported
        self._malformed = ThrottledLog(log, every_s=60.0)
        self._full = ThrottledLog(log, every_s=60.0)
        self._queue: queue.Queue[_Report | None] = queue.Queue(QUEUE_EVENTS)
        self._sender = threading.Thread(target=self._send_all, name="kvstore-events", daemon=True)
        self._sender.start()

    def started(
        self, request: Any, keys: Sequence[ChunkKey], local_tokens: int, external_tokens: int
    ) -> None:
        """vLLM allocated ``request`` for the first time (a preempted request allocated
        again is not a new start): report it with its prompt's chain, ``keys``."""
        if request.request_id in self._started:
            return
        tag = self._tag(request)
        prompt = int(request.num_prompt_tokens)
        cached = min(prompt, local_tokens + external_tokens)
        self._started[request.request_id] = _Started(tag, external_tokens, prompt - cached)
        self._send(
            self._store.request_started,
            tag.session,
            prompt_tokens=prompt,
            cached_tokens=cached,
            trigger=tag.trigger,
            user=tag.user,
            namespace=self._pages.namespace(request.cache_salt),
            keys=keys[:MAX_EVENT_KEYS],
        )

    def finished(self, request: Any, keys: Sequence[ChunkKey]) -> None:
        """``request`` ended (done or aborted): the session goes idle. ``keys``: the
        chain of its prompt and output."""
        started = self._started.pop(request.request_id, None)
        if started is None:  # never allocated: nothing of it ran
            return
        output = list(request.output_token_ids)
        self._send(
            self._store.request_finished,
            started.tag.session,
            steps=1,
            output_tokens=len(output),
            context_tokens=int(request.num_tokens),
            loaded_tokens=started.loaded_tokens,
            recomputed_tokens=started.recomputed_tokens,
            tool_running=waits_on_tool(output, self._tool_call_end),
            namespace=self._pages.namespace(request.cache_salt),
            keys=keys[:MAX_EVENT_KEYS],
        )

    def _tag(self, request: Any) -> SessionTag:
        try:
            return session_tag(getattr(request, "kv_transfer_params", None))
        except ValueError as error:
            self._malformed.warning(
                "request %s: kvstore's kv_transfer_params ignored: %s", request.request_id, error
            )
            return SessionTag()

    def close(self) -> None:
        """Send what is queued (waiting at most ``CLOSE_WAIT_S``), then stop the sender."""
        try:
            self._queue.put(None, timeout=CLOSE_WAIT_S)
        except queue.Full:
            return
        self._sender.join(CLOSE_WAIT_S)

    def _send(self, report: Callable[..., None], session: str, **fields: Any) -> None:
        """Queue one event, stamped now (the sender may send it later)."""
        if session == UNNAMED and not fields["keys"]:
            return  # a prompt shorter than a block: nothing to name the session by
        try:
            self._queue.put_nowait(_Report(report, session, {**fields, "time": time.time()}))
        except queue.Full:
            self._full.warning("kvstore session events dropped: %d queued", QUEUE_EVENTS)

    def _send_all(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                item.report(item.session, **item.fields)
            except KVStoreError as error:  # the client counts what it drops; this is the rest
                log.warning("kvstore session event not sent: %s", error)


@dataclass(frozen=True, slots=True)
class _Report:
    """One queued event: the client method that sends it and its arguments."""

    report: Callable[..., None]
    session: str
    fields: dict[str, Any]

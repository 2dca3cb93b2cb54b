"""How a request's ``kv_transfer_params`` tag and its output become session events,
and how they are sent, against a real daemon (no vLLM needed;
``test_vllm_connector`` sees them reach a daemon through vLLM)."""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from support.daemon import Daemon

import kvstore
from kvstore.client.connect import KVClient
from kvstore.client.vllm import sessions
from kvstore.client.vllm.pages import PageFormat
from kvstore.client.vllm.sessions import (
    CLOSE_WAIT_S,
    SessionEvents,
    SessionTag,
    session_tag,
    waits_on_tool,
)
from kvstore.wire.events import MAX_SESSION_CHARS, UNNAMED, Trigger


def test_an_absent_tag_leaves_the_session_to_the_daemon() -> None:
    for params in (None, {}, {"lmcache.ttl": 60}, {"kvstore": None}):
        assert session_tag(params) == SessionTag(UNNAMED, None, Trigger.USER)


def test_a_tag_names_the_session_its_user_and_what_sent_the_request() -> None:
    tag = {"session": "chat-7", "user": "alice", "trigger": "tool"}
    assert session_tag({"kvstore": tag}) == SessionTag("chat-7", "alice", Trigger.TOOL)
    assert session_tag({"kvstore": {"user": "bob"}}) == SessionTag(UNNAMED, "bob", Trigger.USER)


@pytest.mark.parametrize(
    ("tag", "complaint"),
    [
        ("chat-7", "must be an object"),
        ({"session": "s", "colour": "red"}, r"unknown keys \['colour'\]"),
        ({"session": 7}, "session must be a string"),
        ({"session": ""}, "session must be a string"),
        ({"user": "u" * (MAX_SESSION_CHARS + 1)}, "user must be a string"),
        ({"trigger": "cron"}, "trigger must be one of"),
    ],
)
def test_a_malformed_tag_says_what_is_wrong(tag: Any, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        session_tag({"kvstore": tag})


def test_an_output_ending_in_a_tool_calls_end_token_waits_on_the_tool() -> None:
    eom, eot = 128008, 128009  # Llama 3.1's <|eom_id|> and <|eot_id|>
    assert waits_on_tool([5, 6, eom], {eom})
    assert not waits_on_tool([5, eom, eot], {eom})  # only how the output ended counts
    assert not waits_on_tool([], {eom})
    assert not waits_on_tool([5, 6, eom], ())  # none configured: never


PAGES = PageFormat(
    model="events@main",
    layer_names=("layers.0.attn",),
    num_kv_heads=1,
    head_size=64,
    dtype="float32",
    block_size=16,
)
CALLS = 50  # an agent's calls, each extending the last one's chain by a block
KEYS = PAGES.keys(None, [hashlib.sha256(bytes([i])).digest() for i in range(CALLS + 3)])


def request(name: str, prompt_blocks: int, session: str) -> SimpleNamespace:
    """What ``SessionEvents`` reads of a vLLM ``Request``: a prompt, an output of one
    block, its tag."""
    return SimpleNamespace(
        request_id=name,
        num_prompt_tokens=prompt_blocks * 16,
        num_tokens=(prompt_blocks + 1) * 16,
        output_token_ids=list(range(16)),
        cache_salt=None,
        kv_transfer_params={"kvstore": {"session": session}},
    )


def test_events_go_out_in_order_and_close_sends_what_is_still_queued(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    # close waits CLOSE_WAIT_S for the queue: here long enough for a busy machine to send
    # all 100, since what is tested is that it sends them, in order, not how fast.
    monkeypatch.setattr(sessions, "CLOSE_WAIT_S", 60.0)
    daemon = daemon_factory()
    with kvstore.connect(daemon.url) as client:
        events = SessionEvents(client, PAGES)
        for i in range(CALLS):
            call = request(f"r{i}", i + 2, "agent-1")
            events.started(call, KEYS[: i + 2], local_tokens=0, external_tokens=0)
            events.finished(call, KEYS[: i + 3])
        events.close()
        with daemon.client() as http:  # every event was received by the time close returns
            assert http.get("/v1/stats").json()["daemon"]["events_received"] == 2 * CALLS
    with daemon.client() as http:
        deadline = time.monotonic() + 20.0
        while (body := http.get("/v1/sessions/agent-1").json()).get("requests") != CALLS:
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
    assert (body["active"], body["gaps"], body["chain"]["chunks"]) == (False, CALLS - 1, CALLS + 2)


def test_closing_over_a_daemon_that_does_not_answer_is_bounded(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """SIGSTOP: the sender hangs in its first send until the client's timeout; vLLM's
    shutdown waits for it at most ``CLOSE_WAIT_S``, and the scheduler's loop never."""
    daemon = daemon_factory()
    assert daemon.proc is not None
    with kvstore.connect(daemon.url, timeout_s=10.0) as client:
        events = SessionEvents(client, PAGES)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            for name in ("r1", "r2", "r3"):
                call = request(name, 3, "stuck")
                events.started(call, KEYS[:3], local_tokens=0, external_tokens=0)
                events.finished(call, KEYS[:4])
            queued = time.monotonic() - began
            events.close()
            closed = time.monotonic() - began
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    assert queued < 1.0  # six events queued, none sent on this thread
    assert closed < 2 * CLOSE_WAIT_S + 1.0


class _Watched:
    """A real client whose sends say when the first one began (the sender's thread
    then holds that event, and the queue is empty)."""

    def __init__(self, client: KVClient) -> None:
        self.client = client
        self.sending = threading.Event()

    def request_started(self, *args: Any, **fields: Any) -> None:
        self.sending.set()
        self.client.request_started(*args, **fields)

    def request_finished(self, *args: Any, **fields: Any) -> None:
        self.sending.set()
        self.client.request_finished(*args, **fields)


def test_a_full_queue_drops_the_newest_events_with_one_warning_and_never_blocks(
    daemon_factory: Callable[..., Daemon],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The daemon stopped: one event hangs in its send, ``QUEUE_EVENTS`` wait behind it,
    and the rest are dropped at once; once it answers again, exactly those arrive."""
    monkeypatch.setattr(sessions, "QUEUE_EVENTS", 4)
    monkeypatch.setattr(sessions, "CLOSE_WAIT_S", 60.0)  # close sends all 5, however busy
    daemon = daemon_factory()
    assert daemon.proc is not None
    with kvstore.connect(daemon.url, timeout_s=10.0) as client:
        watched = _Watched(client)
        events = SessionEvents(cast(KVClient, watched), PAGES)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            first = request("r0", 2, "flooded")
            events.started(first, KEYS[:2], local_tokens=0, external_tokens=0)
            assert watched.sending.wait(5.0)
            began = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="kvstore.client.vllm"):
                events.finished(first, KEYS[:3])
                for i in range(1, 5):  # with the first's finish, 4 queued; then 5 dropped
                    call = request(f"r{i}", 2, "flooded")
                    events.started(call, KEYS[:2], local_tokens=0, external_tokens=0)
                    events.finished(call, KEYS[:3])
            queued = time.monotonic() - began
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        events.close()
        with daemon.client() as http:
            assert http.get("/v1/stats").json()["daemon"]["events_received"] == 1 + 4
    assert queued < 1.0
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped == ["kvstore session events dropped: 4 queued"]

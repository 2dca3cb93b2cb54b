"""How a request's ``kv_transfer_params`` tag and its output become session events
(no vLLM needed; ``test_vllm_connector`` sees them reach a daemon through vLLM)."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.client.vllm.sessions import SessionTag, session_tag, waits_on_tool
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

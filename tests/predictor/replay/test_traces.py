"""Trace loading: sessions inferred from Mooncake prefix chains, TraceLab rounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import PUBLIC_TRACES

from kvstore.errors import ConfigError
from kvstore.predictor.replay.traces import TraceFormat, load_trace
from kvstore.wire.events import Trigger

TRACES = PUBLIC_TRACES


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mooncake(ms: int, length: int, ids: list[int]) -> dict:
    return {"timestamp": ms, "input_length": length, "output_length": 10, "hash_ids": ids}


def test_mooncake_follow_ups_continue_their_session(tmp_path: Path) -> None:
    trace = load_trace(
        write(
            tmp_path / "t.jsonl",
            [
                mooncake(0, 1500, [0, 1, 2]),  # 2 full blocks + a partial one
                mooncake(1000, 1200, [0, 7, 8]),  # shares only the system block: new session
                mooncake(60_000, 2600, [0, 1, 2, 3, 4, 5]),  # extends the first (its partial block
                #                                              left out): same session
                mooncake(90_000, 3000, [0, 1, 9, 10, 11, 12]),  # shares 2 blocks: same session
            ],
        )
    )
    sessions = [request.session for request in trace.requests]
    assert sessions[0] == sessions[2] == sessions[3] != sessions[1]
    first = trace.requests[0]
    assert (first.time, first.blocks, first.prompt_tokens) == (0.0, (0, 1), 1500)
    assert trace.requests[2].blocks == (0, 1, 2, 3, 4)  # 2600 tokens: 5 full blocks
    assert trace.block_tokens == 512
    assert all(request.trigger is Trigger.USER for request in trace.requests)


def test_tracelab_rounds(tmp_path: Path) -> None:
    def round_(session: str, stamp: str, first_event: str, tokens: int) -> dict:
        return {
            "session_id": session,
            "project": "p1",
            "input_tokens_total": tokens,
            "output_tokens": 50,
            "timing_events": [{"event_type": first_event, "timestamp": stamp}],
        }

    trace = load_trace(
        write(
            tmp_path / "t.jsonl",
            [
                round_("s1", "2026-06-01T05:40:20.000Z", "user_message", 1100),
                round_("s1", "2026-06-01T05:40:50.000Z", "tool_result", 1600),
                round_("s2", "2026-06-01T05:40:30.000Z", "user_message", 600),
            ],
        )
    )
    assert [(r.session, r.time, r.trigger) for r in trace.requests] == [
        ("s1", 0.0, Trigger.USER),
        ("s2", 10.0, Trigger.USER),
        ("s1", 30.0, Trigger.TOOL),
    ]
    assert trace.requests[2].blocks == ("s1/0", "s1/1", "s1/2")
    assert trace.requests[0].blocks == trace.requests[2].blocks[:2]  # the chain grows
    assert trace.requests[0].user == "p1"


def test_bad_traces_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "empty.jsonl", TraceFormat.MOONCAKE)


@pytest.mark.skipif(
    not (TRACES / "mooncake_conversation_trace.jsonl").is_file(),
    reason="the public traces are absent (set KVSTORE_TEST_TRACES)",
)
def test_shared_traces_load_with_the_documented_shape() -> None:
    conversation = load_trace(TRACES / "mooncake_conversation_trace.jsonl")
    assert len(conversation.requests) == 12031
    follow_ups = len(conversation.requests) - len(conversation.sessions())
    assert (
        3_900 <= follow_ups <= 4_100
    )  # "about 4,000 of the 12,031 requests extend an earlier one"
    tracelab = load_trace(TRACES / "tracelab_example_round_trace.jsonl")
    assert len(tracelab.requests) == 19

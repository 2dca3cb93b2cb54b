"""kv-cache-tester traces as conversations: calls, subagent groups, scoped and warm block ids."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from support import PUBLIC_TRACES

from kvstore.errors import ConfigError
from kvstore.predictor.replay.conversations import (
    Call,
    Conversation,
    Stop,
    Subagents,
    load_conversations,
    workload_summary,
)
from kvstore.wire.events import Trigger

KV_CACHE_TESTER = PUBLIC_TRACES / "kv-cache-tester"
BLOCK = 4  # tokens per block in the hand-built traces


def call(t: float, tokens: int, ids: list[int], **fields: Any) -> dict[str, Any]:
    """A tool-result call ending in tool_use; ``fields`` override or add keys."""
    row = {
        "t": t,
        "type": "n",
        "in": tokens,
        "out": 5,
        "hash_ids": ids,
        "input_types": ["tool_result"],
        "stop": "tool_use",
        "api_time": 1.0,
        "think_time": 0.0,
    }
    return row | fields


def human(t: float, tokens: int, ids: list[int], think: float) -> dict[str, Any]:
    return call(t, tokens, ids, input_types=["text"], think_time=think)


def subagent(agent: str, t: float, requests: list[Any], **fields: Any) -> dict[str, Any]:
    row = {"t": t, "type": "subagent", "agent_id": agent, "subagent_type": "Explore"}
    return row | {"requests": requests, "system_tokens": 4, "tool_tokens": 0} | fields


def trace(name: str, requests: list[Any], **fields: Any) -> dict[str, Any]:
    row = {"id": name, "block_size": BLOCK, "hash_id_scope": "local", "requests": requests}
    return row | {"system_tokens": 4, "tool_tokens": 4} | fields


def write(path: Path, data: Any) -> Path:
    text = json.dumps(data).encode()
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path


def load_one(path: Path, *, warm_prefix: bool = False) -> Conversation:
    (conversation,) = load_conversations([path], warm_prefix=warm_prefix)
    return conversation


def first_blocks(conversation: Conversation) -> tuple[str, ...]:
    step = conversation.steps[0]
    assert isinstance(step, Call)
    return step.blocks


def test_calls_carry_trigger_stop_times_and_full_blocks(tmp_path: Path) -> None:
    requests = [
        human(0.0, 9, [1, 2, 3], think=0.0),  # 2 full blocks + a partial one
        call(3.0, 12, [1, 2, 4], stop="end_turn", think_time=2.0, api_time=0.5),
        human(200.0, 16, [1, 2, 4, 5], think=130.0),
        call(210.0, 20, [1, 2, 4, 5, 6], stop="max_tokens"),
    ]
    del requests[2]["stop"]  # missing: OTHER
    del requests[3]["api_time"], requests[3]["think_time"]  # missing: 0.0
    conversation = load_one(write(tmp_path / "t.json.gz", trace("t1", requests)))
    assert (conversation.name, conversation.block_tokens) == ("t1", BLOCK)
    assert conversation.steps == (
        Call(("t1/1", "t1/2"), 9, 5, Trigger.USER, Stop.TOOL_USE, 0.0, 1.0),
        Call(("t1/1", "t1/2", "t1/4"), 12, 5, Trigger.TOOL, Stop.END_TURN, 2.0, 0.5),
        Call(("t1/1", "t1/2", "t1/4", "t1/5"), 16, 5, Trigger.USER, Stop.OTHER, 130.0, 1.0),
        Call(("t1/1", "t1/2", "t1/4", "t1/5", "t1/6"), 20, 5, Trigger.TOOL, Stop.OTHER, 0.0, 0.0),
    )
    assert (conversation.calls, conversation.human_turns) == (4, 2)


def test_blocks_are_full_blocks_and_never_more_than_hash_ids(tmp_path: Path) -> None:
    requests = [
        call(0.0, 11, [1, 2, 3]),  # 11 // 4 = 2 full blocks
        call(5.0, 40, [1, 2, 3, 4]),  # 10 full blocks, but only 4 hash ids
        call(9.0, 3, [1]),  # no full block at all
        call(12.0, 8, [7, 8, 9]),  # a new prompt (after compaction)
    ]
    conversation = load_one(write(tmp_path / "t.json", trace("t", requests)))
    assert [step.blocks for step in conversation.steps if isinstance(step, Call)] == [
        ("t/1", "t/2"),
        ("t/1", "t/2", "t/3", "t/4"),
        (),
        ("t/7", "t/8"),
    ]


def test_consecutive_subagents_form_one_group_the_parent_waits_for(tmp_path: Path) -> None:
    # The parent's call ends at 10 + 2 = 12. Both agents start at 12.5: a finished agent's
    # t is when it finished (its start is t - duration_ms / 1000).
    first = subagent("agent_001", 42.5, [human(0.0, 8, [50, 51], think=0.0)], duration_ms=30000)
    second = subagent(
        "agent_002",
        62.5,
        [human(0.0, 8, [60, 61], think=0.0), call(4.0, 12, [60, 61, 62], think_time=3.0)],
        duration_ms=50000,
        subagent_type="Plan",
    )
    requests = [
        human(0.0, 8, [1, 2], think=0.0),
        call(10.0, 12, [1, 2, 3], api_time=2.0),
        first,
        second,
        call(70.0, 16, [1, 2, 3, 4], think_time=7.5),
    ]
    parent = load_one(write(tmp_path / "p.json", trace("p", requests)))
    assert [type(step) for step in parent.steps] == [Call, Call, Subagents, Call]
    group = parent.steps[2]
    assert isinstance(group, Subagents)
    assert group.think_s == 0.5
    assert [c.name for c in group.conversations] == ["p/agent_001", "p/agent_002"]
    assert group.conversations[1].steps == (
        # A subagent's task prompt is "text" too, but its parent agent wrote it: no human.
        Call(("p/60", "p/61"), 8, 5, Trigger.TOOL, Stop.TOOL_USE, 0.0, 1.0),
        Call(("p/60", "p/61", "p/62"), 12, 5, Trigger.TOOL, Stop.TOOL_USE, 3.0, 1.0),
    )
    assert group.conversations[1].block_tokens == BLOCK
    assert (parent.calls, parent.human_turns) == (6, 1)


def test_subagent_start_without_duration_and_with_explicit_think_time(tmp_path: Path) -> None:
    requests = [
        subagent("a1", 3.0, [call(0.0, 4, [9])]),  # first step: 3 s after the start
        call(20.0, 8, [1, 2], api_time=4.0),
        subagent("a2", 1.0, [call(0.0, 4, [8])]),  # t before the parent's response: 0.0
        call(30.0, 8, [1, 2]),
        subagent("a3", 50.0, [call(0.0, 4, [7])], think_time=2.25, duration_ms=1000),
    ]
    parent = load_one(write(tmp_path / "p.json", trace("p", requests)))
    delays = [step.think_s for step in parent.steps if isinstance(step, Subagents)]
    assert delays == [3.0, 0.0, 2.25]


def test_nested_subagents_and_empty_ones_dropped(tmp_path: Path) -> None:
    inner = subagent("agent_009", 2.0, [call(0.0, 8, [30, 31])], subagent_type="Plan")
    outer = subagent("agent_001", 5.0, [call(0.0, 8, [20, 21]), inner])
    empty = subagent("agent_002", 5.0, [])
    only_empty = subagent("agent_003", 9.0, [subagent("agent_004", 1.0, [])])
    requests = [call(0.0, 8, [1, 2]), outer, empty, call(8.0, 8, [1, 2]), only_empty]
    parent = load_one(write(tmp_path / "p.json", trace("p", requests)))
    assert [type(step) for step in parent.steps] == [Call, Subagents, Call]
    group = parent.steps[1]
    assert isinstance(group, Subagents)
    (agent,) = group.conversations
    assert agent.name == "p/agent_001"
    nested = agent.steps[1]
    assert isinstance(nested, Subagents)
    assert [c.name for c in nested.conversations] == ["p/agent_001/agent_009"]
    assert nested.conversations[0].steps == (
        Call(("p/30", "p/31"), 8, 5, Trigger.TOOL, Stop.TOOL_USE, 0.0, 1.0),
    )
    assert nested.think_s == 1.0  # 2.0 after the agent's call ended at 0 + 1
    assert (parent.calls, agent.calls) == (4, 2)


def test_a_file_without_calls_is_dropped(tmp_path: Path) -> None:
    write(tmp_path / "a.json", trace("a", [call(0.0, 4, [1])]))
    write(tmp_path / "b.json", trace("b", [subagent("agent_001", 1.0, [])]))
    write(tmp_path / "c.json", trace("c", []))
    assert [c.name for c in load_conversations([tmp_path])] == ["a"]


def test_block_ids_are_scoped_per_file(tmp_path: Path) -> None:
    one = write(tmp_path / "one.json", trace("one", [call(0.0, 8, [1, 2])]))
    two = write(tmp_path / "two.json.gz", trace("two", [call(0.0, 8, [1, 2])]))
    blocks = [first_blocks(c) for c in load_conversations([one, two])]
    assert blocks == [("one/1", "one/2"), ("two/1", "two/2")]


def test_warm_prefix_shares_the_leading_blocks_across_files(tmp_path: Path) -> None:
    # system 4 + tools 8 = 12 tokens: 3 warm blocks in each parent, 1 in its Explore agents.
    fields = {"system_tokens": 4, "tool_tokens": 8}
    a = [
        call(0.0, 16, [1, 2, 3, 4]),
        subagent("agent_001", 2.0, [call(0.0, 8, [40, 41])]),
        call(5.0, 20, [1, 2, 3, 4, 5]),
    ]
    b = [
        call(0.0, 16, [1, 2, 3, 4]),
        call(5.0, 16, [1, 9, 3, 4]),  # diverged at block 1: own ids from there on
        call(9.0, 8, [1, 2]),  # back to the first call's ids: shared again
    ]
    write(tmp_path / "a.json", trace("a", a, **fields))
    write(tmp_path / "b.json", trace("b", b, **fields))
    one, two = load_conversations([tmp_path], warm_prefix=True)
    agents = one.steps[1]
    assert isinstance(agents, Subagents)
    assert [s.blocks for s in one.steps if isinstance(s, Call)] == [
        ("warm/0", "warm/1", "warm/2", "a/4"),
        ("warm/0", "warm/1", "warm/2", "a/4", "a/5"),
    ]
    assert first_blocks(agents.conversations[0]) == ("warm/Explore/0", "a/41")
    assert [s.blocks for s in two.steps if isinstance(s, Call)] == [
        ("warm/0", "warm/1", "warm/2", "b/4"),
        ("warm/0", "b/9", "b/3", "b/4"),  # b/3 is not shared though its id matches again
        ("warm/0", "warm/1"),
    ]
    (plain,) = load_conversations([tmp_path / "b.json"])
    assert first_blocks(plain) == ("b/1", "b/2", "b/3", "b/4")


def test_a_folder_loads_its_trace_files_sorted_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    write(folder / "1.json", trace("zeta", [call(0.0, 4, [1])]))
    write(folder / "2.json.gz", trace("alpha", [call(0.0, 4, [1])]))
    (folder / "LICENSE").write_text("Apache-2.0")
    (folder / "notes.txt").write_text("not a trace")
    single = write(tmp_path / "single.json", trace("mid", [call(0.0, 4, [1])]))
    assert [c.name for c in load_conversations([folder, str(single)])] == ["alpha", "mid", "zeta"]


def test_workload_summary(tmp_path: Path) -> None:
    requests = [
        human(0.0, 8, [1, 2], think=0.0),
        subagent("agent_001", 3.0, [human(0.0, 4, [9], think=0.0), call(2.0, 8, [9, 10])]),
        call(9.0, 8, [1, 2]),
        human(100.0, 12, [1, 2, 3], think=60.0),
        human(300.0, 16, [1, 2, 3, 4], think=180.0),
        human(900.0, 20, [1, 2, 3, 4, 5], think=500.0),
    ]
    write(tmp_path / "a.json", trace("a", requests))
    b = [
        human(0.0, 4, [1], think=40.0),
        human(50.0, 8, [1, 2], think=20.0),
        human(2000.0, 12, [1, 2, 3], think=1000.0),
    ]
    write(tmp_path / "b.json", trace("b", b))
    assert workload_summary(load_conversations([tmp_path])) == {
        "conversations": 2,
        "calls": 10,
        "human_turns": 7,  # the subagent's "text" call is its parent's, not a human's
        "subagent_groups": 1,
        "prompt_tokens": 100,
        "think_samples": 6,  # 20, 40, 60, 180, 500, 1000 (the openings have none)
        "think_p50_s": 120.0,  # halfway between 60 and 180
        "think_p90_s": 750.0,  # halfway between 500 and 1000
    }
    assert workload_summary([])["think_p50_s"] == 0.0


ERRORS = [
    ("no-requests.json", {"id": "x", "block_size": 4}, "the file: no 'requests' list"),
    ("list.json", [1, 2], "the file: not a JSON object"),
    ("no-in.json", trace("x", [{"out": 1}]), "requests[0]: missing 'in'"),
    ("no-out.json", trace("x", [{"in": 1}]), "requests[0]: missing 'out'"),
    (
        "agent-no-requests.json",
        trace("x", [call(0.0, 4, [1]), {"type": "subagent", "agent_id": "a", "t": 1.0}]),
        "requests[1]: no 'requests' list",
    ),
    (
        "agent-no-out.json",
        trace("x", [call(0.0, 4, [1]), subagent("a", 1.0, [{"in": 1}])]),
        "requests[1].requests[0]: missing 'out'",
    ),
    (
        "negative.json",
        trace("x", [call(0.0, -4, [1])]),
        "requests[0]: 'in' is -4, not a non-negative number",
    ),
    (
        "negative-think.json",
        trace("x", [call(0.0, 4, [1], think_time=-1.5)]),
        "requests[0]: 'think_time' is -1.5, not a non-negative number",
    ),
    (
        "fraction.json",
        trace("x", [call(0.0, 4, [1], **{"in": 4.5})]),
        "requests[0]: 'in' is 4.5, not a whole number",
    ),
    (
        "bool.json",
        trace("x", [call(0.0, 4, [1], **{"in": True})]),
        "requests[0]: 'in' is True, not a non-negative number",
    ),
    ("zero-block.json", trace("x", [], block_size=0), "the file: 'block_size' must be above 0"),
    ("no-block.json", {"id": "x", "requests": []}, "the file: missing 'block_size'"),
    (
        "scope.json",
        trace("x", [], hash_id_scope="global"),
        "the file: hash_id_scope 'global' unsupported",
    ),
    (
        "ids.json",
        trace("x", [call(0.0, 4, [1], hash_ids="12")]),
        "requests[0]: 'hash_ids' is not a list",
    ),
    (
        "id.json",
        trace("x", [call(0.0, 8, [1], hash_ids=[1, 2.5])]),
        "requests[0]: hash id 2.5 is not an integer or string",
    ),
    (
        "id-list.json",
        trace("x", [call(0.0, 8, [1], hash_ids=[1, [2]])]),
        "requests[0]: a hash id is not an integer or string",
    ),
]


@pytest.mark.parametrize(("name", "data", "problem"), ERRORS, ids=[e[0] for e in ERRORS])
def test_malformed_conversations_name_the_path(
    tmp_path: Path, name: str, data: Any, problem: str
) -> None:
    path = write(tmp_path / name, data)
    with pytest.raises(ConfigError) as error:
        load_conversations([path])
    assert str(error.value) == f"{path}: {problem}"


def test_unreadable_paths_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "LICENSE").write_text("Apache-2.0")
    text = tmp_path / "text.json"
    text.write_text("hello")
    fake_gzip = tmp_path / "fake.json.gz"
    fake_gzip.write_text("hello")
    write(tmp_path / "one.json", trace("same", [call(0.0, 4, [1])]))
    write(tmp_path / "two.json", trace("same", [call(0.0, 4, [1])]))
    cases = [
        ([missing], f"{missing}: no such trace file or folder"),
        ([empty], f"{empty}: no trace files (*.json, *.json.gz) in this folder"),
        ([text], f"{text}: not JSON: Expecting value: line 1 column 1 (char 0)"),
        ([fake_gzip], f"{fake_gzip}: cannot read trace: Not a gzipped file (b'he')"),
        (
            [tmp_path / "one.json", tmp_path / "two.json"],
            f"{tmp_path / 'two.json'}: conversation 'same' is also in {tmp_path / 'one.json'}"
            " (block ids would collide)",
        ),
    ]
    for paths, message in cases:
        with pytest.raises(ConfigError) as error:
            load_conversations(paths)
        assert str(error.value) == message


@pytest.mark.skipif(
    not KV_CACHE_TESTER.is_dir(),
    reason="the kv-cache-tester data set is absent (set KVSTORE_TEST_TRACES)",
)
def test_the_kv_cache_tester_data_set_matches_its_readme() -> None:
    conversations = load_conversations([KV_CACHE_TESTER])  # about 13 s
    summary = workload_summary(conversations)
    top_level = [s for c in conversations for s in c.steps if isinstance(s, Call)]
    assert summary["conversations"] == 425
    # The data set's README's 29,617 requests and 3.67B prompt tokens are the parents'; the 32
    # subagents (21 groups) add 315 calls.
    assert len(top_level) == 29_617
    assert round(sum(c.prompt_tokens for c in top_level) / 1e9, 2) == 3.67
    assert (summary["calls"], summary["subagent_groups"]) == (29_932, 21)
    # Its 3,678 human turns are those with a think time: its 4,172 text calls less
    # each conversation's opening (425) and 69 without one. (The subagents' 32 task
    # prompts are "text" too, but no human's.)
    assert summary["think_samples"] == 3_678
    assert summary["human_turns"] == 4_172
    assert 120.0 <= summary["think_p50_s"] <= 140.0
    assert summary["think_p50_s"] == 130.0

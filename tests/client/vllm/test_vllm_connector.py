"""vLLM (the CPU build) with ``KVStoreConnector`` over a real ``kvstore serve`` daemon.

A random two-layer Llama saved with ``save_pretrained``; vLLM runs it with its
scheduler in the EngineCore process and its worker in another, so the
connector's two sides really talk only through vLLM's metadata and the
daemon. Each test reads the daemon's own counters to see what was stored,
served and found corrupt, and vLLM's ``num_cached_tokens`` to see where its
prefill started.

Run by ``make test-vllm`` (its own virtual environment); skipped where vLLM is
not installed, as in the main suite.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these")

from support.daemon import Daemon, running_daemon  # noqa: E402
from support.vllm_engine import (  # noqa: E402
    BLOCK,
    FULL_BLOCKS,
    damage_stored_block,
    generate,
    generate_stored,
    prompt,
    reload,
    save_model,
    start_llm,
    stats,
    stats_once_stored,
    stop_llm,
    vllm_keys,
)

import kvstore  # noqa: E402
from kvstore.kinds import TierKind  # noqa: E402

# LMDB only: every read is verified, and the files can be damaged between runs. The
# predictor is on, to see the connector's session events arrive. A put or get may
# name at most 2 blocks, fewer than a prompt has (as 4,096 are fewer than the 7,438
# 16-token blocks of a 119K-token context): the connector looks a prompt up in one
# lookup, puts each batch of one block from its parent on, and gets two at a time.
# Warnings raised inside these packages are theirs (see conftest.py); kvstore's stay errors.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:::(torch|vllm|transformers|triton|numba|pydantic)(\.|$)"
)
# The random model has no chat template: half its vocabulary "ends a tool call", so
# some greedy outputs end in one and some do not.
TOOL_CALL_END = list(range(256))
SSD_ONLY = """\
data_dir = "{data_dir}"
max_batch_chunks = 2


[tiers.ssd]
capacity = "256MiB"

[predictor]
tick_s = 0.1
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def store_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("kvstore"), config_text=SSD_ONLY) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def llm(model_dir: Path, store_daemon: Daemon) -> Iterator[Any]:
    engine = start_llm(
        model_dir,
        {
            "url": store_daemon.url,
            "batch_blocks": 1,
            "load_batch_blocks": 2,
            "tool_call_end_token_ids": TOOL_CALL_END,
        },
    )
    try:
        yield engine
    finally:
        stop_llm(engine)


def test_a_reset_prefix_is_loaded_from_kvstore_not_recomputed(
    llm: Any, store_daemon: Daemon
) -> None:
    run = reload(llm, store_daemon, prompt(1))
    assert run.cached_first == 0
    assert run.stored.chunks_stored - run.before.chunks_stored == FULL_BLOCKS

    assert run.second == run.first
    # vLLM's own cache was empty, so its prefill started past kvstore's blocks...
    assert run.cached_second == FULL_BLOCKS * BLOCK
    # ...which the daemon served, every one verified, none missing or stored again.
    assert run.ssd_hits == FULL_BLOCKS
    assert run.after.get_misses == run.stored.get_misses
    assert run.after.chunks_stored == run.stored.chunks_stored


def test_a_corrupt_block_is_recomputed_never_used(
    llm: Any, store_daemon: Daemon, model_dir: Path
) -> None:
    tokens = prompt(2)
    expected, namespace, keys = generate_stored(llm, store_daemon, model_dir, tokens)
    with kvstore.connect(store_daemon.url) as client:
        assert client.lookup(namespace, keys).num_chunks == FULL_BLOCKS  # keyed as vLLM hashes
    damage_stored_block(store_daemon, namespace, keys[1])
    before = stats(store_daemon)

    assert llm.reset_prefix_cache()
    got, _ = generate(llm, tokens)
    after = stats_once_stored(store_daemon, before.chunks_stored + 1)

    assert got == expected
    assert after.tiers[TierKind.SSD].corrupt_blocks - before.tiers[TierKind.SSD].corrupt_blocks == 1
    # vLLM recomputed from the damaged block on and saved what it recomputed.
    assert after.chunks_stored - before.chunks_stored == 1

    assert llm.reset_prefix_cache()
    again, cached = generate(llm, tokens)
    assert again == expected
    assert cached == FULL_BLOCKS * BLOCK
    assert stats(store_daemon).get_misses == after.get_misses


def test_a_block_the_scheduler_remembers_but_the_store_lost_is_recomputed(
    llm: Any, store_daemon: Daemon, model_dir: Path
) -> None:
    tokens = prompt(9)
    expected, namespace, keys = generate_stored(llm, store_daemon, model_dir, tokens)
    # The scheduler planned these saves, so it answers the same prompt from memory
    # while its lookup is on its way (client.vllm.held_blocks); the store drops all
    # but the first block meanwhile.
    with kvstore.connect(store_daemon.url) as client:
        assert client.delete(namespace, keys[1:]) == FULL_BLOCKS - 1
    before = stats(store_daemon)

    assert llm.reset_prefix_cache()
    got, _ = generate(llm, tokens)
    after = stats_once_stored(store_daemon, before.chunks_stored + FULL_BLOCKS - 1)

    assert got == expected  # the lost blocks failed to load and were recomputed, or the
    # lookup answered first and they were never asked for: never a wrong token
    assert after.chunks_stored - before.chunks_stored == FULL_BLOCKS - 1  # saved again


def test_an_agents_calls_reach_the_daemons_predictor_as_one_session(
    llm: Any, store_daemon: Daemon, model_dir: Path
) -> None:
    """With no tag, the daemon infers the session from the chains the connector
    reports: a second call that sends the first's prompt and output again, and more,
    continues the session of the first."""
    first = prompt(3)
    output, _ = generate(llm, first)
    _, cached = generate(llm, first + output + prompt(4)[:40])
    assert cached == FULL_BLOCKS * BLOCK  # the first call's blocks, from vLLM's own cache

    _, keys = vllm_keys(model_dir, first)
    body = session_once_idle(store_daemon, f"inferred-{keys[-1].hex()}", requests=2)
    assert body["user"] is None and body["gaps"] == 1
    assert body["chain"] is not None  # the daemon knows where its KV lies


def test_a_request_tagged_in_kv_transfer_params_is_the_session_and_user_it_names(
    llm: Any, store_daemon: Daemon, model_dir: Path
) -> None:
    tag = {"session": "chat-7", "user": "alice", "trigger": "user"}
    first = prompt(5)
    output, _ = generate(llm, first, {"kvstore": tag})
    generate(llm, first + output + prompt(6)[:40], {"kvstore": {**tag, "trigger": "tool"}})
    body = session_once_idle(store_daemon, "chat-7", requests=2)
    assert body["user"] == "alice" and body["gaps"] == 1

    # A malformed tag is ignored, never a failed request: the same tokens as untagged,
    # and the request reported as if it had none (its session inferred).
    again = prompt(8)
    bad = {"kvstore": {"session": 7, "colour": "red"}}
    assert generate(llm, again, bad)[0] == generate(llm, again)[0]
    _, keys = vllm_keys(model_dir, again)
    session_once_idle(store_daemon, f"inferred-{keys[-1].hex()}", requests=2)


def test_an_output_that_ends_a_tool_call_keeps_its_chain_for_the_tools_result(
    llm: Any, store_daemon: Daemon
) -> None:
    """The connector reports ``tool_running`` by the output's last token, and the
    daemon's placement names it: a tool's result comes back in seconds."""
    ends: dict[bool, str] = {}
    for seed in range(20, 60):
        if len(ends) == 2:
            break
        output, _ = generate(llm, prompt(seed), {"kvstore": {"session": f"tool-{seed}"}})
        ends.setdefault(output[-1] in TOOL_CALL_END, f"tool-{seed}")
    assert set(ends) == {True, False}, ends  # greedy and seeded: the same every run
    for ended_in_tool, name in ends.items():
        decisions = session_once_idle(store_daemon, name, 1)["decisions"]
        reasons = {d["reason"] for d in decisions if d["action"] == "place"}
        assert reasons, decisions  # placed at all: the blocks are the session's own
        assert ("tool running" in reasons) == ended_in_tool, reasons


def session_once_idle(daemon: Daemon, name: str, requests: int) -> dict[str, Any]:
    """``/v1/sessions/{name}`` once the daemon has seen ``requests`` of it and it is
    idle again (events are queued, and worked off by the predictor's thread)."""
    deadline = time.monotonic() + 20.0
    with daemon.client() as client:
        while True:
            response = client.get(f"/v1/sessions/{name}")
            body = response.json() if response.status_code == 200 else {}
            if body.get("requests") == requests and body.get("active") is False:
                return body
            assert time.monotonic() < deadline, (response.status_code, body)
            time.sleep(0.05)

"""vLLM (the CPU build) with every load asynchronous, a KV cache of 16 blocks, and a daemon
that can stall: loads off the step bring the same tokens back, a failed one is recomputed,
blocks held for saves and loads are all given back, and a stopped daemon costs a request
its lookup deadline, never a wrong token.

Run by ``make test-vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import signal
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
)

from kvstore.kinds import TierKind  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    r"ignore:::(torch|vllm|transformers|triton|numba|pydantic)(\.|$)"
)
CACHE_BLOCKS = 16  # vLLM's whole KV cache: four requests of four blocks
DEADLINE_MS = 300
SSD_ONLY = """\
data_dir = "{data_dir}"

[tiers.ssd]
capacity = "256MiB"
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
            "async_load_mib": 0,  # every load goes off the step
            "lookup_deadline_ms": DEADLINE_MS,
            "session_events": False,
        },
        num_gpu_blocks_override=CACHE_BLOCKS,
    )
    try:
        yield engine
    finally:
        stop_llm(engine)


def test_an_asynchronous_load_brings_back_the_same_tokens(
    llm: Any, store_daemon: Daemon
) -> None:
    run = reload(llm, store_daemon, prompt(11))
    assert run.second == run.first
    assert run.cached_second == FULL_BLOCKS * BLOCK
    assert run.ssd_hits == FULL_BLOCKS
    assert run.after.get_misses == run.stored.get_misses


def test_a_failed_asynchronous_load_is_recomputed_never_used(
    llm: Any, store_daemon: Daemon, model_dir: Path
) -> None:
    tokens = prompt(12)
    expected, namespace, keys = generate_stored(llm, store_daemon, model_dir, tokens)
    damage_stored_block(store_daemon, namespace, keys[1])
    before = stats(store_daemon)

    assert llm.reset_prefix_cache()
    got, _ = generate(llm, tokens)  # (vLLM counts the load as planned in num_cached_tokens)
    after = stats_once_stored(store_daemon, before.chunks_stored + 1)
    assert got == expected
    assert after.tiers[TierKind.SSD].corrupt_blocks - before.tiers[TierKind.SSD].corrupt_blocks == 1
    # vLLM computed from the damaged block on, and saved again what it computed.
    assert after.chunks_stored - before.chunks_stored == 1


@pytest.mark.timeout(300)
def test_blocks_held_for_saves_and_loads_all_come_back(llm: Any, store_daemon: Daemon) -> None:
    """Three times as many requests as the cache holds, each saved and then loaded
    again: a block held and never given back would leave vLLM without room (it would
    wait for it for ever, and the timeout fail the test)."""
    seeds = range(100, 106)
    assert 2 * len(seeds) * (FULL_BLOCKS + 1) == 3 * CACHE_BLOCKS
    outputs = {}
    for seed in seeds:
        stored = stats(store_daemon).chunks_stored
        outputs[seed] = generate(llm, prompt(seed))[0]
        stats_once_stored(store_daemon, stored + FULL_BLOCKS)
    before = stats(store_daemon)
    for seed, expected in outputs.items():
        assert llm.reset_prefix_cache()
        assert generate(llm, prompt(seed)) == (expected, FULL_BLOCKS * BLOCK)
    hits = stats(store_daemon).tiers[TierKind.SSD].hits - before.tiers[TierKind.SSD].hits
    assert hits == len(seeds) * FULL_BLOCKS


def test_a_stopped_daemon_costs_a_request_its_lookup_deadline_not_a_wrong_token(
    llm: Any, store_daemon: Daemon
) -> None:
    tokens = prompt(13)
    before = stats(store_daemon)
    expected, _ = generate(llm, tokens)
    stats_once_stored(store_daemon, before.chunks_stored + FULL_BLOCKS)
    assert llm.reset_prefix_cache()
    store_daemon.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        got, cached = generate(llm, tokens)
        elapsed = time.monotonic() - start
    finally:
        store_daemon.proc.send_signal(signal.SIGCONT)
    assert got == expected
    assert cached == 0  # computed: the lookup missed its deadline
    assert elapsed < DEADLINE_MS / 1e3 + 5.0

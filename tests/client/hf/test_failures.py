"""Failures mid-load recompute from the last good chunk; a real daemon serves the same path.

Every case checks the output against plain ``model.generate`` on the same
prompt: a failure may cost a recompute, never a wrong token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import hf_models
from support.daemon import Daemon
from support.hf_models import CHUNK
from support.lmdb_blocks import damage_block

import kvstore
from kvstore import CachedPrefix, TierKind
from kvstore.client.embedded import EmbeddedClient
from kvstore.client.hf import HFKVStore
from kvstore.keys import chunk_keys
from kvstore.local.redis_server import RedisServer
from kvstore.store.config import StoreConfig
from kvstore.tiers.registry import TierConfig

NEW_TOKENS = 6


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_corrupt_block_in_lmdb_is_recomputed_from_the_last_good_chunk(
    layerwise: bool, tmp_path: Path
) -> None:
    model = hf_models.model("llama")
    ids = hf_models.prompt(4 * CHUNK + 4)
    reference = hf_models.greedy(model, ids, NEW_TOKENS)
    config = hf_models.store_config(tmp_path, dram=False)
    with EmbeddedClient(config) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        assert kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False).report.saved_chunks
    keys = chunk_keys(kv.namespace, ids[0].numpy())
    damage_block(tmp_path / "lmdb", kv.namespace, keys[2])  # chunk 2, behind the store
    with EmbeddedClient(config) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        result = kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, layerwise=layerwise)
        assert torch.equal(result.sequences, reference)
        report = result.report
        assert (report.cached_tokens, report.loaded_tokens) == (4 * CHUNK, 2 * CHUNK)
        assert (report.failed_chunks, report.recomputed_tokens) == (2, 2 * CHUNK + 4)
        assert client.stats().tiers[TierKind.SSD].corrupt_blocks == 1
        # The purged chunk was stored again (chunk 3 was still held, so only marked
        # used), and the next request loads them all.
        assert report.saved_chunks == 1
        again = kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, layerwise=layerwise)
        assert torch.equal(again.sequences, reference)
        assert again.report.loaded_tokens == 4 * CHUNK


class StopsRedisAfterLookup(EmbeddedClient):
    """The real store, with Redis stopped between ``lookup`` and ``get`` once ``armed``: a
    tier failing mid-request, at the one moment a test can place it deterministically."""

    def __init__(self, config: StoreConfig, server: RedisServer) -> None:
        super().__init__(config)
        self.server = server
        self.armed = False

    def lookup(self, namespace: Any, tokens_or_keys: Any) -> CachedPrefix:
        prefix = super().lookup(namespace, tokens_or_keys)
        if self.armed:
            self.server.stop()
        return prefix


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_tier_down_mid_load_falls_back_to_the_chunks_that_loaded(
    layerwise: bool, clean_redis: RedisServer, tmp_path: Path
) -> None:
    model = hf_models.model("qwen2")
    ids = hf_models.prompt(4 * CHUNK + 2)
    reference = hf_models.greedy(model, ids, NEW_TOKENS)
    config = StoreConfig(
        tiers=(
            TierConfig(TierKind.DRAM, 64 << 20),
            TierConfig(
                TierKind.REDIS,
                64 << 20,
                url=clean_redis.url,
                socket_timeout_s=0.5,
                connect_timeout_s=0.5,
                write="back",  # chunks reach Redis only as the test moves them there
            ),
        ),
        promote_on_hit=False,
    )
    with StopsRedisAfterLookup(config, clean_redis) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        kv.generate(ids, max_new_tokens=1)  # warm the store, Redis left running
        keys = chunk_keys(kv.namespace, ids[0].numpy())
        # Chunks 0-1 stay in DRAM, chunks 2-3 move down to Redis.
        assert client.demote(kv.namespace, keys[2:4], to=TierKind.REDIS) == 2
        tiers = client.lookup(kv.namespace, keys).tiers
        assert tiers == (TierKind.DRAM, TierKind.DRAM, TierKind.REDIS, TierKind.REDIS)
        client.armed = True
        result = kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, layerwise=layerwise)
    assert torch.equal(result.sequences, reference)
    assert (result.report.loaded_tokens, result.report.failed_chunks) == (2 * CHUNK, 2)
    assert result.report.recomputed_tokens == 2 * CHUNK + 2


def client_tokens(daemon: Daemon) -> dict[str, float]:
    with daemon.client() as http:
        text = http.get("/metrics").text
    counts = {}
    for line in text.splitlines():
        if line.startswith("kvstore_client_tokens_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            counts[source] = float(line.rsplit(" ", 1)[1])
    return counts


def test_through_a_real_daemon_with_session_events(
    daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    model = hf_models.model("mistral-sliding")
    ids = hf_models.prompt(3 * CHUNK + 8)
    reference = hf_models.greedy(model, ids, NEW_TOKENS)
    expected = hf_models.full_logits(model, ids)
    before = client_tokens(daemon)
    with kvstore.connect(daemon.url) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK, tenant_salt=request.node.name)
        session = f"{request.node.name}-session"
        cold = kv.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, session=session, user="alice"
        )
        warm = kv.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, session=session, layerwise=True
        )
        prefill = kv.prefill(ids)
        assert client.client_stats() == type(client.client_stats())()  # nothing degraded
    assert torch.equal(cold.sequences, reference) and torch.equal(warm.sequences, reference)
    assert (cold.report.loaded_tokens, warm.report.loaded_tokens) == (0, 3 * CHUNK)
    assert torch.equal(prefill.logits, expected[:, 3 * CHUNK :])
    after = client_tokens(daemon)
    assert after["cache"] - before.get("cache", 0) == 3 * CHUNK
    assert after["recompute"] - before.get("recompute", 0) == (3 * CHUNK + 8) + 8
    # The predictor saw both requests as one session of the user the first one named.
    with daemon.client() as http:
        deadline = time.monotonic() + 10.0
        while True:
            known = http.get(f"/v1/sessions/{session}")
            if known.status_code == 200 and known.json()["requests"] >= 2:
                break
            assert time.monotonic() < deadline, known.text
            time.sleep(0.05)
    assert known.json()["user"] == "alice"


def test_events_that_cannot_be_sent_never_break_generation(
    daemon: Daemon, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model = hf_models.model("llama")
    ids = hf_models.prompt(2 * CHUNK + 3)
    reference = hf_models.greedy(model, ids, NEW_TOKENS)
    # A daemon that is not there: lookups miss, puts drop, events are not sent.
    with kvstore.connect(f"unix://{tmp_path}/absent.sock", timeout_s=0.2) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        result = kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, session="s")
    assert torch.equal(result.sequences, reference)
    assert result.report.loaded_tokens == 0 and result.report.save_error is None
    # A daemon that refuses the session name (over its limit): the events are dropped and
    # the save (a put carrying the session) fails; both are logged, the tokens stand.
    with kvstore.connect(daemon.url) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK, tenant_salt=request.node.name)
        refused = kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, session="x" * 999)
    assert torch.equal(refused.sequences, reference)
    assert refused.report.saved_chunks == 0
    assert refused.report.save_error is not None and "session" in refused.report.save_error

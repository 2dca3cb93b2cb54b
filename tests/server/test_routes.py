"""The daemon's routes against a real ``kvstore serve`` subprocess (DRAM + LMDB), spoken
in raw HTTP over its Unix socket: every route's happy path, bit-for-bit round trips
through bytes and shared memory, error codes, and the operational routes."""

from __future__ import annotations

import json
import mmap
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import http_kv
from support.daemon import Daemon
from support.http_kv import error_code, get_bytes, lookup, make_chain, put, register

from kvstore import cli
from kvstore.block import check_identity, encode_block, verify_block
from kvstore.cli import daemon_stats as cli_stats
from kvstore.keys import KVLayout, Namespace, chunk_keys
from kvstore.wire.events import EVENT_CONTENT_TYPE, RequestFinished, event_to_bytes


def test_health_readiness_and_socket_mode(daemon: Daemon, client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"ok": True}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "degraded": []}
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(daemon.socket_path).st_mode)


def test_register_is_idempotent(client: httpx.Client, ns: Namespace) -> None:
    register(client, ns)  # again: same digest, still 200
    bad = client.post("/v1/namespaces", json={"model": "m", "layout": {"num_layers": 1}})
    assert bad.status_code == 400 and error_code(bad) == "bad_request"


def test_put_then_bytes_get_round_trips_bit_for_bit(client: httpx.Client, ns: Namespace) -> None:
    chain = make_chain(ns, 6)
    assert lookup(client, ns, chain.keys) == {
        "num_chunks": 0,
        "chunk_tokens": ns.chunk_tokens,
        "total_chunks": 6,
        "tiers": [],
        "load_chunks": 0,
    }
    assert put(client, chain, session="agent-1") == 6
    assert put(client, chain) == 0  # already held: nothing rewritten
    found = lookup(client, ns, chain.keys)
    assert found["tiers"] == ["dram"] * 6 and found["load_chunks"] == 6  # DRAM beats prefill
    meta, blocks = get_bytes(client, ns, chain.keys)
    assert [entry["tier"] for entry in meta["blocks"]] == ["dram"] * 6
    assert blocks == chain.blocks  # the very bytes the client built, header included


def test_a_lookup_of_raw_keys_answers_as_json_does_with_its_tiers_in_runs(
    client: httpx.Client, ns: Namespace
) -> None:
    chain = make_chain(ns, 6, start=500)
    assert put(client, chain) == 6
    stranger = make_chain(ns, 2, start=900)  # not cached: the run stops at it
    keys = [*chain.keys, *stranger.keys]

    def raw(body: bytes, namespace: str = ns.digest.hex()) -> httpx.Response:
        return client.post(
            f"/v1/lookup?namespace={namespace}",
            content=body,
            headers={"Content-Type": "application/octet-stream"},
        )

    answer = raw(b"".join(keys)).json()
    assert answer == {
        "num_chunks": 6,
        "chunk_tokens": ns.chunk_tokens,
        "total_chunks": 8,
        "tier_runs": [["dram", 6]],
        "load_chunks": 6,
    }
    as_json = lookup(client, ns, keys)
    assert as_json["tiers"] == ["dram"] * 6
    assert {k: v for k, v in as_json.items() if k != "tiers"} == {
        k: v for k, v in answer.items() if k != "tier_runs"
    }
    assert raw(b"").json()["num_chunks"] == 0
    for bad, code in (
        (raw(b"".join(keys)[:-1]), "bad_request"),  # not a whole number of keys
        (raw(b"".join(keys), namespace="zz"), "bad_request"),
        (raw(b"".join(keys), namespace=""), "bad_request"),
    ):
        assert bad.status_code == 400 and error_code(bad) == code
    stranger_ns = http_kv.namespace_for("never-registered-raw")
    unknown = raw(b"".join(keys), namespace=stranger_ns.digest.hex())
    assert unknown.status_code == 404 and error_code(unknown) == "unknown_namespace"


def test_put_with_skipped_chunks_and_misses(client: httpx.Client, ns: Namespace) -> None:
    chain = make_chain(ns, 5, start=1000)
    # The client knows chunks 0 and 1 are cached elsewhere: null lengths, no bytes.
    assert put(client, chain, blocks=[None, None, *chain.blocks[2:]]) == 3
    result = lookup(client, ns, chain.keys)
    assert result["num_chunks"] == 0 and result["total_chunks"] == 5  # the head is missing
    meta, blocks = get_bytes(client, ns, chain.keys)
    assert [entry["length"] is None for entry in meta["blocks"]] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert [entry["tier"] for entry in meta["blocks"]] == [None, None, "dram", "dram", "dram"]
    assert blocks[2:] == chain.blocks[2:]


def test_shm_get_maps_the_arena_read_only(client: httpx.Client, ns: Namespace) -> None:
    chain = make_chain(ns, 4, start=2000, seed=3)
    put(client, chain)
    unknown = make_chain(ns, 1, start=9_000_000).keys
    arena = client.get("/v1/shm").json()
    assert set(arena) == {"name", "size"} and arena["size"] == 64 << 20
    response = client.post(
        "/v1/get",
        json={
            "namespace": ns.digest.hex(),
            "keys": [k.hex() for k in chain.keys + unknown],
            "transfer": "shm",
        },
    )
    assert response.status_code == 200, response.text
    grant = response.json()
    assert grant["shm"] == arena["name"] and grant["expires_in_s"] == 10.0
    assert grant["blocks"][-1] == {"key": unknown[0].hex(), "missing": True}
    fd = os.open(Path("/dev/shm") / grant["shm"], os.O_RDONLY)
    try:
        # The whole segment: the extent generations follow the blocks.
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapping:
            for entry, key, sent in zip(grant["blocks"], chain.keys, chain.blocks, strict=False):
                assert entry["key"] == key.hex() and entry["tier"] == "dram"
                block = mapping[entry["offset"] : entry["offset"] + entry["length"]]
                check_identity(verify_block(block), ns, key)
                assert block == sent
                # The extent's generation, where the client reads it back after a copy.
                at = entry["generation_at"]
                assert at % 8 == 0 and arena["size"] <= at < os.fstat(fd).st_size
                assert entry["generation"] == int.from_bytes(mapping[at : at + 8], sys.byteorder)
    finally:
        os.close(fd)
    stats = client.get("/v1/stats").json()["daemon"]
    assert stats["leases_outstanding"] >= 1 and stats["leased_blocks"] >= 4
    released = client.post(f"/v1/leases/{grant['lease']}/release")
    assert released.status_code == 200 and released.json() == {"released": 4}
    again = client.post(f"/v1/leases/{grant['lease']}/release")
    assert again.status_code == 404 and error_code(again) == "unknown_lease"


SMALL_DRAM = """\
data_dir = "{data_dir}"

[tiers.dram]
capacity = "256KiB"

[tiers.ssd]
capacity = "64MiB"
"""


def test_a_delete_waits_for_the_lease_on_its_blocks(daemon_factory: Callable[..., Daemon]) -> None:
    """A leased block deleted, then its DRAM space wanted by puts: the extent the
    client may still be copying from is neither freed nor rewritten until the lease
    goes; then the block is gone."""
    instance = daemon_factory(SMALL_DRAM)
    ns = http_kv.namespace_for("delete-under-lease")
    chain = make_chain(ns, 2, seed=7)
    with instance.client() as client:
        register(client, ns)
        put(client, chain)
        body = {"namespace": ns.digest.hex(), "keys": chain.hex_keys, "transfer": "shm"}
        grant = client.post("/v1/get", json=body).json()
        deleted = client.post(
            "/v1/delete", json={"namespace": ns.digest.hex(), "keys": chain.hex_keys}
        )
        assert deleted.json() == {"deleted": 2}
        for start in range(10_000, 10_000 + 64 * 16 * 4, 64 * 16):  # 4 x 16 chunks: DRAM is 64
            put(client, make_chain(ns, 16, start=start, seed=start))
        fd = os.open(Path("/dev/shm") / grant["shm"], os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapping:
                for entry, sent in zip(grant["blocks"], chain.blocks, strict=True):
                    at = entry["generation_at"]
                    assert entry["generation"] == int.from_bytes(
                        mapping[at : at + 8], sys.byteorder
                    )
                    assert mapping[entry["offset"] : entry["offset"] + entry["length"]] == sent
        finally:
            os.close(fd)
        assert lookup(client, ns, chain.keys)["num_chunks"] == 2  # readable meanwhile
        assert client.post(f"/v1/leases/{grant['lease']}/release").json() == {"released": 2}
        assert lookup(client, ns, chain.keys)["num_chunks"] == 0


def test_a_get_gives_back_the_leases_it_names(client: httpx.Client, ns: Namespace) -> None:
    """``release`` in a get's body unpins those leases first (unknown ids skipped: one
    expired, or released already), whichever transfer the get asks for."""
    chain = make_chain(ns, 2, start=2500, seed=4)
    put(client, chain)

    def shm_get(release: list[str] | None = None) -> dict[str, object]:
        body = {"namespace": ns.digest.hex(), "keys": chain.hex_keys, "transfer": "shm"}
        if release is not None:
            body["release"] = release
        response = client.post("/v1/get", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def outstanding() -> int:
        return int(client.get("/v1/stats").json()["daemon"]["leases_outstanding"])

    before = outstanding()
    first = shm_get()
    assert first["release_with_get"] is True
    second = shm_get(release=[str(first["lease"]), "0" * 32])
    assert outstanding() == before + 1  # the first gave back, the second held
    body = {"namespace": ns.digest.hex(), "keys": chain.hex_keys, "release": [second["lease"]]}
    assert client.post("/v1/get", json=body).status_code == 200  # a bytes get
    assert outstanding() == before
    gone = client.post(f"/v1/leases/{second['lease']}/release")
    assert gone.status_code == 404 and error_code(gone) == "unknown_lease"
    for bad in ("not-a-list", [1, 2], ["x"] * 2000):
        body = {"namespace": ns.digest.hex(), "keys": chain.hex_keys, "release": bad}
        refused = client.post("/v1/get", json=body)
        assert refused.status_code == 400 and error_code(refused) == "bad_request"


def test_delete(client: httpx.Client, ns: Namespace) -> None:
    chain = make_chain(ns, 3, start=3000)
    put(client, chain)
    body = {"namespace": ns.digest.hex(), "keys": chain.hex_keys[1:]}
    assert client.post("/v1/delete", json=body).json() == {"deleted": 2}
    assert client.post("/v1/delete", json=body).json() == {"deleted": 0}
    _, blocks = get_bytes(client, ns, chain.keys)
    assert blocks == [chain.blocks[0], None, None]


def test_unknown_namespace_is_404_on_every_route(client: httpx.Client) -> None:
    stranger = http_kv.namespace_for("never-registered")
    chain = make_chain(stranger, 1)
    body = {"namespace": stranger.digest.hex(), "keys": chain.hex_keys}
    for route in ("/v1/lookup", "/v1/get", "/v1/delete"):
        response = client.post(route, json=body)
        assert response.status_code == 404 and error_code(response) == "unknown_namespace"
    response = http_kv.put_raw(client, http_kv.frames_body(stranger, chain.keys, chain.blocks))
    assert response.status_code == 404 and error_code(response) == "unknown_namespace"


def test_events_are_validated_and_counted(client: httpx.Client) -> None:
    started = {
        "event": "request_started",
        "session": "agent-7",
        "trigger": "tool",
        "prompt_tokens": 1200,
        "cached_tokens": 1100,
        "time": time.time() - 1.0,
    }
    finished = {
        "event": "request_finished",
        "session": "agent-7",
        "steps": 3,
        "output_tokens": 875,
        "context_tokens": 1300,
        "tool_running": False,
        "loaded_tokens": 1100,
        "recomputed_tokens": 100,
    }
    before = _samples(client, "kvstore_client_tokens_total")
    for event in (started, finished):
        response = client.post("/v1/events", json=event)
        assert response.status_code == 200 and response.json() == {"accepted": True}
    after = _samples(client, "kvstore_client_tokens_total")
    assert after[("source", "cache")] - before[("source", "cache")] == 1100
    assert after[("source", "recompute")] - before[("source", "recompute")] == 100
    for bad in (
        {**started, "trigger": "cron"},
        {**started, "prompt_tokens": -1},
        {**finished, "tool_running": "no"},
        {**finished, "surprise": 1},
        {**started, "session": ""},
        {**started, "event": "nap"},
        [started],
    ):
        response = client.post("/v1/events", json=bad)
        assert response.status_code == 400 and error_code(response) == "bad_request", bad


def test_an_event_may_carry_its_keys_raw(client: httpx.Client, ns: Namespace) -> None:
    """``EVENT_CONTENT_TYPE``: the JSON object, a newline, the keys (what the vLLM
    connector sends, a chain of thousands of keys without hex)."""
    keys = tuple(make_chain(ns, 3, start=7000).keys)
    event = RequestFinished(
        "agent-raw", steps=1, output_tokens=8, context_tokens=96, tool_running=False,
        loaded_tokens=0, recomputed_tokens=96, time=time.time(), namespace=ns.digest, keys=keys,
    )  # fmt: skip
    headers = {"Content-Type": EVENT_CONTENT_TYPE}
    response = client.post("/v1/events", content=event_to_bytes(event), headers=headers)
    assert response.status_code == 200 and response.json() == {"accepted": True}
    for bad in (event_to_bytes(event)[:-1], json.dumps(event.to_json()).encode()):
        response = client.post("/v1/events", content=bad, headers=headers)
        assert response.status_code == 400 and error_code(response) == "bad_request"


def test_stats_and_metrics(client: httpx.Client, ns: Namespace) -> None:
    chain = make_chain(ns, 2, start=4000)
    put(client, chain)
    get_bytes(client, ns, chain.keys + make_chain(ns, 1, start=5000).keys)
    stats = client.get("/v1/stats").json()
    assert set(stats) == {"store", "daemon", "predictor"}
    assert set(stats["store"]["tiers"]) == {"dram", "ssd"}
    assert stats["daemon"]["listening"][0].startswith("unix://")
    assert stats["daemon"]["requests_served"] > 0
    text = client.get("/metrics")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(text.text)}
    for name in (
        "kvstore_http_requests",
        "kvstore_http_request_duration_seconds",
        "kvstore_tier_hits",
        "kvstore_chunk_misses",
        "kvstore_client_tokens",
        "kvstore_client_events",
        "kvstore_tier_used_bytes",
        "kvstore_tier_capacity_bytes",
        "kvstore_tier_bytes_read",
        "kvstore_tier_evictions",
        "kvstore_tier_demotions",
        "kvstore_tier_promotions",
        "kvstore_tier_corrupt_blocks",
        "kvstore_leases_outstanding",
    ):
        assert name in families, name
    hits = {s.labels["tier"]: s.value for s in families["kvstore_tier_hits"].samples}
    assert hits["dram"] >= 2
    assert families["kvstore_chunk_misses"].samples[0].value >= 1
    routes = {
        (s.labels["route"], s.labels["status"])
        for s in families["kvstore_http_requests"].samples
        if s.name == "kvstore_http_requests_total"
    }
    assert ("/v1/put", "200") in routes and ("/v1/get", "200") in routes


PREFAULTED = """\
data_dir = "{data_dir}"

[tiers.dram]
capacity = "32MiB"
prefault = true
"""


def test_stats_say_how_far_a_prefaulted_arena_is_populated(
    daemon_factory: Callable[..., Daemon], daemon: Daemon
) -> None:
    with daemon.client() as client:  # not asked for: not reported
        assert "dram_prefault" not in client.get("/v1/stats").json()["daemon"]
    with daemon_factory(PREFAULTED).client() as client:
        deadline = time.monotonic() + 30
        while not (progress := client.get("/v1/stats").json()["daemon"]["dram_prefault"])["done"]:
            assert time.monotonic() < deadline, progress
            time.sleep(0.05)
    # The segment: 32 MiB of blocks and a generation counter per page.
    assert progress["populated_bytes"] == (32 << 20) + 8 * ((32 << 20) // 4096)
    table = cli_stats.format_stats({"daemon": {"dram_prefault": progress}})
    assert "DRAM arena prefault: 32.1 MiB populated (done)" in table


def test_unknown_routes_and_methods_answer_json(client: httpx.Client) -> None:
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and error_code(missing) == "not_found"
    wrong_method = client.get("/v1/put")
    assert wrong_method.status_code == 405 and error_code(wrong_method) == "bad_request"


def test_cli_stats_prints_a_table(daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stats", "--url", daemon.url]) == 0
    out = capsys.readouterr().out
    assert "kvstore daemon" in out and "listening: unix://" in out
    header = next(line for line in out.splitlines() if line.startswith("tier"))
    assert header.split()[:4] == ["tier", "blocks", "used", "capacity"]
    assert any(line.startswith("dram") for line in out.splitlines())
    assert any(line.startswith("ssd") for line in out.splitlines())
    assert daemon.tcp_url is not None
    assert cli.main(["stats", "--url", daemon.tcp_url, "--token", str(daemon.token)]) == 0
    assert "kvstore daemon" in capsys.readouterr().out
    assert cli.main(["stats", "--url", daemon.tcp_url, "--token", "wrong"]) == 1
    assert "unauthorized" in capsys.readouterr().err


def _samples(client: httpx.Client, name: str) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").text
    return {
        next(iter(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


# -- streamed bytes gets ------------------------------------------------------------

# 1 MiB chunks, so a get's response outgrows the socket buffers and LMDB blocks
# span several of the daemon's read windows (8 MiB).
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", chunk_tokens=64)
BIG_DRAM = """\
data_dir = "{data_dir}"
promote_on_hit = false

[tiers.dram]
capacity = "8MiB"

[tiers.ssd]
capacity = "128MiB"
"""
BIG_DRAM_SLOTS = 7  # 1 MiB + a 128-byte header, rounded up to pages


def _big_chain(namespace: Namespace, n_chunks: int, start: int) -> http_kv.Chain:
    keys = chunk_keys(namespace, np.arange(start, start + n_chunks * 64, dtype=np.int64))
    rng = np.random.default_rng(start)
    blocks = [
        encode_block(
            namespace,
            key,
            keys[i - 1] if i else None,
            memoryview(rng.bytes(BIG_LAYOUT.chunk_nbytes)),
        ).to_bytes()
        for i, key in enumerate(keys)
    ]
    return http_kv.Chain(namespace, keys, blocks)


def test_a_get_streams_dram_and_lmdb_blocks_in_order(daemon_factory: Callable[..., Daemon]) -> None:
    instance = daemon_factory(BIG_DRAM, daemon={"max_body_bytes": 64 << 20})
    ns = Namespace("big", BIG_LAYOUT, tenant_salt="streamed-get")
    below = _big_chain(ns, 12, start=0)
    above = _big_chain(ns, BIG_DRAM_SLOTS, start=100_000)
    missing = _big_chain(ns, 1, start=900_000).keys
    with instance.client(timeout_s=30) as client:
        register(client, ns)
        put(client, below)
        put(client, above)  # takes all of DRAM: every block of ``below`` goes to LMDB
        assert lookup(client, ns, below.keys)["tiers"] == ["ssd"] * 12
        # Interleaved: DRAM, LMDB, a miss; LMDB blocks in two read windows.
        keys = [*below.keys[:6], *above.keys, *missing, *below.keys[6:]]
        meta, blocks = get_bytes(client, ns, keys)
    tiers = ["ssd"] * 6 + ["dram"] * BIG_DRAM_SLOTS + [None] + ["ssd"] * 6
    assert [entry["tier"] for entry in meta["blocks"]] == tiers
    assert blocks == [*below.blocks[:6], *above.blocks, None, *below.blocks[6:]]


def test_a_client_hanging_up_mid_get_leaves_no_pins(daemon_factory: Callable[..., Daemon]) -> None:
    instance = daemon_factory(BIG_DRAM, daemon={"max_body_bytes": 64 << 20})
    ns = Namespace("big", BIG_LAYOUT, tenant_salt="hang-up")
    # 12 MiB from LMDB in front of the pinned DRAM blocks: more than the 8 MiB a Unix
    # connection buffers while a get streams, so the daemon is still writing.
    below = _big_chain(ns, 12, start=50_000)
    first = _big_chain(ns, BIG_DRAM_SLOTS, start=0)
    with instance.client(timeout_s=30) as client:
        register(client, ns)
        put(client, below)
        put(client, first)  # every block of ``below`` goes to LMDB
        hung_up = _requests(client, "/v1/get", "499")
        keys = below.hex_keys + first.hex_keys
        request = json.dumps(
            {"namespace": ns.digest.hex(), "keys": keys, "transfer": "bytes"}
        ).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(instance.socket_path))
            raw.sendall(
                b"POST /v1/get HTTP/1.1\r\nHost: kvstore\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(request), request)
            )
            assert raw.recv(4096).startswith(b"HTTP/1.1 200")  # 19 MiB on their way
        deadline = time.monotonic() + 10
        while _requests(client, "/v1/get", "499") == hung_up:
            assert time.monotonic() < deadline, "the daemon never noticed the hang-up"
            time.sleep(0.05)
        # Were the blocks still pinned, this chain would have to go around them.
        put(client, _big_chain(ns, BIG_DRAM_SLOTS, start=100_000))
        assert lookup(client, ns, first.keys)["tiers"] == ["ssd"] * BIG_DRAM_SLOTS


def _requests(client: httpx.Client, route: str, status: str) -> float:
    """How many requests to ``route`` the daemon answered with ``status``."""
    text = client.get("/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvstore_http_requests_total"
        and sample.labels["route"] == route
        and sample.labels["status"] == status
    )

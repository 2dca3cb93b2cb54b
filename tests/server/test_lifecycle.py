"""The daemon over time, each on a private ``kvstore serve`` subprocess: a start that
listens before torch is imported, leases that expire and give their blocks back to
eviction, SIGTERM with a request in flight, SIGKILL in the middle of a put burst,
SIGHUP reloading the token and lease TTL, and readiness following a tier that goes
away and comes back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from support import http_kv
from support.daemon import Daemon
from support.http_kv import Chain, frames_body, get_bytes, lookup, make_chain, put, register

from kvstore.local.redis_server import RedisServer
from kvstore.wire.frames import FRAMES_CONTENT_TYPE

# 16 arena slots of 4 KiB: one test chunk (2 KiB + header) per slot.
SMALL_DRAM = """\
data_dir = "{data_dir}"

[tiers.dram]
capacity = "64KiB"

[tiers.ssd]
capacity = "64MiB"
"""
DRAM_SLOTS = 16

Factory = Callable[..., Daemon]


def _shm_get(client: httpx.Client, chain: Chain, extra: list[str] | None = None) -> Any:
    response = client.post(
        "/v1/get",
        json={
            "namespace": chain.namespace.digest.hex(),
            "keys": chain.hex_keys + (extra or []),
            "transfer": "shm",
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# The daemon's own start, in an interpreter of its own (pytest's has imported torch).
START_THEN_LOAD = """
import asyncio, sys
from kvstore.server.config import ServiceConfig
from kvstore.server.run import Server
from kvstore.server.state import PREDICTOR

async def main() -> None:
    server = Server(ServiceConfig.load(sys.argv[1]))
    await server.startup()
    print("torch imported:", "torch" in sys.modules)
    predictor = server.app[PREDICTOR]
    while predictor.model is None:
        await asyncio.sleep(0.01)
    print("model from", predictor.source, "torch imported:", "torch" in sys.modules)
    await server.shutdown()

asyncio.run(main())
"""


def test_the_daemon_listens_before_it_imports_torch(daemon_factory: Factory) -> None:
    """Importing torch takes most of a second, so a restart does not wait for it: the
    store opens and the sockets listen with no torch imported, and the predictor's
    model, a torch module, is loaded after."""
    instance = daemon_factory(start=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    argv = [sys.executable, "-c", START_THEN_LOAD, str(instance.config_path)]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"kvstore: listening on unix://{instance.socket_path}",
        "torch imported: False",
        "model from prior torch imported: True",
    ]


def test_an_unreleased_lease_expires_and_its_blocks_become_evictable(
    daemon_factory: Factory,
) -> None:
    instance = daemon_factory(SMALL_DRAM, daemon={"lease_ttl_s": 0.5})
    ns = http_kv.namespace_for("lease-expiry")
    leased = make_chain(ns, 4, start=0)
    with instance.client() as client:
        register(client, ns)
        put(client, leased)
        grant = _shm_get(client, leased)
        assert grant["expires_in_s"] == 0.5
        assert [entry["tier"] for entry in grant["blocks"]] == ["dram"] * 4
        # A chain that needs the whole arena: the leased blocks are pinned, so it
        # evicts around them and spills what does not fit to LMDB.
        put(client, make_chain(ns, DRAM_SLOTS, start=10_000))
        assert lookup(client, ns, leased.keys)["tiers"] == ["dram"] * 4
        # Never released: it expires on its own, and gives its pins back.
        _wait_for(lambda: client.get("/v1/stats").json()["daemon"]["leases_outstanding"] == 0)
        put(client, make_chain(ns, DRAM_SLOTS, start=20_000))
        assert lookup(client, ns, leased.keys)["tiers"] == ["ssd"] * 4  # written back
        late = client.post(f"/v1/leases/{grant['lease']}/release")
        assert late.status_code == 404 and http_kv.error_code(late) == "unknown_lease"
        # Blocks no longer in DRAM are offered inline; unknown keys are missing.
        unknown = make_chain(ns, 1, start=99_000_000).hex_keys
        again = _shm_get(client, leased, extra=unknown)
        assert again["blocks"] == [{"key": k, "inline": True} for k in leased.hex_keys] + [
            {"key": unknown[0], "missing": True}
        ]
        released = client.post(f"/v1/leases/{again['lease']}/release")
        assert released.json() == {"released": 0}
        _, blocks = get_bytes(client, ns, leased.keys)
        assert blocks == leased.blocks  # bit for bit, from LMDB


def test_sigterm_finishes_the_request_in_flight_then_exits_cleanly(
    daemon_factory: Factory,
) -> None:
    instance = daemon_factory()
    ns = http_kv.namespace_for("sigterm")
    chain = make_chain(ns, 8, seed=5)
    with instance.client() as client:
        register(client, ns)
    body = frames_body(ns, chain.keys, chain.blocks)
    head = (
        f"POST /v1/put HTTP/1.1\r\nHost: kvstore\r\nContent-Type: {FRAMES_CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    assert instance.proc is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(instance.socket_path))
        sock.sendall(head + body[: len(body) // 2])
        time.sleep(0.3)  # the handler is now reading the body
        instance.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: no longer accepting connections...
        with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX) as late:
            late.connect(str(instance.socket_path))
        # ...but the request in flight completes.
        sock.sendall(body[len(body) // 2 :])
        reply = b""
        while b'"stored"' not in reply:
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b'{"stored": 8}' in reply
    assert instance.proc.wait(timeout=20) == 0
    assert "flushed 8 block(s)" in instance.log()
    assert not instance.socket_path.exists()
    instance.start()
    with instance.client() as client:
        # A restart forgets namespaces (clients register again), not data.
        assert (
            client.post("/v1/lookup", json={"namespace": ns.digest.hex(), "keys": []}).json()[
                "error"
            ]["code"]
            == "unknown_namespace"
        )
        register(client, ns)
        assert lookup(client, ns, chain.keys)["tiers"] == ["ssd"] * 8
        _, blocks = get_bytes(client, ns, chain.keys)
        assert blocks == chain.blocks


def test_sigkill_during_a_put_burst_leaves_no_partial_block(daemon_factory: Factory) -> None:
    instance = daemon_factory(SMALL_DRAM)
    ns = http_kv.namespace_for("sigkill")
    with instance.client() as client:
        register(client, ns)
    sent: list[Chain] = []
    stop = threading.Event()

    def burst(worker: int) -> None:
        with instance.client(timeout_s=5) as client:
            for round_ in range(10_000):
                if stop.is_set():
                    return
                chain = make_chain(ns, 8, start=(worker * 10_000 + round_) * 1000, seed=round_)
                sent.append(chain)
                try:
                    put(client, chain)
                except (httpx.TransportError, AssertionError):
                    return

    threads = [threading.Thread(target=burst, args=(worker,)) for worker in range(2)]
    for thread in threads:
        thread.start()
    _wait_for(lambda: len(sent) >= 20)
    instance.kill()
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    assert instance.socket_path.exists()  # stale: a SIGKILLed daemon cannot clean up
    instance.start()  # removes the stale socket, reopens LMDB
    present = 0
    with instance.client() as client:
        assert client.get("/readyz").json() == {"ready": True, "degraded": []}
        register(client, ns)
        for chain in sent:
            _, blocks = get_bytes(client, ns, chain.keys)  # verifies every block it returns
            for block, expected in zip(blocks, chain.blocks, strict=True):
                assert block is None or block == expected
                present += block is not None
        stats = client.get("/v1/stats").json()["store"]["tiers"]
    assert present > 0  # written back to LMDB before the kill
    assert stats["ssd"]["corrupt_blocks"] == 0


def test_sighup_reloads_token_and_lease_ttl(daemon_factory: Factory) -> None:
    instance = daemon_factory(tcp=True, token="first-token-0123456789")
    ns = http_kv.namespace_for("sighup")
    with instance.tcp_client() as client:
        assert client.get("/v1/stats").status_code == 200
    instance.update_daemon_settings(auth_token="second-token-0123456789", lease_ttl_s=3.0)
    instance.reload()
    with instance.tcp_client(token="first-token-0123456789") as old:
        _wait_for(lambda: old.get("/v1/stats").status_code == 401)
    with instance.tcp_client(token="second-token-0123456789") as new:
        assert new.get("/v1/stats").status_code == 200
    with instance.client() as client:
        register(client, ns)
        chain = make_chain(ns, 1)
        put(client, chain)
        assert _shm_get(client, chain)["expires_in_s"] == 3.0
    assert "SIGHUP: reloaded" in instance.log()
    # A broken file is refused; the running config stays.
    instance.config_path.write_text("this is not toml [")
    instance.reload()
    _wait_for(lambda: "keeping the running config" in instance.log())
    with instance.tcp_client(token="second-token-0123456789") as new:
        assert new.get("/v1/stats").status_code == 200
    assert instance.proc is not None and instance.stop() == 0
    assert os.path.exists(instance.data_dir / "lmdb")


def test_readyz_reports_a_tier_that_cannot_be_reached(
    daemon_factory: Factory, redis_server_factory: Callable[..., RedisServer]
) -> None:
    server = redis_server_factory()
    config = SMALL_DRAM + (
        f'\n[tiers.redis]\nurl = "{server.url}"\ncapacity = "16MiB"\n'
        "socket_timeout_s = 0.5\nconnect_timeout_s = 0.5\n"
    )
    instance = daemon_factory(config)
    with instance.client() as client:
        assert client.get("/readyz").json() == {"ready": True, "degraded": []}
        server.stop()
        response = client.get("/readyz")
        assert response.status_code == 503
        assert response.json() == {"ready": False, "degraded": ["redis"]}
        assert client.get("/healthz").status_code == 200  # alive, only not ready
        server.start()
        assert client.get("/readyz").status_code == 200

"""A put's body read straight off the connection (kvstore/server/borrowed_body.py), against
a real daemon: the connection closes after every put and clients reconnect; a client
that hangs up or goes quiet mid-body, or a daemon stopped under a stalled put, leaves
nothing behind; an error found early is read by a client still sending; and unsealed
puts whose checksums travel after the payload, or are made by the daemon (Unix
socket only), are verified and stored as header-sealed ones."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
from support import http_kv
from support.daemon import Daemon
from support.http_kv import error_code, frames_body, lookup, make_chain, put_raw, register

import kvstore
from kvstore.block import HEADER_BYTES, TRAILER_BYTES, encode_block
from kvstore.client import StoreClient
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.wire.frames import FRAMES_CONTENT_TYPE, block_entries, encode_frames
from kvstore.wire.messages import namespace_to_json

CHECKSUM_AT = 88  # the checksum's offset in a block header
# 1 MiB chunks: a 48-block body is more than loopback TCP buffers (~36 MiB at most).
MIB_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", chunk_tokens=64)


def _dram_used(client: httpx.Client) -> int:
    return int(client.get("/v1/stats").json()["store"]["tiers"]["dram"]["used_bytes"])


def _start_put(path: Path, body: bytes, sent: int) -> socket.socket:
    """A connection that announced ``body`` whole and sent its first ``sent`` bytes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    head = (
        f"POST /v1/put HTTP/1.1\r\nHost: kvstore\r\nContent-Type: {FRAMES_CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:sent])
    return sock


def _daemon_and_chain(
    daemon_factory: Callable[..., Daemon], **settings: float
) -> tuple[Daemon, Namespace, http_kv.Chain]:
    """A daemon of its own with ``settings``, a registered namespace, a 3-chunk chain."""
    instance = daemon_factory(daemon=settings)
    ns = http_kv.namespace_for("own-daemon")
    with instance.client() as client:
        register(client, ns)
    return instance, ns, make_chain(ns, 3)


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_every_put_closes_its_connection_and_clients_reconnect(
    daemon: Daemon, client: httpx.Client, ns: Namespace
) -> None:
    chain = make_chain(ns, 4)
    response = put_raw(client, frames_body(ns, chain.keys, chain.blocks))
    assert response.status_code == 200 and response.json() == {"stored": 4}
    assert response.headers["connection"] == "close"
    assert client.get("/healthz").json() == {"ok": True}  # on a new connection
    store = kvstore.connect(daemon.url, timeout_s=10)
    assert isinstance(store, StoreClient)
    with store:
        for start in range(100, 600, 100):  # put after put, each on a fresh connection
            assert store.put(ns, http_kv.kv.tokens(2, start), http_kv.kv.chunks(2)) == 2
        assert store.client_stats().puts_dropped == 0


def test_a_client_hanging_up_mid_body_leaves_nothing(
    daemon: Daemon, client: httpx.Client, ns: Namespace
) -> None:
    chain = make_chain(ns, 3)
    body = frames_body(ns, chain.keys, chain.blocks)
    used = _dram_used(client)
    with _start_put(daemon.socket_path, body, len(body) - 100):  # closed: a hang-up
        pass
    time.sleep(0.2)
    _wait_until(lambda: _dram_used(client) == used, "the landed blocks were never given back")
    assert lookup(client, ns, chain.keys)["num_chunks"] == 0
    assert http_kv.put(client, chain) == 3  # the daemon is fine


def test_a_body_that_stops_arriving_is_dropped_after_body_timeout(
    daemon_factory: Callable[..., Daemon],
) -> None:
    instance, ns, chain = _daemon_and_chain(daemon_factory, body_timeout_s=0.5)
    body = frames_body(ns, chain.keys, chain.blocks)
    with instance.client() as client:
        used = _dram_used(client)
        with _start_put(instance.socket_path, body, len(body) // 2) as sock:
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 400") and b"no body bytes for 0.5 s" in reply
        assert b"Connection: close" in reply
        assert _dram_used(client) == used
        assert lookup(client, ns, chain.keys)["num_chunks"] == 0


def test_a_client_still_sending_reads_the_error_not_a_reset(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A corrupt first block of a 48 MiB body, over TCP: the answer reaches the client
    while it is still sending (the daemon drains the rest of the body before answering,
    as aiohttp's lingering close does), and nothing is kept."""
    instance = daemon_factory(daemon={"max_body_bytes": 64 << 20}, tcp=True)
    ns = Namespace("mib", MIB_LAYOUT, tenant_salt="early-error")
    keys = chunk_keys(ns, np.arange(48 * MIB_LAYOUT.chunk_tokens, dtype=np.int64))
    rng = np.random.default_rng(0)
    blocks = [
        encode_block(
            ns, key, keys[i - 1] if i else None, memoryview(rng.bytes(MIB_LAYOUT.chunk_nbytes))
        ).to_bytes()
        for i, key in enumerate(keys)
    ]
    blocks[0] = blocks[0][:-1] + bytes([blocks[0][-1] ^ 0x01])  # found at once
    with instance.tcp_client(timeout_s=30) as client:
        register(client, ns)
        used = _dram_used(client)
        response = put_raw(client, frames_body(ns, keys, blocks))
        assert response.status_code == 422 and error_code(response) == "corrupt_block"
        assert _dram_used(client) == used
        assert lookup(client, ns, keys)["num_chunks"] == 0


def test_sigterm_with_a_stalled_put_stops_within_the_drain_deadline(
    daemon_factory: Callable[..., Daemon],
) -> None:
    instance, ns, chain = _daemon_and_chain(daemon_factory, drain_timeout_s=1.0)
    body = frames_body(ns, chain.keys, chain.blocks)
    with _start_put(instance.socket_path, body, len(body) // 2):
        time.sleep(0.2)  # the put is waiting for the rest of its body
        started = time.monotonic()
        assert instance.stop() == 0
        assert time.monotonic() - started < 5.0


# -- where the checksum travels (kvstore.wire.Seal) ---------------------------------

SSD_ONLY = """\
data_dir = "{data_dir}"

[tiers.ssd]
capacity = "64MiB"
"""


def _sealed_body(
    seal: str,
    namespace: Namespace,
    chain: http_kv.Chain,
    keys: Sequence[ChunkKey] | None = None,
    flip_trailer: int | None = None,
) -> bytes:
    """``chain``'s blocks with zero checksums in their headers, under ``"seal": seal``,
    each followed by its checksum for ``"trailer"`` (block ``flip_trailer``'s with a
    bit flipped), named in the metadata by ``keys`` (``chain.keys`` unless given)."""
    pieces = []
    for i, (key, stored) in enumerate(zip(chain.keys, chain.blocks, strict=True)):
        payload = stored[HEADER_BYTES:]
        block = encode_block(
            namespace, key, chain.keys[i - 1] if i else None, memoryview(payload), sealed=False
        )
        trailer = stored[CHECKSUM_AT : CHECKSUM_AT + TRAILER_BYTES] if seal == "trailer" else b""
        if i == flip_trailer:
            trailer = bytes([trailer[0] ^ 1]) + trailer[1:]
        pieces.append(block.to_bytes() + trailer)
    named = chain.keys if keys is None else keys
    meta = {
        "namespace": namespace.digest.hex(),
        "session": None,
        "blocks": block_entries(named, chain.blocks),
        "seal": seal,
    }
    return b"".join(bytes(piece) for piece in encode_frames(meta, pieces))


def test_a_registration_lists_the_seals_of_its_connection(daemon: Daemon) -> None:
    ns = http_kv.namespace_for("offered-seals")
    with daemon.client() as client:
        answer = client.post("/v1/namespaces", json=namespace_to_json(ns)).json()
        assert answer == {
            "namespace": ns.digest.hex(),
            "put_seals": ["header", "trailer", "daemon"],
        }
    with daemon.tcp_client() as client:
        answer = client.post("/v1/namespaces", json=namespace_to_json(ns)).json()
        assert answer == {"namespace": ns.digest.hex(), "put_seals": ["header", "trailer"]}


@pytest.mark.parametrize(("seal", "over"), [("daemon", "unix"), ("trailer", "tcp")])
@pytest.mark.parametrize("config", [None, SSD_ONLY], ids=["landed-in-dram", "no-dram"])
def test_blocks_sent_without_header_checksums_are_stored_with_them(
    daemon_factory: Callable[..., Daemon], config: str | None, seal: str, over: str
) -> None:
    """Landed in DRAM or (no DRAM tier) received into memory, each block is stored
    with the checksum a header-sealing client would have sent, and reads back
    verified."""
    instance = daemon_factory(config, tcp=True)
    ns = http_kv.namespace_for(f"sealed-by-{seal}")
    chain = make_chain(ns, 3)
    with instance.client() if over == "unix" else instance.tcp_client() as client:
        register(client, ns)
        response = put_raw(client, _sealed_body(seal, ns, chain))
        assert response.status_code == 200 and response.json() == {"stored": 3}
    with instance.tcp_client() as client:
        _, blocks = http_kv.get_bytes(client, ns, chain.keys)  # every checksum verified
    assert blocks == chain.blocks  # byte for byte what a header-sealing client sends


@pytest.mark.parametrize("config", [None, SSD_ONLY], ids=["landed-in-dram", "no-dram"])
def test_a_wrong_trailing_checksum_refuses_the_put(
    daemon_factory: Callable[..., Daemon], config: str | None
) -> None:
    instance = daemon_factory(config, tcp=True)
    ns = http_kv.namespace_for("bad-trailer")
    chain = make_chain(ns, 3)
    with instance.tcp_client() as client:
        register(client, ns)
        response = put_raw(client, _sealed_body("trailer", ns, chain, flip_trailer=1))
        assert response.status_code == 422 and error_code(response) == "corrupt_block"
        assert lookup(client, ns, chain.keys)["num_chunks"] == 0


def test_the_daemon_seals_only_on_the_unix_socket(daemon: Daemon) -> None:
    ns = http_kv.namespace_for("daemon-seal-tcp")
    chain = make_chain(ns, 2)
    with daemon.tcp_client() as client:
        register(client, ns)
        response = put_raw(client, _sealed_body("daemon", ns, chain))
        assert response.status_code == 400 and error_code(response) == "bad_request"
        assert "Unix socket" in response.json()["error"]["message"]
        assert lookup(client, ns, chain.keys)["num_chunks"] == 0


def test_a_block_sealed_by_the_daemon_is_checked_as_any_other(
    daemon: Daemon, client: httpx.Client, ns: Namespace
) -> None:
    """Sealing replaces only the checksum comparison: a block under another key is
    still refused, an unknown ``seal`` too, and neither stores anything."""
    chain = make_chain(ns, 2)
    response = put_raw(client, _sealed_body("daemon", ns, chain, keys=chain.keys[::-1]))
    assert response.status_code == 422 and error_code(response) == "corrupt_block"
    response = put_raw(client, _sealed_body("nobody", ns, chain))
    assert response.status_code == 400 and error_code(response) == "bad_request"
    assert lookup(client, ns, chain.keys)["num_chunks"] == 0

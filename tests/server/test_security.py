"""What the daemon refuses, and that refusing changes nothing: malformed and oversize
bodies, corrupt or foreign blocks, TCP without the right token, TCP without any
token configured, oversize headers; and no code-executing deserializer in the tree."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import REPO, http_kv, kv
from support.daemon import Daemon
from support.http_kv import Chain, error_code, frames_body, lookup, make_chain, put_raw, register

from kvstore import connect
from kvstore.block import HEADER_BYTES, frame_block, parse_header, stored_block
from kvstore.client import ClientStats
from kvstore.keys import Namespace
from kvstore.wire.frames import FRAMES_CONTENT_TYPE, block_entries, encode_frames

ROOT = REPO


# -- malformed bodies ------------------------------------------------------------------


def _flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    return data[:index] + bytes([data[index] ^ mask]) + data[index + 1 :]


def _other_layout(block: bytes) -> bytes:
    """The same key and namespace, a valid checksum, but another layout in the header."""
    header = parse_header(block)
    return frame_block(
        dataclasses.replace(header, num_layers=header.num_layers + 1), stored_block(block).payload
    ).to_bytes()


def _frames(meta: dict[str, Any], blocks: list[bytes]) -> bytes:
    return b"".join(bytes(piece) for piece in encode_frames(meta, blocks))


def _bodies(chain: Chain) -> dict[str, tuple[bytes, int, str]]:
    """Bad put bodies for ``chain`` (3 blocks; the first two good): (body, status, code)."""
    ns, keys, blocks = chain.namespace, chain.keys, chain.blocks
    good = frames_body(ns, keys, blocks)
    foreign = make_chain(http_kv.namespace_for("foreign"), 3).blocks
    meta_length = int.from_bytes(good[:4], "little")
    meta = {"namespace": ns.digest.hex(), "blocks": block_entries(keys, blocks)}
    return {
        "truncated": (good[:-100], 400, "malformed_body"),
        "metadata only": (good[: 4 + meta_length], 400, "malformed_body"),
        "length prefix past the body": (b"\xff\xff\x00\x00" + good[4:], 400, "malformed_body"),
        "meta not json": (b"\x05\x00\x00\x00{nope", 400, "malformed_body"),
        "meta without blocks": (b"\x02\x00\x00\x00{}", 400, "malformed_body"),
        "extra trailing bytes": (good + b"\x00", 400, "malformed_body"),
        "empty body": (b"", 400, "malformed_body"),
        "flipped checksum bit": (
            frames_body(ns, keys, [*blocks[:2], _flip(blocks[2], 90, 0x80)]),
            422,
            "corrupt_block",
        ),
        "flipped payload bit": (
            frames_body(ns, keys, [*blocks[:2], _flip(blocks[2], HEADER_BYTES + 5)]),
            422,
            "corrupt_block",
        ),
        "short block": (
            frames_body(ns, keys, [*blocks[:2], blocks[2][:-1]]),
            422,
            "corrupt_block",
        ),
        "block under the wrong key": (
            frames_body(ns, keys, [blocks[0], blocks[1], blocks[1]]),
            422,
            "corrupt_block",
        ),
        "block of another namespace": (
            frames_body(ns, keys, [*blocks[:2], foreign[2]]),
            422,
            "corrupt_block",
        ),
        "block of another layout": (
            frames_body(ns, keys, [*blocks[:2], _other_layout(blocks[2])]),
            422,
            "layout_mismatch",
        ),
        "block too large for a chunk": (
            frames_body(ns, keys, [*blocks[:2], blocks[2] + bytes(1 << 17)]),
            400,
            "malformed_body",
        ),
        "session not a string": (_frames({**meta, "session": 12345}, blocks), 400, "bad_request"),
        "namespace not hex": (_frames({**meta, "namespace": "xyz"}, blocks), 400, "bad_request"),
    }


def test_malformed_puts_are_refused_whole(client: httpx.Client, ns: Namespace) -> None:
    chain = make_chain(ns, 3, start=100)
    before = client.get("/v1/stats").json()["store"]["chunks_stored"]
    used = _dram_used(client)
    for name, (body, status, code) in _bodies(chain).items():
        response = put_raw(client, body)
        assert (response.status_code, error_code(response)) == (status, code), name
        # Nothing stored: not even the two good blocks in front of the bad one,
        # and the DRAM extents they landed in were given back.
        assert lookup(client, ns, chain.keys)["num_chunks"] == 0, name
        assert _dram_used(client) == used, name
    assert client.get("/v1/stats").json()["store"]["chunks_stored"] == before
    # The daemon is fine, and the good body is still accepted afterwards.
    assert http_kv.put(client, chain) == 3


def _dram_used(client: httpx.Client) -> int:
    return int(client.get("/v1/stats").json()["store"]["tiers"]["dram"]["used_bytes"])


def test_bad_json_requests(client: httpx.Client, ns: Namespace) -> None:
    keys = make_chain(ns, 1).hex_keys
    digest = ns.digest.hex()
    cases = [
        ("/v1/lookup", b"{not json"),
        ("/v1/lookup", b"[1, 2]"),
        ("/v1/lookup", b'{"namespace": "zz", "keys": []}'),
        ("/v1/lookup", b'{"namespace": "%s", "keys": "abc"}' % digest.encode()),
        ("/v1/lookup", b'{"namespace": "%s", "keys": ["00"]}' % digest.encode()),
        ("/v1/get", b'{"namespace": "%s", "keys": [], "transfer": "pigeon"}' % digest.encode()),
        ("/v1/namespaces", b'{"model": "", "layout": {}}'),
        ("/v1/lookup", b"\xff\xfe"),
    ]
    for route, body in cases:
        response = client.post(route, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and error_code(response) == "bad_request", body
    wrong_type = client.post("/v1/put", json={"namespace": digest, "keys": keys})
    assert wrong_type.status_code == 400 and error_code(wrong_type) == "bad_request"


_JSON_ROUTES = ("/v1/namespaces", "/v1/lookup", "/v1/get", "/v1/delete", "/v1/events")


def _unparseable_json(digest: str) -> dict[str, bytes]:
    """Bodies ``json.loads`` takes or chokes on that no message can hold."""
    depth = 100_000  # far past the interpreter's recursion limit, well under max_json_bytes
    return {
        "nested arrays": b"[" * depth + b"]" * depth,
        "nested objects": b'{"a":' * depth + b"1" + b"}" * depth,
        "float past a double": b'{"namespace": "%s", "keys": [], "x": 1e400}' % digest.encode(),
        "huge integer": b'{"namespace": "%s", "keys": [], "x": %s}'
        % (digest.encode(), b"9" * 4000),
        "integer past 2**53": b'{"namespace": "%s", "keys": [], "x": 9007199254740993}'
        % digest.encode(),
        "NaN": b'{"namespace": "%s", "keys": [], "x": NaN}' % digest.encode(),
        "-Infinity": b'{"namespace": "%s", "keys": [], "x": -Infinity}' % digest.encode(),
    }


def test_json_no_message_can_hold_is_400_on_every_route(
    client: httpx.Client, ns: Namespace
) -> None:
    chain = make_chain(ns, 2, start=300)
    assert http_kv.put(client, chain) == 2
    stats = client.get("/v1/stats").json()
    for name, body in _unparseable_json(ns.digest.hex()).items():
        for route in _JSON_ROUTES:
            response = client.post(
                route, content=body, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 400, (name, route, response.text)
            assert error_code(response) == "bad_request", (name, route)
            assert "body is not JSON" in response.json()["error"]["message"], (name, route)
        # The same in a put's metadata.
        meta = body.replace(b'"keys": []', b'"blocks": []')
        response = put_raw(client, len(meta).to_bytes(4, "little") + meta)
        assert response.status_code == 400 and error_code(response) == "malformed_body", name
    # Nothing changed: the chain is still there, nothing new stored, no event kept.
    assert lookup(client, ns, chain.keys)["num_chunks"] == 2
    after = client.get("/v1/stats").json()
    assert after["store"]["chunks_stored"] == stats["store"]["chunks_stored"]
    assert after["daemon"]["events_received"] == stats["daemon"]["events_received"]
    statuses = {
        sample.labels["status"]
        for family in text_string_to_metric_families(client.get("/metrics").text)
        if family.name == "kvstore_http_requests"
        for sample in family.samples
    }
    assert "500" not in statuses


# -- bounds ----------------------------------------------------------------------------


def test_oversize_bodies_and_batches_are_413(daemon: Daemon, client: httpx.Client) -> None:
    ns = http_kv.namespace_for("oversize")
    register(client, ns)
    limit = 64 << 20  # DEFAULT_DAEMON max_body_bytes
    # Declared by Content-Length: refused before a byte of the body is read.
    status, body = _raw_request(
        daemon.socket_path,
        f"POST /v1/put HTTP/1.1\r\nHost: kvstore\r\nContent-Type: {FRAMES_CONTENT_TYPE}\r\n"
        f"Content-Length: {limit + 1}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert status == 413 and b"request_too_large" in body
    # The metadata alone declares more than the limit, in blocks each small enough
    # for a chunk: refused before any block is read.
    chain = make_chain(ns, 2)
    largest = HEADER_BYTES + ns.layout.chunk_nbytes + (64 << 10)
    count = limit // largest + 1
    meta = json.dumps(
        {
            "namespace": ns.digest.hex(),
            "blocks": [{"key": chain.hex_keys[0], "length": largest}] * count,
        }
    ).encode()
    streamed = len(meta).to_bytes(4, "little") + meta
    response = client.post(
        "/v1/put", content=streamed, headers={"Content-Type": FRAMES_CONTENT_TYPE}
    )
    assert response.status_code == 413 and error_code(response) == "request_too_large"
    # Chunked, with no length: refused (the body is read straight off the socket).
    response = client.post(
        "/v1/put",
        content=iter([streamed[:1000], streamed[1000:]]),
        headers={"Content-Type": FRAMES_CONTENT_TYPE},
    )
    assert response.status_code == 411 and error_code(response) == "length_required"
    # Too many keys in one request (max_batch_chunks = 1024, max_lookup_chunks = 2048).
    for route, limit in (("/v1/lookup", 2048), ("/v1/get", 1024), ("/v1/delete", 1024)):
        for count, status in ((limit, 200), (limit + 1, 413)):
            keys = [bytes(16).hex()] * count
            response = client.post(route, json={"namespace": ns.digest.hex(), "keys": keys})
            assert response.status_code == status, (route, count, response.text)
    assert error_code(response) == "request_too_large"
    for count, status in ((2048, 200), (2049, 413)):  # raw keys: the same limit
        response = client.post(
            f"/v1/lookup?namespace={ns.digest.hex()}",
            content=bytes(16) * count,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert response.status_code == status, (count, response.text)
    assert error_code(response) == "request_too_large"
    too_many = frames_body(ns, [chain.keys[0]] * 1025, [None] * 1025)
    response = put_raw(client, too_many)
    assert response.status_code == 413 and error_code(response) == "request_too_large"
    # A JSON body over max_json_bytes (4 MiB).
    response = client.post("/v1/events", content=b"[" + b"0," * (3 << 20) + b"0]")
    assert response.status_code == 413 and error_code(response) == "request_too_large"
    assert client.get("/healthz").status_code == 200


def test_oversize_headers_are_refused(daemon: Daemon, client: httpx.Client) -> None:
    status, _ = _raw_request(
        daemon.socket_path,
        b"GET /healthz HTTP/1.1\r\nHost: kvstore\r\nX-Big: "
        + b"a" * 20_000
        + b"\r\nConnection: close\r\n\r\n",
    )
    assert status in (400, 431)
    assert client.get("/healthz").status_code == 200


def _raw_request(path: Path, request: bytes) -> tuple[int, bytes]:
    """Send raw bytes over the Unix socket; the status and body of the answer (read up
    to its Content-Length: an answer to a body it did not read may keep the
    connection open a while, to let the client finish sending)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(request)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        length = int(match.group(1)) if match else 0
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
    return int(head.split(b" ")[1]), body


# -- logging ---------------------------------------------------------------------------


def test_refused_requests_log_no_traceback(daemon_factory: Callable[..., Daemon]) -> None:
    """A client's mistakes are answered, not logged (a debug line at most): a client
    sending garbage in a loop cannot flood the daemon's log."""
    instance = daemon_factory()
    nested = b"[" * 50_000 + b"]" * 50_000
    huge_time = b'{"event": "request_started", "session": "s", "trigger": "user", '
    huge_time += b'"prompt_tokens": 1, "cached_tokens": 0, "time": %s}' % (b"9" * 400)
    requests = [
        _http(b"GET /healthz HTTP/1.1", b"X-Big: " + b"a" * 20_000),
        _http(b"GET /healthz HTTP/1.1", b"no colon here"),
        _http(b"GET /healthz HTTP/7.3"),
        _http(b"POST /v1/lookup HTTP/1.1", b"Content-Length: abc", body=b"{}"),
        _http(b"POST /v1/lookup HTTP/1.1", b"Transfer-Encoding: chunked", body=b"zz\r\n{}\r\n"),
        _http(b"POST /v1/lookup HTTP/1.1", b"Content-Length: %d" % len(nested), body=nested),
        _http(b"POST /v1/events HTTP/1.1", b"Content-Length: %d" % len(huge_time), body=huge_time),
        _http(b"POST /v1/lookup HTTP/1.1", b"Content-Length: 9", body=b"{not json"),
    ]
    logged_before = instance.log_path.stat().st_size
    for _ in range(5):
        for request in requests:
            _send_raw(instance.socket_path, request)
    with instance.client() as client:
        assert client.get("/healthz").status_code == 200
    logged = instance.log_path.read_bytes()[logged_before:].decode(errors="replace")
    assert "Traceback" not in logged and "Error handling request" not in logged, logged
    assert len(logged.splitlines()) <= len(requests), logged


@pytest.mark.parametrize("route", ["/v1/namespaces", "/v1/lookup", "/v1/events", "/v1/put"])
def test_a_body_whose_content_encoding_lies_is_a_400_and_no_traceback(
    daemon_factory: Callable[..., Daemon], route: str
) -> None:
    """``Content-Encoding: gzip`` on a body that is not gzip: aiohttp cannot decode it,
    which must be the client's 400, not a 500 with a traceback (found by the fuzzer)."""
    instance = daemon_factory()
    body = b'{"namespace": "00"}'
    request = _http(
        f"POST {route} HTTP/1.1".encode(),
        b"Content-Encoding: gzip",
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        body=body,
    )
    logged_before = instance.log_path.stat().st_size
    status, answer = _raw_request(instance.socket_path, request)
    assert 400 <= status < 500, answer
    with instance.client() as client:
        assert client.get("/healthz").status_code == 200
    logged = instance.log_path.read_bytes()[logged_before:].decode(errors="replace")
    assert "Traceback" not in logged, logged


def _http(line: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    """A request over a connection that closes after its answer."""
    head = [line, b"Host: kvstore", b"Connection: close", *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _send_raw(path: Path, request: bytes) -> bytes:
    """Send ``request`` and read until the daemon closes (or 5 s); whatever came back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        reply = b""
        try:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:  # reset, or a reply never ending: either is fine here
            pass
    return reply


# -- authentication --------------------------------------------------------------------

_ROUTES = [
    ("POST", "/v1/namespaces"),
    ("POST", "/v1/lookup"),
    ("POST", "/v1/put"),
    ("POST", "/v1/get"),
    ("POST", "/v1/leases/0123/release"),
    ("GET", "/v1/shm"),
    ("POST", "/v1/delete"),
    ("POST", "/v1/events"),
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
    ("GET", "/readyz"),
    ("GET", "/no/such/route"),
]


def test_tcp_needs_the_bearer_token(daemon: Daemon) -> None:
    assert daemon.token
    credentials: list[str | None] = [
        None,
        "wrong-token",
        daemon.token[:-1],
        daemon.token + "x",
        daemon.token.upper(),
    ]
    for token in credentials:
        with daemon.tcp_client(token=token) as client:
            for method, route in _ROUTES:
                response = client.request(method, route)
                assert response.status_code == 401, (token, route)
                assert error_code(response) == "unauthorized"
                assert response.headers["www-authenticate"].startswith("Bearer")
            assert client.get("/healthz").json() == {"ok": True}  # open to all
    with daemon.tcp_client(token=None) as client:
        basic = client.get("/v1/stats", headers={"Authorization": f"Basic {daemon.token}"})
        assert basic.status_code == 401
    with daemon.tcp_client() as client:
        for method, route in _ROUTES:
            assert client.request(method, route).status_code != 401, route
        assert client.get("/v1/stats").status_code == 200
        assert client.get("/readyz").status_code == 200
        # Shared memory is for the Unix socket only, token or not.
        assert error_code(client.get("/v1/shm")) == "bad_request"
        ns = http_kv.namespace_for("tcp-shm")
        register(client, ns)
        response = client.post(
            "/v1/get", json={"namespace": ns.digest.hex(), "keys": [], "transfer": "shm"}
        )
        assert response.status_code == 400 and error_code(response) == "bad_request"


def test_tcp_refuses_to_start_without_a_token(daemon_factory: Callable[..., Daemon]) -> None:
    instance = daemon_factory(tcp=True, token=None, start=False)
    result = _serve(instance)
    assert result.returncode == 2
    assert "refusing to listen on TCP without an auth token" in result.stderr
    assert not instance.socket_path.exists()


@pytest.mark.parametrize("busy", ["socket", "port"])
def test_a_second_daemon_on_a_live_socket_or_port_exits_before_opening_anything(
    daemon: Daemon, daemon_factory: Callable[..., Daemon], busy: str
) -> None:
    """It says so and exits 1 before it creates a directory, opens LMDB, maps a
    shared-memory arena or loads the predictor: its data directory holds only the
    config file the test wrote there."""
    settings: dict[str, Any] = {"socket_path": str(daemon.socket_path)}
    if busy == "port":
        assert daemon.tcp_port is not None
        settings = {"tcp_host": "127.0.0.1", "tcp_port": daemon.tcp_port, "auth_token": "t" * 32}
    instance = daemon_factory(daemon=settings, start=False)
    result = _serve(instance)
    assert result.returncode == 1, result.stderr
    expected = "another daemon is listening" if busy == "socket" else "another process is listening"
    assert expected in result.stderr
    assert "predictor:" not in result.stderr and "serving" not in result.stderr
    assert [path.name for path in instance.data_dir.iterdir()] == ["kvstore.toml"]
    with daemon.client() as client:  # the first one is untouched
        assert client.get("/healthz").status_code == 200


def _serve(instance: Daemon) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(instance.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- no code-executing deserializers ---------------------------------------------------

_BANNED = re.compile(
    r"^\s*(import|from)\s+(pickle|cPickle|_pickle|marshal|shelve|dill|cloudpickle)\b"
    # torch.load unpickles unless told weights_only=True (tensors and plain containers only).
    r"|\btorch\.load\((?![^)]*weights_only=True)|\bpickle\.loads?\(|allow_pickle\s*=\s*True"
    r"|yaml\.load\(",
    re.MULTILINE,
)


def test_no_pickle_anywhere() -> None:
    offenders = []
    for folder in ("kvstore", "tiers", "client", "predictor"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in _BANNED.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []


def test_a_full_namespace_table_forgets_the_least_recently_named(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Bounded, but never refused: the third namespace is registered and the one named
    least recently is forgotten; naming that one again says it is unknown."""
    instance = daemon_factory(daemon={"max_namespaces": 2})
    first, second, third = (http_kv.namespace_for(name) for name in ("first", "second", "third"))
    with instance.client() as client:
        register(client, first)
        register(client, second)
        register(client, first)  # known: named again, so second is now the oldest
        register(client, third)
        answer = client.post("/v1/lookup", json={"namespace": second.digest.hex(), "keys": []})
        assert (answer.status_code, error_code(answer)) == (404, "unknown_namespace")
        for known in (first, third):
            answer = client.post("/v1/lookup", json={"namespace": known.digest.hex(), "keys": []})
            assert answer.status_code == 200
        stats = client.get("/v1/stats").json()["store"]
        assert stats["namespaces_forgotten"] == 1


def test_clients_of_more_namespaces_than_the_table_holds_never_see_an_error(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Five engines' namespaces through a table of two: each client re-registers when its
    namespace was forgotten, and every lookup finds what it put."""
    instance = daemon_factory(daemon={"max_namespaces": 2})
    namespaces = [kv.namespace(salt=f"tenant-{n}") for n in range(5)]
    with connect(instance.url) as store:
        for rounds in range(3):
            for n, namespace in enumerate(namespaces):
                tokens = kv.tokens(2, start=1000 * n)
                if rounds == 0:
                    assert store.put(namespace, tokens, kv.chunks(2, seed=n)) == 2
                assert store.lookup(namespace, tokens).num_chunks == 2
        assert store.client_stats() == ClientStats()  # nothing degraded, nothing raised
    with instance.client() as client:
        assert client.get("/v1/stats").json()["store"]["namespaces_forgotten"] >= 10


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Headers promising 1,000 bytes, ten sent, then the connection reset (found by the
    fuzzer): the daemon has nobody to answer and nothing to log but a refusal line."""
    instance = daemon_factory()
    logged_before = instance.log_path.stat().st_size
    for route in (b"/v1/delete", b"/v1/lookup"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(instance.socket_path))
            sock.sendall(
                _http(b"POST " + route + b" HTTP/1.1", b"Content-Length: 1000", body=b'{"namespa')
            )
            time.sleep(0.2)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(0.5)
    with instance.client() as client:
        assert client.get("/healthz").status_code == 200
    logged = instance.log_path.read_bytes()[logged_before:].decode(errors="replace")
    assert "Traceback" not in logged, logged

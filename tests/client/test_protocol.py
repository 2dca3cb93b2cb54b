"""The client's logic without a daemon: the sans-IO operations driven by hand and
both shells over an httpx ``MockTransport`` (a transport swapped in, nothing
patched). Received-block handling is in ``test_client_blocks.py``."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from support import kv
from support.client_data import (
    BLOCKS,
    CHUNKS,
    KEYS,
    NS,
    TOKENS,
    expected,
    flip,
    frames,
    mapped_blocks,
    payload_of,
)
from support.clients import FLAVOURS, Face, opened

from kvstore import (
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    TierKind,
    TierUnavailable,
    chunk_keys,
)
from kvstore.block import HEADER_BYTES, encode_block
from kvstore.client import AsyncStoreClient, ClientStats, StoreClient, async_client, sync_client
from kvstore.client.address import TOKEN_ENV, Address, Scheme, bearer_token
from kvstore.client.exchange import Call, Reply
from kvstore.client.protocol import ClientOptions, ClientProtocol
from kvstore.client.put_body import BODY_SLICE_BYTES
from kvstore.client.shm import SharedArena
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, KVLayout, Namespace
from kvstore.store.chunk import chunk_bytes
from kvstore.wire.codes import ErrorCode, error_body
from kvstore.wire.frames import encode_frames

# -- addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "scheme", "base_url", "path"),
    [
        (
            "unix:///run/kvstore/kvstore.sock",
            Scheme.UNIX,
            "http://kvstore",
            "/run/kvstore/kvstore.sock",
        ),
        ("http://127.0.0.1:8470", Scheme.HTTP, "http://127.0.0.1:8470", None),
        ("embedded://", Scheme.EMBEDDED, "embedded://", None),
        (
            "embedded:///etc/kvstore.toml",
            Scheme.EMBEDDED,
            "embedded:///etc/kvstore.toml",
            "/etc/kvstore.toml",
        ),
    ],
)
def test_address_forms(url: str, scheme: Scheme, base_url: str, path: str | None) -> None:
    assert Address.parse(url) == Address(scheme, base_url, path)


@pytest.mark.parametrize(
    "url", ["redis://localhost", "unix://relative.sock", "http://host:1/prefix", "embedded://x"]
)
def test_address_rejects(url: str) -> None:
    with pytest.raises(ConfigError):
        Address.parse(url)


def test_token_from_the_environment_over_tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert bearer_token(Address.parse("http://127.0.0.1:1"), None) == "from-env"
    assert bearer_token(Address.parse("http://127.0.0.1:1"), "given") == "given"
    assert bearer_token(Address.parse("unix:///tmp/x.sock"), "given") is None


# -- operations, driven by hand ---------------------------------------------------------


def ok(body: Any) -> Reply:
    return Reply(200, json.dumps(body).encode())


def error(status: int, code: ErrorCode) -> Reply:
    return Reply(status, json.dumps(error_body(code, "from the test")).encode())


def test_lookup_registers_once_then_asks_with_keys() -> None:
    protocol = ClientProtocol(shm=False, backoff_s=0.0)
    operation = protocol.lookup(NS, TOKENS)
    call = next(operation)
    assert (call.method, call.path) == ("POST", "/v1/namespaces")
    assert call.json["layout"]["chunk_tokens"] == kv.LAYOUT.chunk_tokens
    call = operation.send(ok({"namespace": NS.digest.hex()}))
    assert call == Call(
        "POST", f"/v1/lookup?namespace={NS.digest.hex()}", content=b"".join(KEYS)
    )
    assert call.headers == {"Content-Type": "application/octet-stream"}
    with pytest.raises(StopIteration) as done:
        operation.send(
            ok(
                {
                    "num_chunks": 2,
                    "chunk_tokens": 16,
                    "total_chunks": 3,
                    "tier_runs": [["dram", 1], ["ssd", 1]],
                }
            )
        )
    prefix = done.value.value
    assert prefix.keys == tuple(KEYS[:2]) and prefix.tiers == (TierKind.DRAM, TierKind.SSD)
    assert prefix.num_tokens == 2 * kv.LAYOUT.chunk_tokens and prefix.total_chunks == 3
    # Registered now: the next operation asks straight away.
    assert next(protocol.lookup(NS, TOKENS)).path.startswith("/v1/lookup?")


def test_unknown_namespace_registers_again_and_retries_once() -> None:
    protocol = ClientProtocol(shm=False, backoff_s=0.0)
    operation = protocol.delete(NS, KEYS)
    assert next(operation).path == "/v1/namespaces"
    assert operation.send(ok({"namespace": NS.digest.hex()})).path == "/v1/delete"
    assert operation.send(error(404, ErrorCode.UNKNOWN_NAMESPACE)).path == "/v1/namespaces"
    assert operation.send(ok({"namespace": NS.digest.hex()})).path == "/v1/delete"
    with pytest.raises(StopIteration) as done:
        operation.send(ok({"deleted": 3}))
    assert done.value.value == 3


def test_a_daemon_hashing_namespaces_differently_is_refused() -> None:
    operation = ClientProtocol(shm=False, backoff_s=0.0).lookup(NS, TOKENS)
    next(operation)
    with pytest.raises(KVStoreError, match="different kvstore versions"):
        operation.send(ok({"namespace": "00" * 16}))


def test_caller_mistakes_raise_before_any_exchange() -> None:
    protocol = ClientProtocol(shm=False, backoff_s=0.0)
    wrong_dtype = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float32)]
    with pytest.raises(LayoutMismatch):
        next(protocol.put(NS, TOKENS, wrong_dtype))
    with pytest.raises(LayoutMismatch):
        next(protocol.put(NS, TOKENS, kv.chunks(4)))  # more chunks than keys
    with pytest.raises(LayoutMismatch):
        next(protocol.get(NS, KEYS, out=[bytearray(10)] * 3))
    with pytest.raises(LayoutMismatch):
        next(protocol.get(NS, KEYS, out=[bytearray(kv.LAYOUT.chunk_nbytes)]))


def test_a_put_body_goes_out_in_slices_of_the_callers_buffers() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, chunk_tokens=160)
    assert layout.chunk_nbytes > 2 * BODY_SLICE_BYTES
    namespace = Namespace("big", layout)
    tokens = np.arange(2 * layout.chunk_tokens)
    chunks = [torch.randn(layout.chunk_shape).to(torch.bfloat16) for _ in range(2)]
    operation = ClientProtocol(shm=False, backoff_s=0.0).put(namespace, tokens, chunks)
    next(operation)  # registers the namespace
    call = operation.send(ok({"namespace": namespace.digest.hex()}))
    assert call.path == "/v1/put" and call.body is not None
    assert all(memoryview(piece).nbytes <= BODY_SLICE_BYTES for piece in call.body)
    assert int(call.headers["Content-Length"]) == sum(len(piece) for piece in call.body)
    keys = chunk_keys(namespace, tokens)
    stored = [
        encode_block(namespace, key, parent, chunk_bytes(chunk, layout)).to_bytes()
        for key, parent, chunk in zip(keys, [None, keys[0]], chunks, strict=True)
    ]
    meta = {
        "namespace": namespace.digest.hex(),
        "session": None,
        "blocks": [{"key": k.hex(), "length": len(b)} for k, b in zip(keys, stored, strict=True)],
    }
    assert b"".join(call.body) == b"".join(bytes(p) for p in encode_frames(meta, stored))
    payload = chunks[1].view(torch.uint8).reshape(-1).numpy()
    assert any(np.shares_memory(np.frombuffer(piece, np.uint8), payload) for piece in call.body)


# -- both shells over a mock transport -----------------------------------------------


class FakeDaemon:
    """Answers the API from a dict of blocks; ``script`` overrides the next answers.

    Shared-memory gets lease the blocks of ``arena`` (a segment name) at the
    offsets in ``leased``; ``hold`` runs before a release is answered, and
    ``released`` lists the releases answered.
    """

    def __init__(self) -> None:
        self.blocks: dict[str, bytes] = {}
        self.paths: list[str] = []
        self.script: list[httpx.Response | Exception] = []
        self.arena: str | None = None
        self.leased: dict[str, tuple[int, int]] = {}
        self.hold: Callable[[], object] = lambda: None
        self.released: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.script:
            outcome = self.script.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        route = request.url.path.removeprefix("/v1/")
        if route == "namespaces":
            return httpx.Response(200, json={"namespace": NS.digest.hex()})
        if route == "events":
            return httpx.Response(200, json={"accepted": True})
        if route == "shm":
            return httpx.Response(200, json={"name": self.arena})
        if route.startswith("leases/"):
            self.hold()
            self.released.append(route.split("/")[1])
            return httpx.Response(200, json={"released": 1})
        if route == "lookup":  # raw keys
            keys = [request.content[i : i + 16].hex() for i in range(0, len(request.content), 16)]
            run = next((i for i, key in enumerate(keys) if key not in self.blocks), len(keys))
            return httpx.Response(200, json={"num_chunks": run, "tier_runs": [["dram", run]]})
        body = json.loads(request.content)
        if route == "get" and body["transfer"] == "shm":
            entries = [
                {"key": key, "offset": self.leased[key][0], "length": self.leased[key][1]}
                | {"tier": "dram"}
                for key in body["keys"]
            ]
            lease = f"lease{len(self.paths)}"
            return httpx.Response(200, json={"lease": lease, "shm": self.arena, "blocks": entries})
        if route == "get":
            keys = [ChunkKey(bytes.fromhex(key)) for key in body["keys"]]
            return httpx.Response(
                200, content=frames([self.blocks.get(k) for k in body["keys"]], keys)
            )
        raise AssertionError(f"unexpected {request.url.path}")


def mock_client(
    flavour: str, daemon: FakeDaemon, backoff_s: float = 0.0, shm: bool = False
) -> Face:
    transport = httpx.MockTransport(daemon)
    client_type = StoreClient if flavour == "sync" else AsyncStoreClient
    options = ClientOptions(backoff_s=backoff_s, shm=shm)
    return Face(client_type("http://kvstore", transport=transport, options=options))


def scenario(
    flavour: str,
    body: Callable[[Face, FakeDaemon], Any],
    backoff_s: float = 0.0,
    shm: bool = False,
) -> None:
    daemon = FakeDaemon()

    async def run() -> None:
        client = mock_client(flavour, daemon, backoff_s, shm)
        try:
            await body(client, daemon)
        finally:
            await client.close()

    asyncio.run(run())


def failing(status: int, code: ErrorCode) -> httpx.Response:
    return httpx.Response(status, json=error_body(code, "from the test"))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_block_tampered_in_transit_is_never_returned(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        daemon.blocks = {KEYS[0].hex(): BLOCKS[0], KEYS[1].hex(): flip(BLOCKS[1], 100)}
        chunks = await client.get(NS, KEYS)
        assert chunks[0] is not None and payload_of(chunks[0]) == expected(0)
        assert chunks[1] is None and chunks[2] is None
        assert (await client.client_stats()).corrupt_blocks == 1

    scenario(flavour, body)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_failing_daemon_degrades_where_the_engine_must_not_stall(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        await client.lookup(NS, KEYS)  # registered
        daemon.script = [failing(500, ErrorCode.INTERNAL)]
        assert (await client.lookup(NS, KEYS)).num_tokens == 0
        daemon.script = [httpx.Response(200, content=b"not json")]
        assert await client.put(NS, TOKENS, CHUNKS) == 0
        daemon.script = [failing(503, ErrorCode.UNAVAILABLE)]
        assert await client.get(NS, KEYS) == [None] * 3
        daemon.script = [httpx.ReadTimeout("too slow")]
        await client.request_started("s", prompt_tokens=10, cached_tokens=0)
        stats = await client.client_stats()
        assert (stats.lookups_failed, stats.puts_dropped, stats.gets_failed) == (1, 1, 1)
        assert stats.events_dropped == 1
        # Facts the client cannot make up raise instead.
        daemon.script = [failing(503, ErrorCode.UNAVAILABLE)]
        with pytest.raises(TierUnavailable):
            await client.delete(NS, KEYS)
        daemon.script = [httpx.ConnectError("refused")]
        with pytest.raises(TierUnavailable):
            await client.stats()

    scenario(flavour, body)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_after_a_failure_the_daemon_is_left_alone_for_the_backoff(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        daemon.script = [httpx.ConnectError("refused")]
        assert (await client.lookup(NS, KEYS)).num_tokens == 0
        assert await client.get(NS, KEYS) == [None] * 3
        assert await client.put(NS, TOKENS, CHUNKS) == 0
        with pytest.raises(TierUnavailable, match="back-off"):
            await client.delete(NS, KEYS)
        assert daemon.paths == ["/v1/namespaces"]  # one try, then none until the back-off ends

    scenario(flavour, body, backoff_s=60.0)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(
    ("status", "code", "raised"),
    [
        (401, ErrorCode.UNAUTHORIZED, KVStoreError),
        (422, ErrorCode.LAYOUT_MISMATCH, LayoutMismatch),
        (413, ErrorCode.REQUEST_TOO_LARGE, RequestTooLarge),
    ],
)
def test_a_wrong_request_raises(flavour: str, status: int, code: ErrorCode, raised: type) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        await client.lookup(NS, KEYS)  # registered
        daemon.script = [failing(status, code)]
        with pytest.raises(raised, match=code.value):
            await client.put(NS, TOKENS, CHUNKS)
        assert await client.client_stats() == ClientStats()

    scenario(flavour, body)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_connection_dead_before_answering_is_retried_once(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        daemon.blocks = {KEYS[0].hex(): BLOCKS[0]}
        daemon.script = [httpx.RemoteProtocolError("Server disconnected")]
        assert (await client.lookup(NS, KEYS)).num_chunks == 1
        assert daemon.paths == ["/v1/namespaces", "/v1/namespaces", "/v1/lookup"]
        # Events are not idempotent: not sent twice, dropped instead.
        daemon.script = [httpx.RemoteProtocolError("Server disconnected")]
        await client.request_finished(
            "s", steps=1, output_tokens=1, context_tokens=2, loaded_tokens=1, recomputed_tokens=1
        )
        assert (await client.client_stats()).events_dropped == 1

    scenario(flavour, body)


@pytest.fixture
def arena() -> Iterator[SharedArena]:
    with mapped_blocks() as mapped:
        yield mapped


@pytest.fixture
def leased_daemon(arena: SharedArena) -> Callable[[FakeDaemon], None]:
    """Sets a ``FakeDaemon`` up to lease blocks 0 and 2 of the ``arena`` fixture."""

    def setup(daemon: FakeDaemon) -> None:
        daemon.arena = arena.name
        daemon.leased = {KEYS[i].hex(): (i * 8192, len(BLOCKS[i])) for i in (0, 2)}

    return setup


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_get_does_not_wait_for_its_lease_release_but_close_does(
    flavour: str, leased_daemon: Callable[[FakeDaemon], None]
) -> None:
    held = threading.Event()
    seen: list[FakeDaemon] = []

    async def body(client: Face, daemon: FakeDaemon) -> None:
        seen.append(daemon)
        leased_daemon(daemon)
        if flavour == "sync":  # sent by another thread: hold its answer there
            daemon.hold = lambda: held.wait(10.0)
        got = await client.get(NS, [KEYS[0], KEYS[2]])
        assert [payload_of(chunk) for chunk in got] == [expected(0), expected(2)]
        assert daemon.released == []  # the get returned before its release was answered
        held.set()
        await client.get(NS, [KEYS[2]])

    scenario(flavour, body, shm=True)
    assert len(seen[0].released) == 2  # answered by close() at the latest


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_past_the_background_limit_a_release_is_sent_in_place(
    flavour: str, leased_daemon: Callable[[FakeDaemon], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync_client, "MAX_DETACHED_CALLS", 0)
    monkeypatch.setattr(async_client, "MAX_DETACHED_CALLS", 0)

    async def body(client: Face, daemon: FakeDaemon) -> None:
        leased_daemon(daemon)
        got = await client.get(NS, [KEYS[0]])
        assert got[0] is not None and payload_of(got[0]) == expected(0)
        assert len(daemon.released) == 1

    scenario(flavour, body, shm=True)


def test_the_token_is_sent_as_a_bearer_header() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"accepted": True})

    with StoreClient(
        "http://kvstore", transport=httpx.MockTransport(handler), options=ClientOptions(token="t0k")
    ) as client:
        client.request_started("s", prompt_tokens=1, cached_tokens=0)
    assert seen == ["Bearer t0k"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_no_daemon_at_all_is_a_degraded_answer_and_leaks_no_socket(
    flavour: str, tmp_path: Path
) -> None:
    """The blocking Unix transport closes the socket of a refused connect (httpcore's
    own leaves it to the garbage collector: a ResourceWarning, an error here)."""

    async def run() -> None:
        async with opened(flavour, f"unix://{tmp_path}/absent.sock", backoff_s=0.0) as store:
            for _ in range(3):
                assert (await store.lookup(NS, TOKENS)).num_tokens == 0
            assert (await store.client_stats()).lookups_failed == 3

    asyncio.run(run())


def test_a_put_body_skips_absent_chunks_and_is_the_same_when_sent_again() -> None:
    chunks = kv.chunks(3)
    operation = ClientProtocol(shm=False, backoff_s=0.0).put(NS, TOKENS, [None, *chunks[1:]])
    next(operation)  # registers the namespace
    call = operation.send(ok({"namespace": NS.digest.hex()}))
    assert call.body is not None
    cut_off = iter(call.body)  # a send that failed after the first block's header
    for _ in range(3):
        next(cut_off)
    first = b"".join(call.body)
    assert b"".join(call.body) == first  # sent again (a retry): the same bytes
    stored = [
        encode_block(NS, KEYS[i], KEYS[i - 1], chunk_bytes(chunks[i], kv.LAYOUT)).to_bytes()
        for i in (1, 2)
    ]
    meta = {
        "namespace": NS.digest.hex(),
        "session": None,
        "blocks": [
            {"key": KEYS[0].hex(), "length": None},
            *({"key": KEYS[i].hex(), "length": len(stored[i - 1])} for i in (1, 2)),
        ],
    }
    assert first == b"".join(bytes(p) for p in encode_frames(meta, stored))
    assert int(call.headers["Content-Length"]) == len(first)


@pytest.mark.parametrize(
    ("offered", "seal"),
    [
        (["header", "trailer", "daemon"], "daemon"),  # the Unix socket
        (["header", "trailer"], "trailer"),  # TCP
        (None, "header"),  # an older daemon offers nothing
    ],
)
def test_puts_seal_the_cheapest_way_the_daemon_offers(offered: list[str] | None, seal: str) -> None:
    """A registration answer lists how the daemon takes puts on that connection
    (``put_seals``); the client's put bodies then follow the cheapest."""
    chunks = kv.chunks(2)
    operation = ClientProtocol(shm=False, backoff_s=0.0).put(NS, TOKENS, chunks)
    next(operation)  # registers the namespace
    answer = {"namespace": NS.digest.hex(), **({"put_seals": offered} if offered else {})}
    call = operation.send(ok(answer))
    assert call.body is not None
    pieces: list[bytes] = []
    for i in (0, 1):
        data = chunk_bytes(chunks[i], kv.LAYOUT)
        sealed = encode_block(NS, KEYS[i], KEYS[i - 1] if i else None, data)
        if seal == "header":
            pieces.append(sealed.to_bytes())
            continue
        unsealed = encode_block(NS, KEYS[i], KEYS[i - 1] if i else None, data, sealed=False)
        trailer = sealed.header[88:96] if seal == "trailer" else b""
        pieces.append(unsealed.to_bytes() + trailer)
    meta: dict[str, Any] = {
        "namespace": NS.digest.hex(),
        "session": None,
        "blocks": [
            {"key": KEYS[i].hex(), "length": HEADER_BYTES + kv.LAYOUT.chunk_nbytes} for i in (0, 1)
        ],
    }
    if seal != "header":
        meta["seal"] = seal
    body = b"".join(bytes(piece) for piece in call.body)
    assert body == b"".join(bytes(p) for p in encode_frames(meta, pieces))
    assert int(call.headers["Content-Length"]) == len(body)

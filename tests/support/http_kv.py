"""Raw-HTTP helpers for daemon tests: blocks as a client builds them, and the calls
of docs/http_api.md made with httpx and ``kvstore.wire``, nothing else.

Deliberately not ``kvstore.client``: these tests pin the wire contract itself,
so they speak it by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvstore.block import check_identity, encode_block, stored_block, verify_block
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.store.chunk import chunk_bytes
from kvstore.wire.frames import FRAMES_CONTENT_TYPE, FrameDecoder, block_entries, encode_frames
from kvstore.wire.messages import namespace_to_json
from support import kv
from support.daemon import Daemon


@dataclass
class Chain:
    """A chain of chunks as a client would put it: keys and complete blocks."""

    namespace: Namespace
    keys: list[ChunkKey]
    blocks: list[bytes]

    @property
    def hex_keys(self) -> list[str]:
        return [key.hex() for key in self.keys]


def make_chain(namespace: Namespace, n_chunks: int, *, start: int = 0, seed: int = 0) -> Chain:
    keys = chunk_keys(namespace, kv.tokens(n_chunks, start))
    blocks = [
        encode_block(
            namespace, key, keys[i - 1] if i else None, chunk_bytes(data, namespace.layout)
        ).to_bytes()
        for i, (key, data) in enumerate(zip(keys, kv.chunks(n_chunks, seed), strict=True))
    ]
    return Chain(namespace, keys, blocks)


def register(client: httpx.Client, namespace: Namespace) -> None:
    response = client.post("/v1/namespaces", json=namespace_to_json(namespace))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["namespace"] == namespace.digest.hex()
    assert set(answer) <= {"namespace", "put_seals"}


def frames_body(
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    blocks: Sequence[bytes | None],
    session: str | None = None,
) -> bytes:
    meta = {
        "namespace": namespace.digest.hex(),
        "session": session,
        "blocks": block_entries(keys, blocks),
    }
    present = [block for block in blocks if block is not None]
    return b"".join(bytes(piece) for piece in encode_frames(meta, present))


def put_raw(client: httpx.Client, body: bytes) -> httpx.Response:
    return client.post("/v1/put", content=body, headers={"Content-Type": FRAMES_CONTENT_TYPE})


def put(
    client: httpx.Client,
    chain: Chain,
    blocks: Sequence[bytes | None] | None = None,
    session: str | None = None,
) -> int:
    body = frames_body(
        chain.namespace, chain.keys, chain.blocks if blocks is None else blocks, session
    )
    response = put_raw(client, body)
    assert response.status_code == 200, response.text
    stored = response.json()["stored"]
    assert isinstance(stored, int)
    return stored


def lookup(client: httpx.Client, namespace: Namespace, keys: Sequence[ChunkKey]) -> Any:
    response = client.post(
        "/v1/lookup", json={"namespace": namespace.digest.hex(), "keys": [k.hex() for k in keys]}
    )
    assert response.status_code == 200, response.text
    return response.json()


def get_bytes(
    client: httpx.Client, namespace: Namespace, keys: Sequence[ChunkKey]
) -> tuple[dict[str, Any], list[bytes | None]]:
    """A bytes get, decoded with the shared ``FrameDecoder``; every block verified."""
    response = client.post(
        "/v1/get",
        json={
            "namespace": namespace.digest.hex(),
            "keys": [k.hex() for k in keys],
            "transfer": "bytes",
        },
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == FRAMES_CONTENT_TYPE
    decoder = FrameDecoder()
    received = []
    for piece in response.iter_bytes():
        received += decoder.feed(piece)
    decoder.finish()
    assert decoder.meta is not None
    blocks: list[bytes | None] = [None] * len(keys)
    for item in received:
        assert item.key == keys[item.index]
        if item.data is not None:
            check_identity(verify_block(item.data), namespace, item.key)
            blocks[item.index] = item.data
    return decoder.meta, blocks


def payloads(blocks: Sequence[bytes | None]) -> list[bytes | None]:
    """The KV bytes of each block (headers differ in the parent field only)."""
    return [None if block is None else bytes(stored_block(block).payload) for block in blocks]


def error_code(response: httpx.Response) -> str:
    body = json.loads(response.content)
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    code = body["error"]["code"]
    assert isinstance(code, str)
    return code


def namespace_for(test_name: str) -> Namespace:
    """A namespace no other test uses (the session daemon is shared)."""
    return kv.namespace(salt=test_name)


# -- fixtures of the route tests (imported by the test modules that use them) ----------


@pytest.fixture
def client(daemon: Daemon) -> Iterator[httpx.Client]:
    """An HTTP client on the session daemon's Unix socket."""
    with daemon.client() as client:
        yield client


@pytest.fixture
def ns(request: pytest.FixtureRequest, client: httpx.Client) -> Namespace:
    """A namespace of the test's own (named after it), registered with the daemon."""
    namespace = namespace_for(request.node.name)
    register(client, namespace)
    return namespace

"""The fields of control messages both ends read and write: the routes' prefix,
namespaces, digests and chunk keys (hex in JSON, checked on the way in), and a
lookup's keys as raw bytes.

A lookup may carry a whole long context in an engine's small blocks (7,438 keys
for a 119K-token prompt in 16-token blocks). As JSON that is 268 KB of hex the
engine's scheduler encodes and the daemon parses, key by key, on the path of
every new request; as raw bytes (``KEYS_CONTENT_TYPE``, 16 bytes a key) it is
one join and one slicing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from kvstore.errors import (
    ConfigError,
)
from kvstore.keys import KEY_BYTES, ChunkKey, HashAlgo, KVLayout, Namespace
from kvstore.wire.codes import ErrorCode, WireError

API_PREFIX = "/v1"
KEYS_CONTENT_TYPE = "application/octet-stream"
"""A lookup's body as raw keys, ``KEY_BYTES`` each, its namespace in the query."""


class GetTransfer(enum.Enum):
    """How a get's blocks travel (its body's ``"transfer"``): ``BYTES`` in the response
    body, as frames; ``SHM`` described by offset in the daemon's shared-memory arena,
    under a lease (Unix socket only)."""

    BYTES = "bytes"
    SHM = "shm"


def namespace_to_json(namespace: Namespace) -> dict[str, Any]:
    layout = namespace.layout
    return {
        "model": namespace.model,
        "layout": {
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype,
            "chunk_tokens": layout.chunk_tokens,
            "name": layout.name,
            "page_tokens": layout.page_tokens,
        },
        "tenant_salt": namespace.tenant_salt,
        "hash_algo": namespace.hash_algo.value,
    }


def namespace_from_json(data: Any) -> Namespace:
    """Parse and validate a namespace; any problem is a ``bad_request``."""
    try:
        layout_data = data["layout"]
        layout = KVLayout(
            num_layers=_int(layout_data["num_layers"]),
            num_kv_heads=_int(layout_data["num_kv_heads"]),
            head_dim=_int(layout_data["head_dim"]),
            dtype=str(layout_data["dtype"]),
            chunk_tokens=_int(layout_data["chunk_tokens"]),
            name=str(layout_data.get("name", "LKTHD")),
            page_tokens=(
                None if layout_data.get("page_tokens") is None else _int(layout_data["page_tokens"])
            ),
        )
        salt = data.get("tenant_salt")
        if salt is not None and not isinstance(salt, str):
            raise TypeError("tenant_salt must be a string")
        model = data["model"]
        if not isinstance(model, str) or not model:
            raise TypeError("model must be a non-empty string")
        return Namespace(model, layout, tenant_salt=salt, hash_algo=HashAlgo(data["hash_algo"]))
    except (KeyError, TypeError, ValueError, ConfigError) as error:
        raise WireError(ErrorCode.BAD_REQUEST, f"invalid namespace: {error}") from None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def digest_from_hex(text: Any) -> bytes:
    return hex_bytes(text, "namespace")


def keys_to_json(keys: Sequence[ChunkKey]) -> list[str]:
    return [key.hex() for key in keys]


def keys_from_json(data: Any, limit: int) -> list[ChunkKey]:
    if not isinstance(data, list):
        raise WireError(ErrorCode.BAD_REQUEST, "keys must be a list of hex strings")
    if len(data) > limit:
        raise WireError(ErrorCode.REQUEST_TOO_LARGE, f"{len(data)} keys; the limit is {limit}")
    return [ChunkKey(hex_bytes(item, "key")) for item in data]


def keys_to_bytes(keys: Sequence[ChunkKey]) -> bytes:
    return b"".join(keys)


def keys_from_bytes(data: bytes, limit: int) -> list[ChunkKey]:
    if len(data) % KEY_BYTES:
        raise WireError(
            ErrorCode.BAD_REQUEST, f"a body of raw keys is a multiple of {KEY_BYTES} bytes"
        )
    count = len(data) // KEY_BYTES
    if count > limit:
        raise WireError(ErrorCode.REQUEST_TOO_LARGE, f"{count} keys; the limit is {limit}")
    return [ChunkKey(data[i : i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]


def hex_bytes(text: Any, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except (TypeError, ValueError):
        raise WireError(
            ErrorCode.BAD_REQUEST, f"{what} must be {KEY_BYTES * 2} hex digits"
        ) from None
    if len(raw) != KEY_BYTES:
        raise WireError(ErrorCode.BAD_REQUEST, f"{what} must be {KEY_BYTES * 2} hex digits")
    return raw

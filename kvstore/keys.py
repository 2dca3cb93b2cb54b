"""Namespaces and chained prefix keys.

A token sequence is cut into chunks of ``chunk_tokens`` tokens; only full
chunks are keyed. Chunk ``i`` has the 128-bit key::

    key[i] = H(key[i-1] || namespace.digest || le_uint32(tokens of chunk i))
    key[-1] = 16 zero bytes

so a key names the chunk *and* everything before it, and the same tokens under
another model, layout, dtype, chunk size or tenant salt never share a key.

The default ``H`` is xxh3-128: non-cryptographic but 128 bits wide (accidental
collisions are negligible at any realistic scale) and fast enough that hashing
never shows up next to moving the KV itself. ``sha256`` (truncated to 128 bits)
is collision resistant against crafted inputs; use it where tenants who do not
trust each other share a store, as vLLM made sha256 its default for that reason.

Keys are a pure function of their inputs: no Python ``hash()``, no per-process
seed, so two processes (or a process before and after a restart) agree.
Engines that hash their own blocks (vLLM's ``request.block_hashes``, SGLang's
page hashes) use ``external_keys`` to place those hashes inside a namespace.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import xxhash

from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.tensors import is_tensor

if TYPE_CHECKING:
    import torch

KEY_BYTES = 16
_ROOT = bytes(KEY_BYTES)


class HashAlgo(enum.Enum):
    """Hash used to chain chunk keys; part of the namespace."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"


class ChunkKey(bytes):
    """A 16-byte chunk key. Its own type so a key is never confused with a payload."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"ChunkKey({self.hex()})"


# dtype name -> bytes per element. The names are torch's, the wire format's too.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one chunk of KV: ``(num_layers, 2, chunk_tokens, num_kv_heads, head_dim)``.

    ``name`` tags the memory order an engine uses (``"LKTHD"`` for the shape
    above, ``"vllm-page"`` for opaque engine pages, ...): two engines that lay
    the same numbers out differently must not share chunks, so the tag is part
    of the namespace.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    chunk_tokens: int = 256
    name: str = "LKTHD"
    page_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
            )
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, field_name) <= 0:
                raise ConfigError(f"{field_name} must be positive")
        if self.page_tokens is not None and (
            self.page_tokens <= 0 or self.chunk_tokens % self.page_tokens
        ):
            raise ConfigError(
                f"chunk_tokens={self.chunk_tokens} must be a multiple of the engine's "
                f"page size {self.page_tokens}"
            )

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * DTYPE_SIZES[self.dtype]  # math: ~20x np.prod

    @property
    def bytes_per_token(self) -> int:
        return self.chunk_nbytes // self.chunk_tokens


@dataclass(frozen=True)
class Namespace:
    """Everything a chunk's identity depends on besides its tokens.

    The digest is SHA-256 over a canonical JSON of the named fields (so a field
    can never bleed into its neighbour, the ``("org_1", "2345")`` vs
    ``("org_12345", "")`` trap), truncated to 16 bytes. The tenant salt enters
    the digest, and the digest enters every chunk key and every stored block
    header, so the salt is enforced at every tier, not only the top one.
    """

    model: str
    layout: KVLayout
    tenant_salt: str | None = None
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(
            {
                "v": 1,
                "model": self.model,
                "layout": {
                    "name": self.layout.name,
                    "num_layers": self.layout.num_layers,
                    "num_kv_heads": self.layout.num_kv_heads,
                    "head_dim": self.layout.head_dim,
                    "dtype": self.layout.dtype,
                    "chunk_tokens": self.layout.chunk_tokens,
                    "page_tokens": self.layout.page_tokens,
                },
                "tenant_salt": self.tenant_salt,
                "hash_algo": self.hash_algo.value,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        object.__setattr__(self, "digest", hashlib.sha256(canonical).digest()[:KEY_BYTES])

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens


def _canonical_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as little-endian uint32, validated without a per-token Python loop."""
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise LayoutMismatch(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return array.astype("<u4")
    if not np.issubdtype(array.dtype, np.integer):
        raise LayoutMismatch(f"token ids must be integers, got dtype {array.dtype}")
    if array.dtype != np.dtype("<u4"):
        if int(array.min()) < 0 or int(array.max()) > 0xFFFFFFFF:
            raise LayoutMismatch("token ids must lie in [0, 2**32)")
        array = array.astype("<u4")
    return np.ascontiguousarray(array)


def chunk_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[ChunkKey]:
    """Chained keys of every full chunk of ``tokens``; a partial last chunk gets none."""
    array = _canonical_tokens(tokens)
    chunk_tokens = namespace.chunk_tokens
    n_chunks = len(array) // chunk_tokens
    data = array[: n_chunks * chunk_tokens].tobytes()
    step = chunk_tokens * 4
    digest = namespace.digest
    keys: list[ChunkKey] = []
    prev = _ROOT
    if namespace.hash_algo is HashAlgo.XXH3_128:
        hash_fn = xxhash.xxh3_128_digest
        for start in range(0, len(data), step):
            prev = hash_fn(prev + digest + data[start : start + step])
            keys.append(ChunkKey(prev))
    else:
        sha = hashlib.sha256
        for start in range(0, len(data), step):
            prev = sha(prev + digest + data[start : start + step]).digest()[:KEY_BYTES]
            keys.append(ChunkKey(prev))
    return keys


TokensOrKeys: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor | Sequence[ChunkKey]"


def keys_of(namespace: Namespace, tokens_or_keys: TokensOrKeys) -> list[ChunkKey]:
    """Chunk keys of a token sequence, or the given keys checked to be ``ChunkKey``.

    Every API that takes "tokens or keys" (the store, the client) resolves
    them here, so both faces accept exactly the same inputs.
    """
    if is_tensor(tokens_or_keys):
        return chunk_keys(namespace, tokens_or_keys.detach().cpu().numpy())
    items = list(tokens_or_keys) if not isinstance(tokens_or_keys, np.ndarray) else None
    if items and isinstance(items[0], bytes):
        if not all(isinstance(key, ChunkKey) for key in items):
            raise LayoutMismatch("keys must all be ChunkKey (see kvstore.keys)")
        return [key for key in items if isinstance(key, ChunkKey)]
    return chunk_keys(namespace, np.asarray(tokens_or_keys))


def external_keys(namespace: Namespace, engine_hashes: Sequence[bytes | int]) -> list[ChunkKey]:
    """Place an engine's own block hashes inside ``namespace``.

    The engine's hashes are already chained over their prefix (vLLM, SGLang),
    so each key is ``H(namespace.digest || b"ext" || hash)``; the namespace still
    separates models, layouts and tenants. Integers are encoded as unsigned
    big-endian of their minimal width, bytes as they are.
    """
    keys: list[ChunkKey] = []
    for engine_hash in engine_hashes:
        if isinstance(engine_hash, int):
            if engine_hash < 0:
                raise LayoutMismatch("integer block hashes must be non-negative")
            raw = engine_hash.to_bytes(max(1, (engine_hash.bit_length() + 7) // 8), "big")
        elif isinstance(engine_hash, bytes | bytearray | memoryview):
            raw = bytes(engine_hash)
        else:
            raise LayoutMismatch(f"engine block hash must be bytes or int, got {type(engine_hash)}")
        material = namespace.digest + b"ext" + len(raw).to_bytes(4, "little") + raw
        if namespace.hash_algo is HashAlgo.XXH3_128:
            keys.append(ChunkKey(xxhash.xxh3_128_digest(material)))
        else:
            keys.append(ChunkKey(hashlib.sha256(material).digest()[:KEY_BYTES]))
    return keys

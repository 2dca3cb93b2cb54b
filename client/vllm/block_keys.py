"""vLLM block hashes as kvstore keys, each derived once and shared by both sides' threads.

A key is ``external_keys`` of vLLM's hash in the request's namespace: one
SHA-256 per block, about a microsecond. A 119K-token context in 16-token
blocks is 7,438 of them, and an agent's next call sends the same prefix again
with a little more: deriving every key per request spent ~10 ms of the
scheduler's step on keys it had derived a step before. ``BlockKeys``
remembers them by hash, per ``cache_salt`` (a salt is a tenant: the same
hash under another salt is another key), newest kept, at most
``KEYS_KEPT`` per salt and ``SALTS_KEPT`` salts.

Thread safe: the scheduler's thread and its lookup thread (``client.vllm.lookups``)
both ask; the lock is held for dictionary reads and writes only, never while
hashing, so neither waits for the other's derivation.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

from kvstore.client.vllm.pages import PageFormat
from kvstore.keys import ChunkKey

KEYS_KEPT = 131_072
"""Keys remembered per salt (~26 MB): two million tokens in 16-token blocks."""
SALTS_KEPT = 64
"""Salts whose keys are remembered; the one asked for least recently goes first."""


V = TypeVar("V")


class PerSalt(Generic[V]):
    """A table by vLLM block hash per ``cache_salt``, at most ``keep`` entries each, and
    ``SALTS_KEPT`` tables, the one asked for least recently dropped first. Not thread
    safe: its owner holds a lock."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._tables: dict[str | None, dict[bytes, V]] = {}

    def table(self, salt: str | None) -> dict[bytes, V]:
        """``salt``'s table, now the most recently asked for."""
        table = self._tables.pop(salt, None) or {}
        self._tables[salt] = table
        if len(self._tables) > SALTS_KEPT:
            del self._tables[next(iter(self._tables))]
        return table

    def trim(
        self, salt: str | None, table: dict[bytes, V], when: Callable[[V], int] | None = None
    ) -> dict[bytes, V]:
        """``salt``'s ``table`` cut to its newest half once it holds more than ``keep``
        (amortised O(1) an entry): the entries inserted last, or those whose ``when``
        is latest; the table now ``salt``'s, unless ``salt`` was dropped meanwhile."""
        if len(table) <= self._keep:
            return table
        first = len(table) - self._keep // 2
        if when is None:
            table = dict(itertools.islice(table.items(), first, None))
        else:
            cutoff = sorted(map(when, table.values()))[first]
            table = {key: value for key, value in table.items() if when(value) >= cutoff}
        if salt in self._tables:
            self._tables[salt] = table
        return table


class BlockKeys:
    """Keys of vLLM block hashes in ``pages``' namespaces; see the module docstring."""

    def __init__(self, pages: PageFormat, keep: int = KEYS_KEPT) -> None:
        self._pages = pages
        self._lock = threading.Lock()
        self._known: PerSalt[ChunkKey] = PerSalt(keep)

    def keys(self, salt: str | None, hashes: Sequence[bytes]) -> list[ChunkKey]:
        """The key of each of ``hashes`` under ``salt``, in order."""
        with self._lock:
            known = self._known.table(salt)
            found = [known.get(block_hash) for block_hash in hashes]
        missing = [block_hash for block_hash, key in zip(hashes, found, strict=True) if key is None]
        if not missing:
            return cast(list[ChunkKey], found)  # every one was found
        derived = dict(zip(missing, self._pages.keys(salt, missing), strict=True))
        with self._lock:
            known.update(derived)
            self._known.trim(salt, known)
        return [
            derived[block_hash] if key is None else key
            for block_hash, key in zip(hashes, found, strict=True)
        ]

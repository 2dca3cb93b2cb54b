"""Damage a stored block in LMDB behind the store's back, as a failing disk would.

The store must be closed (or the daemon stopped) first: LMDB allows one writer,
and a reader's cached pages would not see the change.
"""

from __future__ import annotations

from pathlib import Path

import lmdb

from kvstore.block import HEADER_BYTES
from kvstore.keys import ChunkKey, Namespace


def damage_block(lmdb_dir: Path, namespace: Namespace, key: ChunkKey, offset: int = 100) -> None:
    """Flip one bit of ``key``'s payload, ``offset`` bytes past the block header."""
    env = lmdb.open(str(lmdb_dir), subdir=True)
    try:
        with env.begin(write=True) as txn:
            stored_key = namespace.digest + key
            value = txn.get(stored_key)
            assert value is not None, "the block to damage is not in LMDB"
            damaged = bytearray(value)
            damaged[HEADER_BYTES + offset] ^= 0x10
            txn.put(stored_key, bytes(damaged))
    finally:
        env.close()

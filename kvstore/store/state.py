"""``StoreState``: one store's mutable state, which only the store's own modules touch.

A store is one ``StoreCore`` (``core.py``) and the faces built on it:
``TieredStore`` (an engine in this process), ``SharedServing`` (other processes,
through a daemon: ``shared.py``) and ``Maintenance`` (scrub, flush). They share
this state and nothing outside ``kvstore/store`` reads it (a test,
``tests/layout/test_imports.py``, keeps it so): a daemon, a client or the
predictor asks the store, never its index or its lock.

Ownership: ``lock`` guards ``index``, ``placement`` (and through it the eviction
policy and the tiers' accounting) and ``stats``, and serialises every path that
moves blocks. A caller takes it for as short a time as it can: reads take it to
pin and to record, and copy the bytes with it released; a pinned block is never
an eviction victim, so a read in progress cannot lose its block. Pins are
written by ``BlockIndex`` alone (``pin``/``unpin``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.store.index import BlockIndex
from kvstore.store.placement import Placement
from kvstore.store.stats import StoreStats


@dataclass(frozen=True, slots=True)
class StoreState:
    """The lock, and what it guards (module docstring)."""

    lock: threading.RLock
    index: BlockIndex
    placement: Placement
    stats: StoreStats

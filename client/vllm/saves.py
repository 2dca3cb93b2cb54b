"""Saves off the engine's step: pages gathered into a bounded pool, put by a thread of their own.

::

    wait_for_save ─► submit(transfer), per batch of blocks:
       (vLLM's step)     take a staging buffer from the pool ── none free: the store
                         │                                      lags; the request's
                         │                                      save stops here,
                         │                                      dropped and counted
                         gather the batch's pages into it (CPU: here, before the
                         step ends; CUDA: on a side stream, after the forward)
                         queue it ─────────────► put thread: store.put(batch), then
                                                 the buffer back to the pool
    get_finished ─► finished(req ids vLLM finished) ─► those whose saves are all out

``wait_for_save`` returns once the pages are queued, not stored: the engine's
next step never waits for the store. What it costs in memory is the pool
(``pool_bytes``); what a store that cannot keep up costs is saves, counted in
``SaveCounts.dropped``, never the engine's time.

A request's save is a chain: a lookup stops at the first missing block, so the
blocks after a dropped one could never be found. Once a request drops a
batch, the rest of its blocks are dropped too, without their gather.

vLLM frees a finished request's blocks only once ``get_finished`` names it:
the scheduler side holds every request that had a save planned
(``SchedulerSide.finished``), and every worker saw that plan in its metadata
(``submit``, or ``hold`` for a save it skips), so both sides agree which
requests to name without a word between them. A held request is named when
its last batch is put, dropped or failed. On CUDA this is what keeps its pages
from being reused while the side stream still reads them; a preempted request's
blocks are freed at once, so the compute stream waits for the side stream
before a step that follows a preemption (``settle``).

Threads: ``submit``, ``hold``, ``finished`` and ``settle`` are the worker's
thread; the put thread only puts, gives buffers back and counts down.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.client.connect import KVClient
from kvstore.client.vllm.block_keys import BlockKeys
from kvstore.client.vllm.cache_pages import CachePages
from kvstore.client.vllm.pages import BlockTransfer
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey, Namespace
from kvstore.throttled_log import ThrottledLog

log = logging.getLogger("kvstore.client.vllm")

POOL_BYTES = 256 << 20
"""Default: host memory the save pool's staging buffers take, all together."""
MIN_BUFFERS = 2
CLOSE_WAIT_S = 5.0
"""How long ``close`` waits for the queued saves to go out."""


@dataclass(slots=True)
class SaveCounts:
    """Blocks this worker saved, dropped because the store lagged, or failed to put."""

    saved: int = 0
    dropped: int = 0
    failed: int = 0


@dataclass(slots=True)
class _Batch:
    """One put on its way: the parent's key (if any) then the batch's, in ``keys``."""

    req_id: str
    namespace: Namespace
    keys: list[ChunkKey]
    parents: int  # leading keys named without a payload: 0 or 1
    staging: torch.Tensor
    count: int
    free: queue.SimpleQueue[torch.Tensor]  # the pool its staging goes back to
    ready: torch.cuda.Event | None = field(default=None)


class Saves:
    """The worker's saves; see the module docstring."""

    def __init__(
        self,
        store: KVClient,
        caches: Sequence[CachePages],
        keys: Sequence[BlockKeys],
        batch_blocks: int,
        pool_bytes: int = POOL_BYTES,
    ) -> None:
        """``caches[g]`` and ``keys[g]``: KV cache group ``g``'s pages and keys; each
        group has an equal share of the pool."""
        if batch_blocks <= 0 or pool_bytes <= 0:
            raise ConfigError("a save's batch and pool must be positive")
        self._store = store
        self._caches = list(caches)
        self._keys = list(keys)
        self._batch_blocks = batch_blocks
        self._free: list[queue.SimpleQueue[torch.Tensor]] = []
        for cache in caches:
            free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
            share = pool_bytes // len(caches) // (batch_blocks * cache.pages.block_bytes)
            for _ in range(max(MIN_BUFFERS, share)):
                free.put(cache.staging(batch_blocks))
            self._free.append(free)
        device = caches[0].device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._work: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending and counts
        self._pending: Counter[str] = Counter()  # req id -> batches queued, not yet put
        self._held: set[str] = set()  # requests vLLM holds for their saves
        self._finishing: set[str] = set()  # held requests vLLM has finished
        self._broken: set[str] = set()  # requests that dropped a batch: the rest goes too
        self._lagging = ThrottledLog(log, every_s=60.0)
        self.counts = SaveCounts()
        self._thread = threading.Thread(target=self._put_all, name="kvstore-save", daemon=True)
        self._thread.start()

    def hold(self, req_id: str) -> None:
        """A save of ``req_id`` was planned but is skipped: vLLM holds it all the same."""
        self._held.add(req_id)

    def submit(self, transfer: BlockTransfer) -> None:
        """Gather ``transfer``'s pages into the pool and queue their puts."""
        req_id = transfer.req_id
        self.hold(req_id)
        if req_id in self._broken:
            self._drop(len(transfer.block_ids))
            return
        cache, free = self._caches[transfer.group], self._free[transfer.group]
        parents = [] if transfer.parent is None else [transfer.parent]
        keys = self._keys[transfer.group].keys(transfer.salt, [*parents, *transfer.hashes])
        namespace = cache.pages.namespace(transfer.salt)
        for start in range(0, len(transfer.block_ids), self._batch_blocks):
            block_ids = transfer.block_ids[start : start + self._batch_blocks]
            try:
                staging = free.get_nowait()
            except queue.Empty:
                self._broken.add(req_id)
                self._drop(len(transfer.block_ids) - start)
                self._lagging.warning(
                    "kvstore saves dropped: the store is behind by %d queued batches",
                    self._work.qsize(),
                )
                return
            # Block start + i is keys[len(parents) + start + i]; a batch past the first
            # names the block before it as its parent, so the store keeps the chain.
            first = len(parents) + start
            named = 1 if first else 0
            batch_keys = keys[first - named : first + len(block_ids)]
            ready = self._gather(cache, block_ids, staging)
            with self._lock:
                self._pending[req_id] += 1
            self._work.put(
                _Batch(
                    req_id, namespace, batch_keys, named, staging, len(block_ids), free, ready
                )
            )

    def _gather(
        self, cache: CachePages, block_ids: tuple[int, ...], staging: torch.Tensor
    ) -> torch.cuda.Event | None:
        if self._stream is None:
            cache.gather(block_ids, staging)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self._stream):
            cache.gather(block_ids, staging)
        ready = torch.cuda.Event()
        ready.record(self._stream)
        return ready

    def settle(self) -> None:
        """Before a step that may reuse freed blocks: the compute stream waits for the
        gathers still reading them (CUDA only; on CPU every gather is done)."""
        if self._stream is not None:
            torch.cuda.current_stream(self._caches[0].device).wait_stream(self._stream)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM held for their saves, those now out (to name once)."""
        self._finishing |= finished_req_ids & self._held
        with self._lock:
            done = {req_id for req_id in self._finishing if not self._pending[req_id]}
            for req_id in done:
                del self._pending[req_id]
        self._finishing -= done
        self._held -= done
        self._broken -= done
        return done

    def _drop(self, blocks: int) -> None:
        with self._lock:
            self.counts.dropped += blocks

    def _put_all(self) -> None:
        while (batch := self._work.get()) is not None:
            saved = False
            try:
                if batch.ready is not None:
                    batch.ready.synchronize()
                rows = batch.staging[: batch.count]
                chunks: list[np.ndarray | None] = [None] * batch.parents
                chunks += [row.view(torch.uint8).reshape(-1).numpy() for row in rows]
                self._store.put(batch.namespace, batch.keys, chunks)
                saved = True
            except KVStoreError as error:
                log.warning("kvstore save of request %s failed: %s", batch.req_id, error)
            except Exception:  # the put thread must count every batch down, whatever happened
                log.exception("kvstore save of request %s failed", batch.req_id)
            finally:
                batch.free.put(batch.staging)
                with self._lock:
                    self._pending[batch.req_id] -= 1
                    if saved:
                        self.counts.saved += batch.count
                    else:
                        self.counts.failed += batch.count

    def close(self) -> None:
        """Put what is queued (waiting at most ``CLOSE_WAIT_S``), then stop the thread."""
        self._work.put(None)
        self._thread.join(CLOSE_WAIT_S)

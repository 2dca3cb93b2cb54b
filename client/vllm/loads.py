"""Loads off the step: a thread of its own brings a request's blocks in while vLLM runs others.

A large load made before the forward (a synchronous load) holds up every
running request for as long as it takes: a returning 119K-token agentic
context is about 15 GB at Llama-3.1-8B's 128 KiB a token, on the order of a
second over PCIe. So a load of at least ``async_load_mib`` is asynchronous:
vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` and keeps stepping::

    scheduler: get_num_new_matched_tokens ─► (tokens, True) when tokens >= the threshold
    worker:    start_load_kv ─► submit(transfer) ─► load thread: get the blocks, place
                                                    them in the request's pages (CUDA:
                                                    on a stream of its own, waited for)
    worker:    get_finished ─► finished(): requests whose loads are done, and the
               blocks that failed among them (get_block_ids_with_load_errors, same pass)
    scheduler: the request runs from the blocks that arrived; vLLM recomputes from
               the first that failed

Smaller loads stay synchronous: they cost the step less than the extra step an
asynchronous load costs its request. The threshold is in bytes, not tokens, as
a load's time is: 256 MiB is about 15 ms over PCIe and 50 ms of memcpy on a
CPU, the order of one engine step. The blocks a load writes belong to a
request that is not running, so no forward reads them meanwhile. A request
finished (aborted) while its load is on its way keeps its blocks until the load
is named done (``SchedulerSide.finished``).

Threads: ``submit`` and ``finished`` are the worker's thread; the load thread
runs ``load``, the function it is given, and records what came of it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from kvstore.client.vllm.pages import BlockTransfer

log = logging.getLogger("kvstore.client.vllm")

BYTES = 256 << 20
"""Default: the smallest load made asynchronous, in bytes of KV."""
CLOSE_WAIT_S = 5.0
"""How long ``close`` waits for a load on its way."""


class AsyncLoads:
    """The worker's asynchronous loads; see the module docstring.

    ``load(transfer, staging)`` brings one transfer's blocks into vLLM's cache
    through ``staging`` and returns the vLLM block ids that failed.
    """

    def __init__(
        self,
        load: Callable[[BlockTransfer, torch.Tensor], list[int]],
        staging: torch.Tensor,
        device: torch.device,
    ) -> None:
        self._load = load
        self._staging = staging
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._work: queue.SimpleQueue[BlockTransfer | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _done and _failed
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._thread = threading.Thread(target=self._load_all, name="kvstore-load", daemon=True)
        self._thread.start()

    def submit(self, transfer: BlockTransfer) -> None:
        self._work.put(transfer)

    def finished(self) -> tuple[set[str], set[int]]:
        """The requests whose loads are done since the last call, and the vLLM block ids
        that failed among them (to report in the same pass)."""
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, set()
        return done, failed

    def _load_all(self) -> None:
        while (transfer := self._work.get()) is not None:
            try:
                failed = self._load_one(transfer)
            except Exception:  # a load thread must name every load done, whatever happened
                log.exception("kvstore asynchronous load of request %s failed", transfer.req_id)
                failed = list(transfer.block_ids)
            with self._lock:
                self._failed.update(failed)
                self._done.add(transfer.req_id)

    def _load_one(self, transfer: BlockTransfer) -> list[int]:
        if self._stream is None:
            return self._load(transfer, self._staging)
        with torch.cuda.stream(self._stream):
            failed = self._load(transfer, self._staging)
        self._stream.synchronize()
        return failed

    def close(self) -> None:
        """Stop after the load on its way (waiting at most ``CLOSE_WAIT_S``)."""
        self._work.put(None)
        self._thread.join(CLOSE_WAIT_S)

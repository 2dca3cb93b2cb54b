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
    worker:    get_finished ─► finished(): requests whose loads are done, the blocks
               that failed among them (get_block_ids_with_load_errors, same pass) and
               the requests they failed (failed_recving, for a model of several KV
               cache groups, whose block ids vLLM cannot map back)
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.client.vllm.pages import BlockTransfer

log = logging.getLogger("kvstore.client.vllm")

BYTES = 256 << 20
"""Default: the smallest load made asynchronous, in bytes of KV."""
CLOSE_WAIT_S = 5.0
"""How long ``close`` waits for a load on its way."""


@dataclass
class Finished:
    """What the load thread finished since it was last asked."""

    requests: set[str] = field(default_factory=set)  # every transfer of theirs is done
    failed_blocks: set[int] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)  # with a failed block


class AsyncLoads:
    """The worker's asynchronous loads; see the module docstring.

    ``load(transfer)`` brings one transfer's blocks into vLLM's cache and
    returns the vLLM block ids that failed. A request with several transfers
    (one a KV cache group) is done when its last one is.
    """

    def __init__(
        self, load: Callable[[BlockTransfer], list[int]], device: torch.device
    ) -> None:
        self._load = load
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._work: queue.SimpleQueue[BlockTransfer | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending and _finished
        self._pending: Counter[str] = Counter()  # req id -> transfers submitted, not done
        self._finished = Finished()
        self._thread = threading.Thread(target=self._load_all, name="kvstore-load", daemon=True)
        self._thread.start()

    def submit(self, transfers: Sequence[BlockTransfer]) -> None:
        """Queue a step's transfers, every one counted before the first can finish (a
        request's transfers all come in one step)."""
        with self._lock:
            self._pending.update(transfer.req_id for transfer in transfers)
        for transfer in transfers:
            self._work.put(transfer)

    def finished(self) -> Finished:
        """What finished since the last call: its failed blocks are reported in the same
        pass as the requests they belong to."""
        with self._lock:
            finished, self._finished = self._finished, Finished()
        return finished

    def _load_all(self) -> None:
        while (transfer := self._work.get()) is not None:
            try:
                failed = self._load_one(transfer)
            except Exception:  # a load thread must name every load done, whatever happened
                log.exception("kvstore asynchronous load of request %s failed", transfer.req_id)
                failed = list(transfer.block_ids)
            req_id = transfer.req_id
            with self._lock:
                self._finished.failed_blocks.update(failed)
                if failed:
                    self._finished.failed_requests.add(req_id)
                self._pending[req_id] -= 1
                if not self._pending[req_id]:
                    del self._pending[req_id]
                    self._finished.requests.add(req_id)

    def _load_one(self, transfer: BlockTransfer) -> list[int]:
        if self._stream is None:
            return self._load(transfer)
        with torch.cuda.stream(self._stream):
            failed = self._load(transfer)
        self._stream.synchronize()
        return failed

    def close(self) -> None:
        """Stop after the load on its way (waiting at most ``CLOSE_WAIT_S``)."""
        self._work.put(None)
        self._thread.join(CLOSE_WAIT_S)

"""The serving engine a replay models: one GPU whose KV memory both runs requests and
caches idle sessions' KV.

::

    arrival ─► admission queue (FIFO) ─► admitted when the batch has a slot and HBM
               has room for the whole context beside the running requests' KV
            ─► make room: idle KV leaves HBM (the policy's victims; each written
               back to the tier below at its bandwidth, on this request's clock)
            ─► load the cached prefix (each chunk at its tier's reload rate)
            ─► prefill the rest on the GPU (one prefill at a time: the GPU queue)
            ─► first token ─► the response runs for the trace's ``api_s``
            ─► done: its KV is idle, the session's next call is ``think_s`` away

What costs what (``RequestCost``): ``load_s`` and ``writeback_s`` are copies
over the host link that hold up this request only; ``recompute_s`` holds the
GPU, so a prefill waits for the one before it. GPU-seconds are the prefill and
the stalls the request spends holding its HBM before its first token
(write-back + load + recompute); queueing (for a batch slot and HBM, then for
the GPU) is reported apart. Decode runs batched beside prefills and is the
same under every policy; its length only decides when a session goes idle.

The running requests' prompts are pinned in the store's HBM tier, so the
policy can only evict idle KV, and the HBM a request needs is its prompt's
chunks (the output's KV, under 1% of a coding agent's context, is left out).
Defaults model Llama-3.1-8B in bf16 on one H200: ~100 GB of its 141 GB for KV.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

DEFAULT_MAX_RUNNING = 64
"""Requests in the batch at once: vLLM's ``max_num_seqs`` for an 8B model at long contexts."""


class StartReported(enum.Enum):
    """When the engine tells the daemon a request began (``request_started``, which the
    learner labels by and on which the policy prefetches the session's chain).

    ``ARRIVAL``: as the request comes in. ``ADMISSION``: once it is admitted, as
    vLLM's connector does (``client.vllm.scheduler``: at block allocation). The two
    differ only while requests queue for admission: then a session reported at
    arrival looks back, and is placed and prefetched as if about to be read, for as
    long as its request waits, while one reported at admission looks idle until it
    is read.
    """

    ARRIVAL = "arrival"
    ADMISSION = "admission"


@dataclass(frozen=True)
class EngineModel:
    """The engine's bounds: how many GPUs prefill (each one prefill at a time), requests in
    each GPU's batch at once; the HBM for KV of all of them is the HBM tier
    (``Sizing.hbm_gb``). One GPU by default: a request trace recorded on a cluster
    (Mooncake's) needs as many as it kept busy, or its prefills queue without end.
    ``started``: when it reports a request's start to the daemon."""

    max_running: int = DEFAULT_MAX_RUNNING
    gpus: int = 1
    started: StartReported = StartReported.ARRIVAL


@dataclass(frozen=True, slots=True)
class RequestCost:
    """One request's way to its first token."""

    arrival: float
    admitted: float  # a batch slot and its HBM were free
    prefill_start: float  # the GPU was free and its loads done
    writeback_s: float
    load_s: float
    recompute_s: float

    @property
    def first_token(self) -> float:
        return self.prefill_start + self.recompute_s

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival

    @property
    def queue_s(self) -> float:
        """Waiting for a slot and HBM, then for the GPU."""
        return self.admission_wait_s + self.gpu_wait_s

    @property
    def admission_wait_s(self) -> float:
        """Waiting for a batch slot and room in HBM for the whole prompt."""
        return self.admitted - self.arrival

    @property
    def gpu_wait_s(self) -> float:
        """Admitted and loaded, waiting for the GPU to prefill."""
        return self.prefill_start - (self.admitted + self.writeback_s + self.load_s)

    @property
    def gpu_s(self) -> float:
        return self.writeback_s + self.load_s + self.recompute_s


class PrefillQueue:
    """The GPUs' prefills, one after another on each: ``start`` says when one that is ready
    at ``ready`` and computes for ``seconds`` begins, on the GPU free first."""

    def __init__(self, gpus: int = 1) -> None:
        self.free_at = [0.0] * gpus  # a heap: when each GPU's current prefill ends

    def start(self, ready: float, seconds: float) -> float:
        begin = max(ready, self.free_at[0])
        heapq.heapreplace(self.free_at, begin + seconds)
        return begin


@dataclass
class Admission:
    """The batch slots and the HBM the running requests hold; ``fits(chunks)`` is the one
    admission rule (the replay keeps the queue, in arrival order)."""

    hbm_chunks: int  # the HBM tier, in chunks
    max_running: int
    running: int = 0
    pinned: int = 0  # chunks the running requests hold in HBM

    def fits(self, chunks: int) -> bool:
        """Whether a request of ``chunks`` may start now. A prompt larger than all of HBM
        starts alone (its tail then stays where it is): it would wait for ever."""
        if self.running >= self.max_running:
            return False
        return self.pinned + chunks <= self.hbm_chunks or self.running == 0

    def take(self, chunks: int) -> None:
        self.running += 1
        self.pinned += chunks

    def give_back(self, chunks: int) -> None:
        self.running -= 1
        self.pinned -= chunks

"""transformers caches filled from kvstore: all at once, or layer by layer behind the forward.

Two ways to turn a cached prefix into a ``DynamicCache``:

``load_cache``      fetch every chunk (``client.get`` into one staging buffer),
                    then unpack every layer, then return the cache. Simple; the
                    whole load is on the critical path.
``LayerwiseLoad``   returns a cache at once, whose layers are ``PendingLayer``s
                    that report the planned length (so positions and masks are
                    right) but hold nothing yet. A loader thread fetches the
                    chunks and then unpacks layer 0, 1, 2, ... in order; the
                    forward's attention for layer ``i`` waits only for layer
                    ``i``, so layer ``i+1`` loads while layer ``i`` computes::

        loader:  [ fetch all chunks ][ L0 ][ L1 ][ L2 ] ... [ Ln ]
        forward:   [ embed ] (wait)       [ L0 ][ L1 ][ L2 ] ... [ Ln ]

One block holds every layer of a chunk (``client.hf.packing``), so layer 0
needs the whole fetch; what runs behind compute is the per-layer unpack (on a
GPU, the host-to-device copy on a stream of its own) and whatever part of
the fetch the forward's first steps cover. ``LoadTiming.hidden_fraction``
measures how much of the load the forward did not wait for. On a CPU the
loader and the forward share the cores: a hidden copy still takes a core
from the forward's matmuls (the copies run in numpy, which releases the GIL,
so they do run in parallel where a core is free).

Both paths copy each byte twice, store -> staging buffer (``client.get`` with
``out=``) -> the cache's tensors (one strided copy per layer, or one for all
layers at once), and take their host memory from the caller's
``BufferPool`` (``HFKVStore.buffers``), so a load runs on pages that are
already mapped instead of faulting in fresh ones.

A chunk that fails to load (corrupt, tier down) ends the usable run there.
The all-at-once path simply builds the cache from the good run. The
layer-wise path has already started a forward that counts on the planned
length, so the first ``PendingLayer`` to wait raises ``LoadInterrupted``
(before any layer has computed with missing data) and the caller reruns from
``good_tokens`` (``HFKVStore`` does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvstore.client.buffers import BufferPool
from kvstore.client.connect import KVClient
from kvstore.client.hf.packing import cache_tensors, staging_buffer, unpack
from kvstore.errors import LoadInterrupted
from kvstore.keys import ChunkKey, Namespace
from kvstore.store.chunk import ChunkData

# Chunks per get: bounds one request's body through a daemon and the time to the first miss.
GET_BATCH_CHUNKS = 32


@dataclass(slots=True)
class LoadTiming:
    """Where one load's time went (seconds); owned by whoever ran the load."""

    fetch_s: float = 0.0  # client.get of every chunk into the staging buffer
    install_s: float = 0.0  # unpacking layers into the cache (host->device on a GPU)
    wait_s: float = 0.0  # time the forward spent blocked on the load

    @property
    def load_s(self) -> float:
        return self.fetch_s + self.install_s

    @property
    def hidden_fraction(self) -> float:
        """Share of the load the forward did not wait for (0 when run up front)."""
        if self.load_s <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.wait_s / self.load_s))


def fetch(
    client: KVClient,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    *,
    pool: BufferPool | None = None,
    pin: bool = False,
) -> tuple[torch.Tensor, int]:
    """Get ``keys`` into one staging buffer; return it and the leading run that loaded.

    The store copies each block's payload straight into its row (``out=``),
    so a block is copied once on the way in. Gets go in batches of
    ``GET_BATCH_CHUNKS`` and stop at the first miss, since nothing after a
    missing chunk is usable.
    """
    staged = staging_buffer(namespace.layout, len(keys), pool=pool, pin=pin)
    rows: list[ChunkData] = list(staged.unbind(0))
    good = 0
    for start in range(0, len(keys), GET_BATCH_CHUNKS):
        end = min(start + GET_BATCH_CHUNKS, len(keys))
        chunks = client.get(namespace, list(keys[start:end]), out=rows[start:end])
        for chunk in chunks:
            if chunk is None:
                return staged, good
            good += 1
    return staged, good


def install(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``keys``/``values`` the layer's content as they are.

    Not ``layer.update``: on an empty layer that concatenates onto an empty
    tensor, a third copy of the whole prefix.
    """
    layer.device = keys.device
    layer.keys, layer.values = keys, values
    layer.is_initialized = True


def cache_of(layers: Sequence[DynamicLayer]) -> DynamicCache:
    """A ``DynamicCache`` over exactly these layers (full layers even for sliding models:
    see ``client.hf.packing``)."""
    cache = DynamicCache()
    cache.layers = list(layers)
    return cache


def empty_cache(num_layers: int) -> DynamicCache:
    return cache_of([DynamicLayer() for _ in range(num_layers)])


def load_cache(
    client: KVClient,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    device: torch.device,
    max_tokens: int,
    pool: BufferPool | None = None,
) -> tuple[DynamicCache, int, LoadTiming]:
    """Fetch and unpack everything up front, keeping at most ``max_tokens`` tokens; return
    the cache, the chunks that loaded (the leading run) and the timing."""
    timing = LoadTiming()
    began = time.perf_counter()
    staged, good = fetch(client, namespace, keys, pool=pool, pin=device.type == "cuda")
    fetched = time.perf_counter()
    cache = staged_cache(staged[:good], namespace, device, max_tokens, pool)
    del staged  # back to the pool before the forward allocates
    timing.fetch_s = fetched - began
    timing.install_s = time.perf_counter() - fetched
    timing.wait_s = timing.load_s
    return cache, good, timing


def staged_cache(
    staged: torch.Tensor,
    namespace: Namespace,
    device: torch.device,
    max_tokens: int,
    pool: BufferPool | None = None,
) -> DynamicCache:
    """A cache holding the staged chunks' first ``max_tokens`` tokens (none: an empty cache)."""
    layout = namespace.layout
    tokens = min(len(staged) * layout.chunk_tokens, max_tokens)
    layers = [DynamicLayer() for _ in range(layout.num_layers)]
    if tokens:
        block = cache_tensors(layout, tokens, device, pool)
        unpack(staged, block)
        for index, layer in enumerate(layers):
            install(layer, block[index, 0], block[index, 1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return cache_of(layers)


class PendingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose prefix arrives from a ``LayerwiseLoad``.

    Until installed it reports the planned length (so positions and masks
    are computed for the whole prefix); ``update`` waits for the install.
    """

    def __init__(self, load: LayerwiseLoad, index: int) -> None:
        super().__init__()
        self._load = load
        self._index = index
        self.installed = False

    def get_seq_length(self) -> int:
        if not self.installed:
            return self._load.planned_tokens
        return super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.installed:
            self._load.wait(self._index)
            self.installed = True
        return super().update(key_states, value_states, *args, **kwargs)


@dataclass
class LayerwiseLoad:
    """One layer-wise load: a loader thread filling ``cache``'s ``PendingLayer``s in order.

    The loader thread owns ``timing.fetch_s``/``install_s``, ``good_chunks``
    and the layers it installs; the forward's thread owns ``timing.wait_s``.
    ``_ready[i]`` is set once layer ``i`` is installed or the load has ended
    short or failed (``_error``), so a waiter never blocks forever.
    """

    client: KVClient
    namespace: Namespace
    keys: Sequence[ChunkKey]
    device: torch.device
    max_tokens: int
    pool: BufferPool | None = None
    timing: LoadTiming = field(default_factory=LoadTiming)
    good_chunks: int = 0
    staged: torch.Tensor | None = field(init=False, default=None)
    cache: DynamicCache = field(init=False)
    _layers: list[PendingLayer] = field(init=False)
    _ready: list[threading.Event] = field(init=False)
    _error: BaseException | None = field(init=False, default=None)
    _thread: threading.Thread | None = field(init=False, default=None)
    _stream: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        count = self.namespace.layout.num_layers
        self._layers = [PendingLayer(self, index) for index in range(count)]
        self._ready = [threading.Event() for _ in range(count)]
        self.cache = cache_of(self._layers)
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)

    @property
    def planned_tokens(self) -> int:
        return min(len(self.keys) * self.namespace.chunk_tokens, self.max_tokens)

    def start(self) -> LayerwiseLoad:
        self._thread = threading.Thread(target=self._run, name="kvstore-hf-load", daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        """Wait for the loader thread (every layer installed, or the load ended short)."""
        if self._thread is not None:
            self._thread.join()

    def fallback_cache(self) -> DynamicCache:
        """After ``LoadInterrupted``: a cache of the chunks that did load."""
        self.join()
        if self.staged is None:
            return empty_cache(self.namespace.layout.num_layers)
        return staged_cache(
            self.staged[: self.good_chunks], self.namespace, self.device, self.max_tokens, self.pool
        )

    def wait(self, index: int) -> None:
        """Block until layer ``index`` is installed; ``LoadInterrupted`` if it never will be."""
        began = time.perf_counter()
        self._ready[index].wait()
        self.timing.wait_s += time.perf_counter() - began
        if self._error is not None:
            raise self._error
        if self.good_chunks < len(self.keys):
            good_tokens = min(self.good_chunks * self.namespace.chunk_tokens, self.max_tokens)
            raise LoadInterrupted(self.planned_tokens, good_tokens)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            layer = self._layers[index]
            assert layer.keys is not None and layer.values is not None
            layer.keys.record_stream(torch.cuda.current_stream(self.device))
            layer.values.record_stream(torch.cuda.current_stream(self.device))

    def _run(self) -> None:
        try:
            began = time.perf_counter()
            staged, self.good_chunks = fetch(
                self.client, self.namespace, self.keys, pool=self.pool, pin=self._stream is not None
            )
            self.staged = staged
            self.timing.fetch_s = time.perf_counter() - began
            if self.good_chunks < len(self.keys):
                return
            began = time.perf_counter()
            block = cache_tensors(
                self.namespace.layout, self.planned_tokens, self.device, self.pool
            )
            self.timing.install_s += time.perf_counter() - began
            for index, layer in enumerate(self._layers):
                began = time.perf_counter()
                self._install(staged, block, index, layer)
                self.timing.install_s += time.perf_counter() - began
                self._ready[index].set()
            self.staged = None  # every layer is in: the staging buffer goes back to the pool
        except BaseException as error:  # handed to the forward's thread by wait()
            self._error = error
        finally:
            for ready in self._ready:
                ready.set()

    def _install(
        self, staged: torch.Tensor, block: torch.Tensor, index: int, layer: PendingLayer
    ) -> None:
        if self._stream is None:
            unpack(staged, block, slice(index, index + 1))
        else:
            with torch.cuda.stream(self._stream):
                unpack(staged, block, slice(index, index + 1))
            self._stream.synchronize()  # honest install timing; the forward waits on it too
        install(layer, block[index, 0], block[index, 1])

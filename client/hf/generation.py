"""Hugging Face transformers on kvstore: load a cached prompt prefix instead of recomputing it.

::

    from kvstore.client.hf import HFKVStore

    with kvstore.connect("unix:///run/kvstore/kvstore.sock") as client:
        kv = HFKVStore(model, client, chunk_tokens=256, tenant_salt="tenant-42")
        result = kv.generate(input_ids, max_new_tokens=64, session="agent-7")
        result.sequences, result.report.loaded_tokens, result.report.recomputed_tokens

        # engines that drive forward themselves:
        pre = kv.prefill(input_ids)              # loads the prefix, prefills the rest
        pre.logits, pre.cache                    # decode on with pre.cache, then
        kv.save(all_token_ids, pre.cache)        # store the new full chunks

One request, in order:

1. ``lookup`` the prompt's chunk keys; keep the cached run, cut where the
   store's cost model says reloading loses to recomputing
   (``CachedPrefix.load_chunks``). At least one prompt token is always
   computed (the model needs the last prompt token's logits): a prompt that
   ends exactly on a chunk boundary loads its last chunk and drops that
   chunk's last token from the cache, rather than recompute a whole chunk.
2. ``request_started`` (session events, when a session is given).
3. Load the run into a ``DynamicCache`` (``client.hf.loading``: up front, or
   layer by layer behind the forward) and prefill only the tokens after what
   actually loaded. A chunk that fails (checksum, tier down) ends the run; a
   layer-wise forward started on the planned run is rerun from the good one.
4. Generate; then ``put`` every full chunk the cache holds beyond the loaded
   run (prompt and output), and ``request_finished`` with the tokens loaded
   and recomputed.

The block format and the namespace (which models share chunks: none) are
``client.hf.packing``'s. Batches of one sequence only: a prefix cache is per
sequence, and padding would put pad tokens into stored chunks.
Events are advisory: a client that cannot send one logs it and generation
goes on; so does a failed save inside ``generate`` (``report.save_error``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvstore.client.buffers import BufferPool
from kvstore.client.connect import KVClient
from kvstore.client.hf.loading import LayerwiseLoad, LoadTiming, load_cache
from kvstore.client.hf.packing import model_namespace, pack_chunks
from kvstore.errors import KVStoreError, LayoutMismatch, LoadInterrupted
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.store.chunk import ChunkData
from kvstore.wire.events import Trigger

log = logging.getLogger("kvstore.client.hf")

# Bytes of chunks per put: keeps one request well under a daemon's body limit.
PUT_BATCH_BYTES = 32 << 20
# Host memory kept for reuse by loads (staging buffers and cache tensors), by default.
LOAD_BUFFER_BYTES = 1 << 30


@dataclass(slots=True)
class RequestReport:
    """What one request loaded, recomputed and stored (tokens unless named otherwise)."""

    prompt_tokens: int
    cached_tokens: int = 0  # planned: the usable cached run after the caps
    loaded_tokens: int = 0  # actually loaded into the cache
    recomputed_tokens: int = 0  # prompt tokens prefilled
    output_tokens: int = 0
    saved_chunks: int = 0  # chunks newly stored by this request
    failed_chunks: int = 0  # planned chunks that did not load (corrupt, tier down)
    layerwise: bool = False
    timing: LoadTiming = field(default_factory=LoadTiming)
    save_error: str | None = None


@dataclass(slots=True)
class Prefill:
    """``HFKVStore.prefill``: the cache now holding the whole prompt, and the suffix logits."""

    cache: DynamicCache
    logits: torch.Tensor  # (1, recomputed_tokens, vocab)
    report: RequestReport


@dataclass(slots=True)
class Generation:
    """``HFKVStore.generate``: ``model.generate``'s output and this request's report."""

    sequences: torch.Tensor  # (1, prompt + output), as model.generate returns them
    output: Any  # model.generate's own return value (a GenerateOutput when asked for)
    report: RequestReport


class HFKVStore:
    """One transformers model bound to a kvstore client (embedded, daemon or HTTP).

    ``layerwise`` picks the loader for calls that do not say: ``True`` fetches
    layers behind the forward (``client.hf.loading.LayerwiseLoad``).

    Loads take their host memory (the staging buffer the store copies into,
    and on the host the cache tensors) from a ``BufferPool`` of at most
    ``load_buffer_bytes`` that this object owns: fresh memory costs a page
    fault per 4 KiB on first touch, more than the copy into it.
    """

    def __init__(
        self,
        model: Any,
        client: KVClient,
        *,
        chunk_tokens: int = 256,
        tenant_salt: str | None = None,
        model_id: str | None = None,
        layerwise: bool = False,
        load_buffer_bytes: int = LOAD_BUFFER_BYTES,
    ) -> None:
        self.model = model
        self.client = client
        self.namespace: Namespace = model_namespace(
            model, chunk_tokens=chunk_tokens, tenant_salt=tenant_salt, model_id=model_id
        )
        self.layerwise = layerwise
        self.buffers = BufferPool(load_buffer_bytes)
        # transformers 5 renamed forward's ``past_key_values`` to ``cache``.
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.chunk_tokens

    # -- the low-level API ---------------------------------------------------------

    def plan(self, input_ids: torch.Tensor) -> list[ChunkKey]:
        """Keys of the cached chunks worth loading for this prompt (see step 1); a prompt
        that ends on a chunk boundary loads its last chunk too, minus the last token."""
        tokens = _prompt_tokens(input_ids)
        prefix = self.client.lookup(self.namespace, tokens.numpy())
        usable = len(tokens) // self.chunk_tokens
        worth = prefix.num_chunks if prefix.load_chunks is None else prefix.load_chunks
        return list(prefix.keys[: min(usable, worth)])

    def prefill(
        self,
        input_ids: torch.Tensor,
        *,
        layerwise: bool | None = None,
        session: str | None = None,
        trigger: Trigger = Trigger.USER,
        user: str | None = None,
        **forward_kwargs: Any,
    ) -> Prefill:
        """Load the cached prefix and run the forward over the rest of the prompt.
        ``session``, ``trigger`` and ``user`` go into the session event it sends."""
        ids = _as_batch(input_ids, self.model)

        def run(cache: DynamicCache, loaded: int) -> torch.Tensor:
            kwargs = {self._cache_kwarg: cache, "use_cache": True, **forward_kwargs}
            logits: torch.Tensor = self.model(ids[:, loaded:], **kwargs).logits
            return logits

        logits, cache, report = self._with_prefix(ids, layerwise, session, trigger, user, run)
        return Prefill(cache=cache, logits=logits, report=report)

    def save(
        self,
        token_ids: torch.Tensor,
        cache: DynamicCache,
        *,
        skip_chunks: int = 0,
        session: str | None = None,
    ) -> int:
        """Store the full chunks of ``cache`` from chunk ``skip_chunks`` on, keyed by
        ``token_ids`` (the tokens whose KV the cache holds, in order, or more); return
        how many chunks were newly stored."""
        tokens = _prompt_tokens(token_ids)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, layer in enumerate(cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None:
                raise LayoutMismatch(f"cache layer {index} holds no KV; nothing to save")
            layers.append((keys, values))
        held = min(cache.get_seq_length(), len(tokens))
        full = held // self.chunk_tokens
        layout = self.namespace.layout
        per_put = max(1, PUT_BATCH_BYTES // layout.chunk_nbytes)
        keys = chunk_keys(self.namespace, tokens[: full * self.chunk_tokens].numpy())
        stored = 0
        for start in range(skip_chunks, full, per_put):
            end = min(start + per_put, full)
            chunks = pack_chunks(layers, layout, start, end)
            kv_chunks: list[ChunkData | None] = [None] * start
            kv_chunks.extend(chunks)
            stored += self.client.put(self.namespace, keys[:end], kv_chunks, session=session)
        return stored

    # -- the one-call helper -----------------------------------------------------------

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        layerwise: bool | None = None,
        session: str | None = None,
        trigger: Trigger = Trigger.USER,
        user: str | None = None,
        **generate_kwargs: Any,
    ) -> Generation:
        """``model.generate`` over the cached prefix, then save what it computed. With a
        ``session``, it reports the request's start (``trigger``, ``user``: who drives the
        session) and end to the predictor."""
        ids = _as_batch(input_ids, self.model)

        def run(cache: DynamicCache, loaded: int) -> Any:
            return self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **{self._cache_kwarg: cache},
                **generate_kwargs,
            )

        output, cache, report = self._with_prefix(ids, layerwise, session, trigger, user, run)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        report.output_tokens = sequences.shape[1] - ids.shape[1]
        try:
            report.saved_chunks = self.save(
                sequences,
                cache,
                skip_chunks=report.loaded_tokens // self.chunk_tokens,
                session=session,
            )
        except KVStoreError as error:
            log.warning("could not save the KV of a request: %s", error)
            report.save_error = str(error)
        if session is not None:
            self._advisory(
                self.client.request_finished,
                session,
                steps=1,
                output_tokens=report.output_tokens,
                context_tokens=sequences.shape[1],
                loaded_tokens=report.loaded_tokens,
                recomputed_tokens=report.recomputed_tokens,
            )
        return Generation(sequences=sequences, output=output, report=report)

    # -- internals -------------------------------------------------------------------

    def _with_prefix(
        self,
        ids: torch.Tensor,
        layerwise: bool | None,
        session: str | None,
        trigger: Trigger,
        user: str | None,
        run: Callable[[DynamicCache, int], Any],
    ) -> tuple[Any, DynamicCache, RequestReport]:
        """Plan, announce, load and ``run(cache, loaded_tokens)`` with a fallback to the
        good run if a layer-wise load ends short."""
        layerwise = self.layerwise if layerwise is None else layerwise
        keys = self.plan(ids)
        report = RequestReport(
            prompt_tokens=ids.shape[1],
            cached_tokens=min(len(keys) * self.chunk_tokens, ids.shape[1] - 1),
            layerwise=layerwise and bool(keys),
        )
        if session is not None:
            self._advisory(
                self.client.request_started,
                session,
                prompt_tokens=report.prompt_tokens,
                cached_tokens=report.cached_tokens,
                trigger=trigger,
                user=user,
            )
        device, limit = ids.device, ids.shape[1] - 1
        with torch.no_grad():
            if report.layerwise:
                load = LayerwiseLoad(
                    self.client, self.namespace, keys, device, limit, self.buffers
                ).start()
                report.timing = load.timing
                try:
                    output = run(load.cache, report.cached_tokens)
                    cache, good = load.cache, len(keys)
                except LoadInterrupted:
                    cache, good = load.fallback_cache(), load.good_chunks
                    output = run(cache, min(good * self.chunk_tokens, limit))
            else:
                cache, good, report.timing = load_cache(
                    self.client, self.namespace, keys, device, limit, self.buffers
                )
                output = run(cache, min(good * self.chunk_tokens, limit))
        report.loaded_tokens = min(good * self.chunk_tokens, limit)
        report.failed_chunks = len(keys) - good
        report.recomputed_tokens = report.prompt_tokens - report.loaded_tokens
        return output, cache, report

    def _advisory(self, send: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Send a session event; a failure is logged, never raised (events are advisory)."""
        try:
            send(*args, **kwargs)
        except KVStoreError as error:
            log.warning("session event not sent: %s", error)


def _as_batch(input_ids: torch.Tensor, model: Any) -> torch.Tensor:
    """``input_ids`` as a ``(1, n)`` long tensor on the model's device; one sequence only."""
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise LayoutMismatch(
            f"input_ids must be one sequence, shape (n,) or (1, n); got {tuple(ids.shape)}"
        )
    if ids.shape[1] == 0:
        raise LayoutMismatch("input_ids is empty; a prompt needs at least one token")
    return ids.to(device=model.device, dtype=torch.long)


def _prompt_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The token ids of one sequence as a 1-D CPU tensor (for keys)."""
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise LayoutMismatch(f"expected one sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.detach().to("cpu", torch.long)

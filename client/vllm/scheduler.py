"""The scheduler side of the vLLM connector: what to load and what to save, per step.

It runs in vLLM's EngineCore process and never touches KV itself. When a
request arrives it sends a lookup of the request's blocks (``client.vllm.lookups``:
on a thread of its own, answered within a deadline); when vLLM asks, it answers
how many blocks beyond vLLM's own prefix hit that lookup found, or while it is on
its way, how many it remembers the store holds (``client.vllm.held_blocks``: the
blocks it planned to save and those lookups found), and once vLLM
has allocated blocks it plans the loads; at the end of every ``schedule()`` it
plans the saves of the blocks that step completes. Both plans travel to the
workers as ``BlockTransfer`` lists in the connector metadata.

Session events (``client.vllm.sessions``) report each request when it is first
allocated (so with the tokens vLLM and kvstore had cached) and when it finishes.

Save planning keeps one watermark per request: blocks below it are saved,
loaded or were a local hit. A step saves the blocks it completes (every
token's KV computed, the block's hash known) above the watermark. When vLLM
rolls a request back (a failed load, a preemption), the step after starts
below the watermark and the watermark follows it down, so recomputed blocks
are saved again.

A model with several KV cache groups (vLLM's hybrid KV cache manager:
full-attention and sliding-window layers, ``client.vllm.pages``) moves each
group's pages in a transfer of its own. The lookup asks for one
full-attention group's chain: every group's pages of a block are saved in the
same step, so the others hold the same run. A sliding-window group moves only
the blocks vLLM gave it pages for (the window), never its null block. vLLM
takes no block-level load error from such a model, so its every load is
asynchronous, and one that fails anywhere fails the request as a whole
(``client.vllm.loads``): vLLM recomputes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.connect import KVClient
from kvstore.client.vllm.block_keys import BlockKeys
from kvstore.client.vllm.held_blocks import HeldBlocks
from kvstore.client.vllm.loads import BYTES as ASYNC_LOAD_BYTES
from kvstore.client.vllm.lookups import DEADLINE_S, SHARE, WAIT_S, WAIT_SHARE, Lookups
from kvstore.client.vllm.pages import NULL_BLOCK_ID, BlockTransfer, PageFormat, lookup_group
from kvstore.client.vllm.sessions import SessionEvents
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey

log = logging.getLogger("kvstore.client.vllm")


@dataclass
class _Tracked:
    """A request the scheduler side follows from allocation to its end."""

    request: Any  # vllm.v1.request.Request (this process's own object)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved: int = 0  # watermark: blocks below it need no save
    saving: bool = False  # a save was planned: vLLM holds its blocks until the worker is done


@dataclass(slots=True)
class _Answer:
    """What ``get_num_new_matched_tokens`` last answered for a request, for its allocation."""

    local_tokens: int  # vLLM's own hit, as it asked
    asynchronous: bool = False  # its load goes off the step


class SchedulerSide:
    """Lookups, load plans and save plans; see the module docstring."""

    def __init__(
        self,
        store: KVClient,
        groups: Sequence[PageFormat],
        hash_block_size: int,
        events: SessionEvents | None = None,
        *,
        lookup_wait_s: float = WAIT_S,
        lookup_wait_share: float = WAIT_SHARE,
        lookup_deadline_s: float = DEADLINE_S,
        lookup_deadline_share: float = SHARE,
        async_load_bytes: int = ASYNC_LOAD_BYTES,
        held: HeldBlocks | None = None,
    ) -> None:
        pages = groups[lookup_group(groups)]
        if hash_block_size <= 0 or pages.block_size % hash_block_size:
            raise KVStoreError(
                f"vLLM's block size {pages.block_size} is not a multiple of its hash block "
                f"size {hash_block_size}"
            )
        self._store = store
        self._groups = tuple(groups)
        self._pages = pages  # the group lookups ask for
        self._hashes_per_block = pages.block_size // hash_block_size
        self._block_keys = BlockKeys(pages)
        # The blocks remembered as held; None: every ask waits for its lookup.
        self._held = held
        self.lookups = Lookups(
            self._cached_blocks,
            lookup_wait_s,
            lookup_deadline_s,
            lookup_deadline_share,
            wait_share=lookup_wait_share,
        )
        self._answers: dict[str, _Answer] = {}  # req id -> what the last ask answered
        # The fewest blocks loaded asynchronously: async_load_bytes of KV, rounded up;
        # with several groups, every load (vLLM takes no block-level load error then).
        block_bytes = sum(group.block_bytes for group in groups)
        self._async_load_blocks = (
            1 if len(groups) > 1 else max(1, -(-async_load_bytes // block_bytes))
        )
        self._loads: dict[str, list[BlockTransfer]] = {}  # planned, not yet in a step's metadata
        self._loading: set[str] = set()  # asynchronous loads on their way
        self._tracked: dict[str, _Tracked] = {}
        self._events = events

    def block_hashes(self, request: Any, start: int = 0, stop: int | None = None) -> list[bytes]:
        """vLLM's hash of each full KV block ``start .. stop - 1`` of ``request`` (all of
        them by default).

        vLLM may hash finer than it allocates (``hash_block_size``); the hashes
        are chained, so the last hash inside a block names the whole prefix up
        to the block's end.
        """
        step = self._hashes_per_block
        end = None if stop is None else stop * step
        hashes: list[bytes] = request.block_hashes[(start + 1) * step - 1 : end : step]
        return hashes

    def _hashed(self, request: Any) -> int:
        """How many of ``request``'s blocks vLLM has hashed (its full blocks)."""
        return len(request.block_hashes) // self._hashes_per_block

    def keys(self, request: Any, hashes: Sequence[bytes]) -> list[ChunkKey]:
        """The keys of ``hashes`` (``block_hashes(request)`` or a head of it)."""
        return self._block_keys.keys(request.cache_salt, hashes)

    def _loadable(self, request: Any) -> int:
        """Blocks of ``request`` that may be loaded: whole, hashed blocks, never the one
        holding its last token (vLLM must compute at least one token to sample from)."""
        return min(self._hashed(request), (request.num_tokens - 1) // self._pages.block_size)

    def arrived(self, request: Any) -> None:
        """A request was added (``on_new_request``): send its lookup now, so that it is
        answered, as a rule, before the scheduler asks."""
        if self._loadable(request) > 0:
            self.lookups.send(request)

    def _cached_blocks(self, request: Any) -> int:
        """The lookup thread's work: leading blocks of ``request`` cached and worth loading."""
        hashes = self.block_hashes(request, stop=self._loadable(request))
        mark = self._held.mark() if self._held is not None else 0
        try:
            prefix = self._store.lookup(
                self._pages.namespace(request.cache_salt), self.keys(request, hashes)
            )
        except KVStoreError as error:
            log.warning("kvstore lookup for request %s failed: %s", request.request_id, error)
            return 0
        cached = prefix.num_chunks if prefix.load_chunks is None else prefix.load_chunks
        cached = min(cached, prefix.num_chunks)
        if self._held is not None:
            self._held.found(request.cache_salt, hashes, cached, mark)
        return cached

    def _recalled_blocks(self, request: Any, first: int) -> int:
        """The leading blocks of ``request`` the scheduler remembers the store holds
        beyond vLLM's own ``first`` (0: none beyond them)."""
        if self._held is None:
            return 0
        hashes = self.block_hashes(request, first, self._loadable(request))
        run = self._held.run(request.cache_salt, hashes)
        return first + run if run else 0

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own hit) that kvstore holds, and
        whether to load them asynchronously (``client.vllm.loads``); ``None`` while the
        request's lookup is on its way (``client.vllm.lookups``)."""
        size = self._pages.block_size
        first = num_computed_tokens // size
        answer = self._answers[request.request_id] = _Answer(num_computed_tokens)
        if self._loadable(request) <= first:
            return 0, False
        cached = self.lookups.answer(request, lambda: self._recalled_blocks(request, first))
        if cached is None:
            return None, False
        blocks = max(0, cached - first)
        answer.asynchronous = blocks >= self._async_load_blocks
        return blocks * size, answer.asynchronous

    @property
    def frees_blocks_while_running(self) -> bool:
        """Whether vLLM frees a running request's blocks (a sliding window moving on), so
        that a step may reuse blocks a previous step's gather still reads."""
        return any(group.sliding_window is not None for group in self._groups)

    def allocated(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks, per KV cache group);
        plan the load."""
        req_id = request.request_id
        self.lookups.forget(req_id)
        # Allocated again when it comes back from preemption: the workers still hold the
        # saves planned before, so vLLM must hold it at its end and hear of it once.
        before = self._tracked.get(req_id)
        saving = before is not None and before.saving
        self._tracked[req_id] = _Tracked(request, [list(ids) for ids in block_ids], saving=saving)
        self._loads.pop(req_id, None)
        answer = self._answers.get(req_id, _Answer(0))
        local = answer.local_tokens
        size = self._pages.block_size
        num_external_tokens = max(0, num_external_tokens)
        if self._events is None and not num_external_tokens:
            return
        if self._events is not None:
            prompt = self.block_hashes(request, stop=request.num_prompt_tokens // size)
            self._events.started(request, self.keys(request, prompt), local, num_external_tokens)
        if num_external_tokens <= 0:
            return
        first = local // size
        end = first + num_external_tokens // size
        hashed = self._hashed(request)
        allocated = min(len(ids) for ids in block_ids)
        if end > hashed or end > allocated or num_external_tokens % size:
            raise KVStoreError(
                f"vLLM asked to load {num_external_tokens} tokens of request {req_id} from "
                f"block {first}, past its {hashed} hashed and {allocated} allocated blocks"
            )
        hashes = self.block_hashes(request, first, end)
        planned = (
            self._transfer(request, group, first, hashes, ids[first:end], None, answer.asynchronous)
            for group, ids in enumerate(block_ids)
        )
        self._loads[req_id] = [transfer for transfer in planned if transfer is not None]

    def _transfer(
        self,
        request: Any,
        group: int,
        first: int,
        hashes: list[bytes],
        block_ids: Sequence[int],
        parent: bytes | None,
        asynchronous: bool = False,
    ) -> BlockTransfer | None:
        """Blocks ``first ..`` of ``request`` in ``group``'s pages ``block_ids``, from the
        first after vLLM's null block (a sliding window's blocks before it have no
        pages); ``None`` if none has. ``parent``: the hash of block ``first - 1``."""
        skip = len(block_ids)
        while skip and block_ids[skip - 1] != NULL_BLOCK_ID:
            skip -= 1
        if skip == len(block_ids):
            return None
        if skip:
            parent = hashes[skip - 1]
        return BlockTransfer(
            request.request_id,
            request.cache_salt,
            first + skip,
            tuple(hashes[skip:]),
            tuple(block_ids[skip:]),
            parent,
            asynchronous,
            group,
        )

    def step(self, scheduler_output: Any) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
        """This step's loads and saves (``build_connector_meta``); resets the pending loads."""
        self.lookups.new_step(sum(scheduler_output.num_scheduled_tokens.values()))
        loads = [load for planned in self._loads.values() for load in planned]
        self._loads.clear()
        self._loading.update(load.req_id for load in loads if load.asynchronous)
        saves: list[BlockTransfer] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = [list(ids) for ids in new.block_ids]
            tracked.saved = new.num_computed_tokens // self._pages.block_size
            self._plan_save(tracked, new.num_computed_tokens, scheduled.get(new.req_id, 0), saves)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            computed = cached.num_computed_tokens[index]
            if req_id in cached.resumed_req_ids:
                # Back from preemption: new_block_ids is its whole block list, and
                # what it computes from here on is all that is new to save.
                tracked.block_ids = [list(ids) for ids in new_block_ids or ()]
                tracked.saved = computed // self._pages.block_size
            elif new_block_ids is not None:
                for ids, new_ids in zip(tracked.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids)
            tracked.saved = min(tracked.saved, computed // self._pages.block_size)
            self._plan_save(tracked, computed, scheduled.get(req_id, 0), saves)
        return loads, saves

    def _plan_save(
        self, tracked: _Tracked, computed: int, scheduled: int, saves: list[BlockTransfer]
    ) -> None:
        request = tracked.request
        end = min(
            self._hashed(request),
            min((len(ids) for ids in tracked.block_ids), default=0),
            (computed + scheduled) // self._pages.block_size,
        )
        first = tracked.saved
        if end <= first:
            return
        hashes = self.block_hashes(request, max(0, first - 1), end)  # the parent's too
        parent = hashes.pop(0) if first else None
        if self._held is not None:
            self._held.saved(request.cache_salt, hashes)
        for group, ids in enumerate(tracked.block_ids):
            transfer = self._transfer(request, group, first, hashes, ids[first:end], parent)
            if transfer is not None:
                saves.append(transfer)
        tracked.saved = end
        tracked.saving = True

    def close(self) -> None:
        """Stop the lookups; send the session events still queued (``SessionEvents.close``)."""
        self.lookups.close()
        if self._events is not None:
            self._events.close()

    def loaded(self, req_ids: set[str]) -> None:
        """The workers named these requests' asynchronous loads done (``get_finished``)."""
        self._loading -= req_ids

    def finished(self, request: Any) -> bool:
        """Forget ``request`` (``request_finished``); whether vLLM must hold its blocks
        until the workers name it in ``get_finished``: it had a save planned, which a
        worker may still be putting, or its asynchronous load is on its way."""
        if self._events is not None:
            self._events.finished(request, self.keys(request, self.block_hashes(request)))
        req_id = request.request_id
        self.lookups.forget(req_id, ended=True)
        tracked = self._tracked.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._answers.pop(req_id, None)
        if req_id in self._loading:
            self._loading.discard(req_id)
            return True  # named when its load is done, as finished receiving
        return tracked is not None and tracked.saving

"""What other processes may do with a store's blocks, through a daemon: copy them out
of shared memory under a lease, and put blocks that landed straight in its arena.

A ``TieredStore`` is all an embedded engine needs. A daemon serving other
processes needs two more paths, which ``TieredStore.serving()`` hands it:

* out: a same-host client copies blocks straight out of the arena under a
  lease (``share``): the DRAM arena, mapped read-only, and the HBM arena,
  opened by its handle (``hbm_handle``) when the client can copy device
  memory; a bytes get sends blocks from where they lie
  (``serve`` / ``read_served`` / ``release_served``);
* in: received blocks are stored as they came (``put_blocks``), and a put's
  blocks are written off the socket straight into reserved arena space and
  verified there (``reserve`` ... ``put_landed``: ``kvstore.store.reservation``,
  driven by ``kvstore.server.landing``).

``SharedServing`` keeps no state of its own: it works under the store's lock on
its index, placement and counters (``kvstore.store.state``), as ``TieredStore``
does, and the daemon reaches none of them but through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import (
    HEADER_BYTES,
    Block,
    check_identity,
    check_payload_size,
    encode_block,
    parse_header,
)
from kvstore.codec import Codec
from kvstore.errors import CorruptBlock, KVStoreError
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.store.config import StoreConfig
from kvstore.store.core import StoreCore
from kvstore.store.reservation import Filled, Reservation
from kvstore.tiers.arena_handle import ArenaHandle, SharedDeviceTier
from kvstore.tiers.arena_tier import ArenaTier
from kvstore.tiers.dram import DRAMTier


@dataclass(frozen=True, slots=True)
class SharedBlock:
    """Where a pinned block lies in a shared arena: DRAM's, or HBM's (``tier``)."""

    key: ChunkKey
    offset: int
    nbytes: int
    generation: int = 0  # of its extent when pinned (``ArenaTier.extent_of``)
    tier: TierKind = TierKind.DRAM


@dataclass(slots=True)
class ServedGet:
    """A get whose caller sends each block from where it lies (``SharedServing.serve``).

    Block ``i`` is ``shared[i]`` when DRAM holds it: the caller sends a view of
    the arena (``arena_view``) instead of a copy. Otherwise, if ``lengths[i]``
    is not ``None``, a lower tier holds it and ``read_served`` fetches it.
    ``lengths`` are known before anything is read, so a response can state
    every block's size up front; ``None`` is a miss. ``tiers[i]`` is the tier
    the block was found in. Every key in ``pinned`` stays pinned (not evictable)
    until ``release_served``. ``lost`` counts blocks that ``read_served`` found
    gone after all.
    """

    namespace: Namespace
    keys: list[ChunkKey]
    shared: list[SharedBlock | None]
    lengths: list[int | None]
    tiers: list[TierKind | None]
    pinned: list[ChunkKey]
    lost: int = 0


class SharedServing:
    """Shared-memory gets and landed puts over one ``TieredStore`` (module docstring)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._state = core.state

    @property
    def config(self) -> StoreConfig:
        return self._core.config

    def _dram(self) -> DRAMTier | None:
        guarded = self._state.placement.tiers.get(TierKind.DRAM)
        return guarded.tier if guarded is not None and isinstance(guarded.tier, DRAMTier) else None

    def _hbm(self) -> ArenaTier | None:
        """The HBM tier, if there is one and its arena can be shared."""
        guarded = self._state.placement.tiers.get(TierKind.HBM)
        tier = guarded.tier if guarded is not None else None
        if isinstance(tier, ArenaTier) and _handle(tier) is not None:
            return tier
        return None

    @property
    def hbm_handle(self) -> ArenaHandle | None:
        """How a client opens the HBM arena (``None``: no HBM tier, or not shared)."""
        hbm = self._hbm()
        return _handle(hbm) if hbm is not None else None

    def generation_offset(self, block: SharedBlock) -> int:
        """Where a shared block's generation counter lies in its tier's segment."""
        tier = self._dram() if block.tier is TierKind.DRAM else self._hbm()
        assert isinstance(tier, DRAMTier | SharedDeviceTier), "shared only from such tiers"
        return tier.generation_offset(block.offset)

    def dram_prefault(self) -> tuple[int, bool] | None:
        """How far the DRAM arena's pages are populated (bytes, whether done), if they
        are being populated in the background (``tiers.prefault``)."""
        dram = self._dram()
        prefault = dram.arena.prefault if dram is not None else None
        return None if prefault is None else (prefault.populated_bytes, prefault.done)

    @property
    def shared_memory_name(self) -> str | None:
        """Name of the DRAM arena's shared-memory segment (``None`` without a DRAM tier)."""
        dram = self._dram()
        return dram.arena.name if dram is not None else None

    def share(
        self, namespace: Namespace, keys: Sequence[ChunkKey], *, hbm: bool = False
    ) -> list[SharedBlock | None]:
        """Pin each key held in DRAM (or, with ``hbm``, in a shared HBM arena) and say
        where its block lies in that arena.

        For same-host clients that map the DRAM arena (``shared_memory_name``),
        and with ``hbm`` open the HBM arena (``hbm_handle``), and copy blocks out
        themselves: a block in both is shared from HBM, the cheaper copy into
        device memory. Every key returned (not ``None``) stays pinned, so it
        cannot be evicted and its extent cannot be reused, until the caller
        ``unpin``s it. Other keys are ``None`` and not pinned. The blocks shared
        count as hits of their tier.
        """
        tiers = self._shared_tiers(hbm=hbm)
        with self._state.lock:
            self._core.check_open()
            shared = [self._pin_shared(tiers, namespace, key) for key in keys]
            self._count_shared(shared)
        return shared

    def serve(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> ServedGet:
        """Begin a get that the caller sends block by block (the daemon's bytes get).

        Blocks in DRAM are pinned and shared, to be sent straight from the
        arena; the others are located and pinned, to be read with
        ``read_served`` as the sending reaches them. A block read from a
        compressed tier is sent re-framed uncompressed, so every block's length
        is known now. Always end with ``release_served``, whatever happened.
        """
        keys = list(keys)
        located = self._core.locate(namespace, keys)
        dram = self._shared_tiers(hbm=False)
        framed_bytes = HEADER_BYTES + namespace.layout.chunk_nbytes
        with self._state.lock:
            self._core.check_open()
            shared = [
                None if tier is None else self._pin_shared(dram, namespace, key)
                for key, tier in zip(keys, located, strict=True)
            ]
            elsewhere = [
                key
                for key, block, tier in zip(keys, shared, located, strict=True)
                if block is None and tier is not None
            ]
            pinned = [block.key for block in shared if block is not None]
            pinned += self._state.index.pin(elsewhere)
            self._count_shared(shared)
        return ServedGet(
            namespace,
            keys,
            shared,
            lengths=[
                block.nbytes if block else None if tier is None else framed_bytes
                for block, tier in zip(shared, located, strict=True)
            ],
            tiers=[
                TierKind.DRAM if block else tier
                for block, tier in zip(shared, located, strict=True)
            ],
            pinned=pinned,
        )

    def read_served(self, served: ServedGet, indices: Sequence[int]) -> list[memoryview | None]:
        """The blocks ``indices`` of ``served`` that no DRAM extent was shared for, read,
        verified and framed as ``served.lengths`` says; ``None`` for a block lost since
        ``serve`` (deleted, or failing verification in every tier holding it)."""
        namespace = served.namespace
        keys = [served.keys[index] for index in indices]
        chunks = self._core.read(namespace, keys)
        blocks: list[memoryview | None] = []
        for index, chunk in zip(indices, chunks, strict=True):
            block = None
            if chunk is not None:
                block = chunk.block
                if block is None:  # stored compressed: sent uncompressed
                    framed = encode_block(namespace, chunk.key, None, chunk.payload)
                    block = memoryview(framed.to_bytes())
                if block.nbytes != served.lengths[index]:
                    block = None
            blocks.append(block)
        with self._state.lock:
            self._core.after_hits(namespace, keys, chunks)
            served.lost += blocks.count(None)
        return blocks

    def release_served(self, served: ServedGet, *, continues: bool = False) -> None:
        """Unpin what ``serve`` pinned, and count the get and its misses; ``continues``:
        it reads what a shared-memory get left inline, which counted the get already."""
        with self._state.lock:
            self._state.placement.unpin(served.pinned)
            served.pinned = []
            self._state.stats.gets += not continues
            self._state.stats.get_misses += served.lengths.count(None) + served.lost

    def count_shared_get(self, missing: int) -> None:
        """Count a shared-memory get and the chunks it found nowhere (its DRAM hits were
        counted by ``share``; the ones held below are read by a get that continues it)."""
        with self._state.lock:
            self._state.stats.gets += 1
            self._state.stats.get_misses += missing

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Unpin what ``share`` pinned (a lease given back or expired)."""
        with self._state.lock:
            self._state.placement.unpin(keys)

    def locate(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> list[TierKind | None]:
        """The fastest tier holding each key (``StoreCore.locate``)."""
        return self._core.locate(namespace, keys)

    def namespace(self, digest: bytes) -> Namespace:
        """The registered namespace with this digest; ``UnknownNamespace`` otherwise."""
        return self._core.namespace(digest)

    def arena_view(self, block: SharedBlock) -> memoryview:
        """A read-only view of a shared (pinned) block in the DRAM arena."""
        dram = self._dram()
        if dram is None:
            raise KVStoreError("this store has no DRAM tier")
        return dram.arena.view(block.offset, block.nbytes)

    def _shared_tiers(self, *, hbm: bool) -> list[ArenaTier]:
        """The arenas a block may be shared from, in the order they are preferred."""
        candidates = (self._hbm() if hbm else None, self._dram())
        return [tier for tier in candidates if tier is not None]

    def _pin_shared(
        self, tiers: Sequence[ArenaTier], namespace: Namespace, key: ChunkKey
    ) -> SharedBlock | None:
        """Pin ``key`` and say where it lies in the first of ``tiers`` holding it;
        ``None`` if none does. Lock held."""
        meta = self._state.index.get(key)
        if meta is None:
            return None
        for tier in tiers:
            if tier.kind not in meta.sizes:
                continue
            extent = tier.extent_of(namespace.digest, key)
            if extent is not None:
                self._state.index.pin([key])
                return SharedBlock(key, extent.offset, extent.nbytes, extent.generation, tier.kind)
        return None

    def _count_shared(self, shared: Sequence[SharedBlock | None]) -> None:
        """Count shared blocks as hits of their tiers and mark them used. Lock held."""
        served = [block for block in shared if block is not None]
        for block in served:
            counters = self._state.stats.tier(block.tier)
            counters.hits += 1
            counters.bytes_read += block.nbytes
        if served:
            self._state.placement.touch([block.key for block in served])

    def reserve(
        self, nbytes: int, codec: Codec, protect: frozenset[ChunkKey]
    ) -> Reservation | None:
        """Space in the DRAM arena for a received block of ``nbytes`` in ``codec``,
        evicting for it as a put would (never ``protect``); ``None`` when the block must
        go the usual way (DRAM is not the fastest tier, stores another codec, or cannot
        make room). The caller fills it and hands it to ``put_landed`` or aborts it."""
        with self._state.lock:
            placement = self._state.placement
            dram = self._dram()
            if (
                self._core.closed
                or dram is None
                or placement.fastest is not TierKind.DRAM
                or placement.codec(TierKind.DRAM) is not codec
            ):
                return None
            offset = placement.reserve(TierKind.DRAM, nbytes, protect)
            if offset is None:
                return None
            space = dram.arena.writable(offset, nbytes)
            return Reservation(TierKind.DRAM, offset, nbytes, space, self)

    def give_back(self, reservations: Sequence[Reservation]) -> None:
        """End the reservations still open, their space unused."""
        with self._state.lock:
            self._state.placement.unreserve(TierKind.DRAM, reservations)

    def put_blocks(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        blocks: Sequence[Block | None],
        *,
        session: str | None = None,
    ) -> int:
        """``put`` for chunks that arrive as complete blocks (the daemon's puts): each
        block is stored as it came, not hashed or framed again, unless the fastest
        tier has a codec other than the block's (then it is re-encoded for it).

        The caller has verified every checksum (the block crossed a trust
        boundary to get here). What the store relies on is checked again here,
        cheaply, before anything is stored: each header parses, names the key,
        namespace and layout it is stored under, holds exactly one chunk, and
        says how long its payload is.
        """
        self._core.register(namespace)
        chain = self._core.chain(namespace, keys, len(blocks))
        present = {index: block for index, block in enumerate(blocks) if block is not None}
        for index, block in present.items():
            _check_framed(namespace, chain[index], block)
        placement = self._state.placement

        def frame(index: int, parent: ChunkKey | None) -> Block:
            return placement.reencode(present[index], placement.fastest)

        return self._core.store_chain(namespace, chain, list(present), frame, session)

    def put_landed(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        blocks: Sequence[Block | Filled | None],
        *,
        session: str | None = None,
    ) -> int:
        """``put_blocks`` for a put some of whose blocks were written and verified in
        reservations (``kvstore.server.landing``). Those are published, unless their
        key is held already (then given back); the others are stored as
        ``put_blocks`` stores them. Every reservation in ``blocks`` ends here,
        published or given back, whatever happens."""
        filled = [block for block in blocks if isinstance(block, Filled)]
        published: set[ChunkKey] = set()
        try:
            others = [None if isinstance(block, Filled) else block for block in blocks]
            stored = self.put_blocks(namespace, keys, others, session=session)
            core, state = self._core, self._state
            with state.lock:
                core.check_open()
                fresh = [entry for entry in filled if core.needs_storing(namespace, entry.key)]
                published = state.placement.publish(TierKind.DRAM, namespace.digest, fresh, session)
                state.stats.chunks_stored += len(published)
            core.stored(namespace, [entry.key for entry in fresh])
        finally:
            self.give_back([entry.reservation for entry in filled])
        return stored + len(published)


def _handle(tier: object) -> ArenaHandle | None:
    """How clients open ``tier``'s arena, if it is one they may open."""
    return tier.handle() if isinstance(tier, SharedDeviceTier) else None


def _check_framed(namespace: Namespace, key: ChunkKey, block: Block) -> None:
    """Refuse a received block that is not one whole chunk of ``key`` in ``namespace``
    (structure and identity only: the checksum was verified on arrival)."""
    if len(block.header) != HEADER_BYTES:
        raise CorruptBlock(f"block {key.hex()}: a header of {len(block.header)} bytes")
    header = parse_header(block.header)
    check_identity(header, namespace, key, whole_chunk=True)
    check_payload_size(header, block.payload.nbytes)

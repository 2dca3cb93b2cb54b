"""``Placement``: admission, write-back eviction, spill, reservations and codecs over real tiers.

These mechanics decide where every block lives; each scenario checks exactly which keys end where.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import kv

from kvstore.block import HEADER_BYTES, Block, Codec, parse_header
from kvstore.codec import CodecSpec, decode_payload
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.chunk import chunk_bytes
from kvstore.store.eviction import LRUPolicy, Occupancy
from kvstore.store.guarded import GuardedTier
from kvstore.store.index import BlockIndex, BlockMeta
from kvstore.store.placement import Admission, Placement
from kvstore.store.reservation import Filled, Reservation
from kvstore.store.stats import StoreStats
from kvstore.tiers.base import Tier
from kvstore.tiers.dram import DRAMTier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.lmdb_tier import LMDBTier

HBM, DRAM, SSD, REDIS = TierKind.HBM, TierKind.DRAM, TierKind.SSD, TierKind.REDIS
NS = kv.namespace()
A = chunk_keys(NS, kv.tokens(5))  # one chain, head first
B = chunk_keys(NS, kv.tokens(2, start=10_000))
PARENT = {key: chain[i - 1] if i else None for chain in (A, B) for i, key in enumerate(chain)}
RAW = dict(zip(A + B, [bytes(chunk_bytes(t, kv.LAYOUT)) for t in kv.chunks(7)], strict=True))
BLOCK_BYTES = HEADER_BYTES + kv.LAYOUT.chunk_nbytes  # 2176, one arena page each


class Routed(LRUPolicy):
    """LRU order; victims of a tier go where ``routes`` says (``None``: the next tier)."""

    def __init__(self) -> None:
        super().__init__()
        self.routes: dict[TierKind, TierKind] = {}

    def destination(
        self, tier: TierKind, key: ChunkKey, occupancy: Occupancy
    ) -> TierKind | None:
        return self.routes.get(tier)


@dataclass
class Stack:
    placement: Placement
    index: BlockIndex
    policy: LRUPolicy
    stats: StoreStats

    def admit(
        self,
        kind: TierKind,
        keys: list[ChunkKey],
        protect: frozenset[ChunkKey] = frozenset(),
        session: str | None = None,
    ) -> set[ChunkKey]:
        admissions = self.admissions(kind, keys)
        return self.placement.admit(kind, NS.digest, admissions, protect=protect, session=session)

    def admissions(self, kind: TierKind, keys: list[ChunkKey]) -> list[Admission]:
        encode = self.placement.encode
        return [
            Admission(k, encode(NS, k, PARENT[k], memoryview(RAW[k]), kind), PARENT[k])
            for k in keys
        ]

    def where(self, key: ChunkKey) -> dict[TierKind, int]:
        meta = self.index.get(key)
        return dict(meta.sizes) if meta is not None else {}

    def stored(self, kind: TierKind, keys: list[ChunkKey]) -> list[bool]:
        """What the tier itself holds, whatever the index says."""
        return self.placement.tiers[kind].contains_many(NS.digest, keys) or []

    def meta(self, key: ChunkKey) -> BlockMeta:
        meta = self.index.get(key)
        assert meta is not None
        return meta


Build = Callable[..., Stack]


@pytest.fixture
def build(tmp_path: Path) -> Iterator[Build]:
    opened: list[Tier] = []

    def make(
        hbm: int = 0,
        dram: int = 0,
        ssd: int = 0,
        ssd_codec: str = "none",
        policy: LRUPolicy | None = None,
    ) -> Stack:
        """Slots of HBM (on CPU) and DRAM, bytes of LMDB; a tier of size 0 is left out."""
        tiers: dict[TierKind, Tier] = {}
        if hbm:
            tiers[HBM] = HBMTier(hbm * kv.ARENA_SLOT, device="cpu")
        if dram:
            tiers[DRAM] = DRAMTier(dram * kv.ARENA_SLOT)
        if ssd:
            tiers[SSD] = LMDBTier(tmp_path / "lmdb", ssd, sync=False)
        opened.extend(tiers.values())
        stats, lock = StoreStats(), threading.RLock()
        guarded = {kind: GuardedTier(tier, stats.tier(kind), lock) for kind, tier in tiers.items()}
        codecs = {kind: CodecSpec.parse(ssd_codec if kind is SSD else "none") for kind in tiers}
        index, lru = BlockIndex(), policy or LRUPolicy()
        return Stack(Placement(guarded, codecs, index, lru, stats), index, lru, stats)

    yield make
    for tier in opened:
        tier.close()


def test_admit_records_a_block_once_the_tier_holds_it(build: Build) -> None:
    stack = build(dram=4, ssd=1 << 20)
    assert stack.admit(DRAM, A[:3], session="s1") == set(A[:3])
    assert stack.stored(DRAM, A[:3]) == [True, True, True]
    for key in A[:3]:
        assert stack.meta(key) == BlockMeta(NS.digest, PARENT[key], {DRAM: BLOCK_BYTES}, 0, "s1")
    assert stack.stats.tier(DRAM).bytes_written == 3 * BLOCK_BYTES
    assert stack.stats.tier(SSD).bytes_written == 0
    assert list(stack.policy.victims(DRAM)) == [A[2], A[1], A[0]]  # tail before head


def test_a_full_tier_writes_its_least_recent_block_back_to_the_next_tier(build: Build) -> None:
    stack = build(dram=3, ssd=1 << 20)
    stack.admit(DRAM, A[:3])
    assert stack.admit(DRAM, B[:1]) == {B[0]}
    assert [stack.where(key) for key in A[:3]] == [
        {DRAM: BLOCK_BYTES},
        {DRAM: BLOCK_BYTES},
        {SSD: BLOCK_BYTES},
    ]
    assert stack.stored(DRAM, [A[2], B[0]]) == [False, True]
    assert stack.stored(SSD, [A[2], B[0]]) == [True, False]
    dram, ssd = stack.stats.tier(DRAM), stack.stats.tier(SSD)
    assert (dram.demotions, dram.evictions, ssd.bytes_written) == (1, 0, BLOCK_BYTES)
    assert stack.placement.tiers[DRAM].used_bytes() == 3 * kv.ARENA_SLOT


class LeavesOnly(LRUPolicy):
    """LRU order, of which the store takes leaves only."""

    leaves_only = True


def test_a_policy_that_asks_for_leaves_gets_only_leaves_whatever_its_order(build: Build) -> None:
    stack = build(dram=3, ssd=1 << 20, policy=LeavesOnly())
    stack.admit(DRAM, A[:2])
    stack.admit(DRAM, A[2:3])  # a later call extends the chain
    assert list(stack.policy.victims(DRAM)) == [A[1], A[0], A[2]]  # least recent first
    assert stack.admit(DRAM, B[:1]) == {B[0]}
    # LRU's first victim, A[1], is the middle of a cached chain: the tail goes instead.
    assert [set(stack.where(key)) for key in A[:3]] == [{DRAM}, {DRAM}, {SSD}]
    assert stack.admit(DRAM, B[1:2]) == {B[1]}
    assert [set(stack.where(key)) for key in A[:3]] == [{DRAM}, {SSD}, {SSD}]


def test_a_chain_longer_than_the_tier_keeps_its_head_and_spills_its_tail(build: Build) -> None:
    stack = build(dram=3, ssd=1 << 20)
    assert stack.admit(DRAM, A) == set(A)
    assert [set(stack.where(key)) for key in A] == [{DRAM}, {DRAM}, {DRAM}, {SSD}, {SSD}]
    assert stack.stored(SSD, A) == [False, False, False, True, True]
    dram = stack.stats.tier(DRAM)
    assert (dram.demotions, dram.evictions, dram.bytes_written) == (0, 0, 3 * BLOCK_BYTES)
    assert stack.placement.tiers[DRAM].used_bytes() == 3 * kv.ARENA_SLOT


def test_a_failing_tier_passes_its_batch_down(build: Build) -> None:
    stack = build(dram=2, ssd=1 << 20)
    stack.placement.tiers[DRAM].tier.close()  # every DRAM call now raises TierUnavailable
    assert stack.admit(DRAM, A[:2]) == set(A[:2])
    assert [stack.where(key) for key in A[:2]] == [{SSD: BLOCK_BYTES}] * 2
    assert stack.stats.tier(DRAM).bytes_written == 0


def test_the_last_tier_drops_its_victims_for_good(build: Build) -> None:
    stack = build(dram=2)
    stack.admit(DRAM, A[:2])
    assert stack.admit(DRAM, B[:1]) == {B[0]}
    assert A[1] not in stack.index and stack.stored(DRAM, [A[0], A[1], B[0]]) == [True, False, True]
    assert (stack.stats.tier(DRAM).evictions, stack.stats.tier(DRAM).demotions) == (1, 0)


def test_a_pinned_block_is_never_a_victim(build: Build) -> None:
    stack = build(dram=3, ssd=1 << 20)
    stack.admit(DRAM, A[:3])
    assert stack.index.pin([A[2]]) == [A[2]]
    stack.admit(DRAM, B[:1])
    assert set(stack.where(A[2])) == {DRAM} and set(stack.where(A[1])) == {SSD}
    assert stack.stats.tier(DRAM).demotions == 1


class Walks(LRUPolicy):
    """LRU order, counting the walks of each tier's victims."""

    def __init__(self) -> None:
        super().__init__()
        self.walks: dict[TierKind, int] = {}

    def victims(self, tier: TierKind) -> Iterator[ChunkKey]:
        self.walks[tier] = self.walks.get(tier, 0) + 1
        return super().victims(tier)


def test_a_tier_full_of_pinned_blocks_is_walked_once_per_admission_not_per_block(
    build: Build,
) -> None:
    walks = Walks()
    stack = build(dram=3, ssd=1 << 20, policy=walks)
    stack.admit(DRAM, A[:3])
    stack.index.pin(A[:3])  # running requests' KV: nothing in DRAM may go
    assert stack.admit(DRAM, A[3:] + B) == set(A[3:] + B)
    assert [set(stack.where(key)) for key in A[3:] + B] == [{SSD}] * 4
    assert [set(stack.where(key)) for key in A[:3]] == [{DRAM}] * 3
    assert walks.walks[DRAM] == 1


def test_protected_blocks_stay_and_what_fits_nowhere_spills_or_is_dropped(build: Build) -> None:
    stack = build(dram=2, ssd=1 << 20)
    stack.admit(DRAM, A[:2])
    assert stack.admit(DRAM, B[:1], protect=frozenset(A[:2])) == {B[0]}
    assert [set(stack.where(key)) for key in (A[0], A[1], B[0])] == [{DRAM}, {DRAM}, {SSD}]
    assert stack.stats.tier(DRAM).demotions == 0
    alone = build(dram=2, ssd=0)  # nothing below: the block is dropped, nobody else is
    alone.admit(DRAM, A[:2])
    assert alone.admit(DRAM, B[:1], protect=frozenset(A[:2])) == set()
    assert B[0] not in alone.index and alone.stored(DRAM, A[:2]) == [True, True]


def test_evict_writes_back_into_the_tier_named_or_drops(build: Build) -> None:
    stack = build(hbm=2, dram=2, ssd=1 << 20)
    stack.admit(HBM, A[:2])
    stack.placement.evict(HBM, A[0], stack.meta(A[0]), to=SSD)
    assert stack.where(A[0]) == {SSD: BLOCK_BYTES}
    assert stack.stored(DRAM, [A[0]]) == [False] and stack.stored(SSD, [A[0]]) == [True]
    stack.placement.evict(HBM, A[1], stack.meta(A[1]), drop=True)
    assert A[1] not in stack.index
    assert stack.stored(DRAM, [A[1]]) == [False] and stack.stored(SSD, [A[1]]) == [False]
    hbm = stack.stats.tier(HBM)
    assert (hbm.demotions, hbm.evictions, stack.stats.tier(DRAM).bytes_written) == (1, 1, 0)


def test_evict_writes_back_to_the_next_tier_though_a_slower_one_holds_a_copy(
    build: Build,
) -> None:
    """Context that once spilled to SSD and was read back must not be served from SSD
    for ever after: leaving HBM, it is written to DRAM."""
    stack = build(hbm=2, dram=2, ssd=1 << 20)
    stack.admit(SSD, A[:1])
    stack.admit(HBM, A[:1])
    stack.placement.evict(HBM, A[0], stack.meta(A[0]))
    assert stack.where(A[0]) == {DRAM: BLOCK_BYTES, SSD: BLOCK_BYTES}
    assert stack.stats.tier(DRAM).bytes_written == BLOCK_BYTES
    assert stack.stats.tier(HBM).demotions == 1


def test_evict_skips_the_write_back_when_the_next_tier_holds_a_copy(build: Build) -> None:
    stack = build(hbm=2, dram=2, ssd=1 << 20)
    stack.admit(DRAM, A[:1])
    stack.admit(HBM, A[:1])
    stack.placement.evict(HBM, A[0], stack.meta(A[0]))
    assert stack.where(A[0]) == {DRAM: BLOCK_BYTES}
    assert stack.stats.tier(DRAM).bytes_written == BLOCK_BYTES  # the first admission only
    assert stack.stats.tier(HBM).demotions == 1


def test_a_victim_goes_where_the_policy_says_if_that_tier_is_configured_and_slower(
    build: Build,
) -> None:
    routed = Routed()
    stack = build(hbm=1, dram=2, ssd=1 << 20, policy=routed)
    routed.routes = {HBM: SSD}
    stack.admit(HBM, A[:1])
    stack.admit(HBM, A[1:2])
    assert stack.where(A[0]) == {SSD: BLOCK_BYTES}
    routed.routes = {HBM: REDIS}  # not configured: the next tier down
    stack.admit(HBM, A[2:3])
    assert stack.where(A[1]) == {DRAM: BLOCK_BYTES}
    routed.routes = {HBM: HBM}  # not slower: the next tier down
    stack.admit(HBM, A[3:4])
    assert stack.where(A[2]) == {DRAM: BLOCK_BYTES}
    assert stack.stats.tier(HBM).demotions == 3 and stack.where(A[3]) == {HBM: BLOCK_BYTES}


def test_a_victim_that_cannot_be_read_back_is_dropped_not_moved(build: Build) -> None:
    stack = build(dram=2, ssd=1 << 20)
    good = stack.admissions(DRAM, A[:1])[0].block
    broken = Block(b"XXXX" + good.header[4:], good.payload)  # bad magic
    assert stack.placement.tiers[DRAM].put_many(NS.digest, [(A[0], broken)])
    stack.index.record(DRAM, A[0], NS.digest, None, broken.nbytes)
    stack.policy.on_access(DRAM, [A[0]])
    assert stack.placement.evict_one(DRAM) is True
    assert A[0] not in stack.index
    assert stack.stored(DRAM, [A[0]]) == [False] and stack.stored(SSD, [A[0]]) == [False]
    dram = stack.stats.tier(DRAM)
    assert (dram.corrupt_blocks, dram.evictions, dram.demotions) == (1, 1, 0)
    assert stack.placement.evict_one(DRAM) is False  # nothing left to evict


def test_forget_deletes_one_copy_and_forget_everywhere_every_copy(build: Build) -> None:
    stack = build(dram=2, ssd=1 << 20)
    stack.admit(SSD, A[:2])
    stack.admit(DRAM, A[:2])
    assert stack.placement.forget(DRAM, NS.digest, A[0]) == 1
    assert stack.where(A[0]) == {SSD: BLOCK_BYTES}
    assert A[0] not in list(stack.policy.victims(DRAM))
    assert stack.placement.forget(DRAM, NS.digest, A[0]) == 0
    assert stack.placement.forget_everywhere(NS.digest, A[1]) is True
    assert A[1] not in stack.index
    assert stack.stored(DRAM, A[:2]) == [False, False]
    assert stack.stored(SSD, A[:2]) == [True, False]
    assert stack.placement.forget_everywhere(NS.digest, A[1]) is False


def test_unpin_completes_a_delete_that_waited_for_the_last_pin(build: Build) -> None:
    stack = build(dram=2, ssd=1 << 20)
    stack.admit(SSD, A[:1])
    stack.admit(DRAM, A[:1])
    stack.index.pin([A[0], A[0]])
    stack.meta(A[0]).deleted = True
    stack.placement.unpin([A[0]])
    assert set(stack.where(A[0])) == {DRAM, SSD}  # a reader still copies it out
    stack.placement.unpin([A[0]])
    assert A[0] not in stack.index
    assert stack.stored(DRAM, A[:1]) == [False] and stack.stored(SSD, A[:1]) == [False]


def test_count_promotions_credits_the_nearest_slower_tier_of_each_promoted_block(
    build: Build,
) -> None:
    stack = build(hbm=1, dram=2, ssd=1 << 20)
    stack.admit(SSD, A[:2])
    stack.admit(DRAM, A[:1])
    promoted = stack.admissions(HBM, A[:2])
    stack.placement.admit(HBM, NS.digest, promoted[:1])  # A[1] never reached HBM
    assert stack.placement.count_promotions(promoted, HBM) == 1
    counts = [stack.stats.tier(kind).promotions for kind in (HBM, DRAM, SSD)]
    assert counts == [0, 1, 0]


def test_codecs_frame_each_tier_its_own_way_and_write_back_reencodes(build: Build) -> None:
    stack = build(dram=1, ssd=1 << 20, ssd_codec="zstd-byteplane:3")
    placement = stack.placement
    assert (placement.codec(DRAM), placement.codec(SSD)) == (Codec.NONE, Codec.ZSTD_BYTEPLANE)
    plain = placement.encode(NS, A[1], A[0], memoryview(RAW[A[1]]), DRAM)
    assert placement.reencode(plain, DRAM) is plain
    packed = placement.reencode(plain, SSD)
    header = parse_header(packed.header)
    assert (header.codec, header.key, header.parent, header.raw_len) == (
        Codec.ZSTD_BYTEPLANE,
        A[1],
        A[0],
        kv.LAYOUT.chunk_nbytes,
    )
    assert (
        bytes(decode_payload(packed.payload, "float16", header.codec, header.raw_len)) == RAW[A[1]]
    )
    back = placement.reencode(packed, DRAM)
    assert (back.header, bytes(back.payload)) == (plain.header, RAW[A[1]])
    stack.admit(DRAM, A[:1])
    stack.admit(DRAM, B[:1])  # A[0] is written back, compressed for the SSD
    stored = placement.tiers[SSD].get_many(NS.digest, [A[0]])
    assert stored is not None and stored[0] is not None
    assert parse_header(stored[0]).codec is Codec.ZSTD_BYTEPLANE
    assert stack.where(A[0]) == {SSD: len(stored[0])} and len(stored[0]) < BLOCK_BYTES


def test_a_reservation_counts_at_once_and_is_indexed_only_once_published(build: Build) -> None:
    stack = build(dram=2, ssd=1 << 20)
    guarded = stack.placement.tiers[DRAM]
    assert isinstance(guarded.tier, DRAMTier)
    arena = guarded.tier.arena

    class Owner:
        def give_back(self, reservations: Sequence[Reservation]) -> None:
            stack.placement.unreserve(DRAM, reservations)

    def reserve(nbytes: int) -> Reservation:
        offset = stack.placement.reserve(DRAM, nbytes, frozenset())
        assert offset is not None
        return Reservation(DRAM, offset, nbytes, arena.writable(offset, nbytes), Owner())

    block = stack.admissions(DRAM, A[:1])[0].block
    reservation = reserve(block.nbytes)
    assert guarded.used_bytes() == kv.ARENA_SLOT
    assert A[0] not in stack.index and stack.stored(DRAM, A[:1]) == [False]
    reservation.view()[:] = block.to_bytes()
    filled = [Filled(A[0], None, reservation)]
    assert stack.placement.publish(DRAM, NS.digest, filled, "s1") == {A[0]}
    assert not reservation.open
    reservation.abort()  # published: nothing to give back
    assert stack.meta(A[0]) == BlockMeta(NS.digest, None, {DRAM: BLOCK_BYTES}, 0, "s1")
    assert guarded.get_many(NS.digest, A[:1]) == [block.to_bytes()]
    assert stack.stats.tier(DRAM).bytes_written == BLOCK_BYTES
    assert list(stack.policy.victims(DRAM)) == [A[0]]
    spare = reserve(BLOCK_BYTES)
    assert guarded.used_bytes() == 2 * kv.ARENA_SLOT
    spare.abort()
    spare.abort()  # once only
    assert guarded.used_bytes() == kv.ARENA_SLOT and stack.index.count(DRAM) == 1


def test_reserve_only_demotes_never_a_protected_block_and_refuses_what_cannot_fit(
    build: Build,
) -> None:
    stack = build(dram=2, ssd=1 << 20)
    stack.admit(DRAM, A[:2])
    assert stack.placement.reserve(DRAM, BLOCK_BYTES, frozenset(A[:2])) is None
    assert stack.stored(DRAM, A[:2]) == [True, True]
    assert stack.placement.reserve(DRAM, BLOCK_BYTES, frozenset(A[:1])) is not None
    assert stack.where(A[1]) == {SSD: BLOCK_BYTES} and stack.stats.tier(DRAM).demotions == 1
    assert stack.placement.reserve(DRAM, 3 * kv.ARENA_SLOT, frozenset()) is None  # over capacity
    assert stack.placement.reserve(SSD, BLOCK_BYTES, frozenset()) is None  # not an arena
    assert stack.stored(DRAM, A[:1]) == [True]
    alone = build(dram=2)  # no tier to write victims back to: free space only
    alone.admit(DRAM, A[:2])
    assert alone.placement.reserve(DRAM, BLOCK_BYTES, frozenset()) is None
    assert alone.stored(DRAM, A[:2]) == [True, True]
    assert alone.stats.tier(DRAM).evictions == 0


def test_reserve_evicts_one_more_when_the_free_space_is_fragmented(build: Build) -> None:
    stack = build(dram=3, ssd=1 << 20)
    stack.admit(DRAM, A[:3])  # one page each, at pages 0, 1 and 2
    stack.placement.forget(DRAM, NS.digest, A[0])
    stack.placement.forget(DRAM, NS.digest, A[2])
    # Two free pages, but not adjacent: A[1] in the middle must go first.
    assert stack.placement.reserve(DRAM, 2 * kv.ARENA_SLOT, frozenset()) == 0
    assert stack.where(A[1]) == {SSD: BLOCK_BYTES}
    assert stack.placement.tiers[DRAM].used_bytes() == 2 * kv.ARENA_SLOT


def test_rebuild_index_restores_persistent_blocks_and_purges_misfiled_ones(build: Build) -> None:
    first = build(ssd=1 << 20)
    first.admit(SSD, A[:2])
    misfiled = first.admissions(SSD, A[2:3])[0].block
    assert first.placement.tiers[SSD].put_many(NS.digest, [(B[0], misfiled)])
    first.placement.tiers[SSD].close()  # the process restarts
    second = build(dram=2, ssd=1 << 20)
    second.placement.rebuild_index()
    assert second.meta(A[0]) == BlockMeta(NS.digest, None, {SSD: BLOCK_BYTES})
    assert second.meta(A[1]) == BlockMeta(NS.digest, A[0], {SSD: BLOCK_BYTES})
    assert B[0] not in second.index and second.stored(SSD, [B[0], *A[:2]]) == [False, True, True]
    assert second.stats.tier(SSD).corrupt_blocks == 1
    assert sorted(second.policy.victims(SSD)) == sorted(A[:2])
    assert second.index.count(DRAM) == 0

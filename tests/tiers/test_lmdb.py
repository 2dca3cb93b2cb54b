"""LMDBTier against a real LMDB environment in a temp dir, and real killed processes.

What must hold: values come back bit for bit; a batch is all or nothing, even
when the map fills or the writer is killed with SIGKILL mid-write; accounting
survives overwrites and restarts; namespaces never alias; a process killed
inside a read transaction does not leave its reader slot behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from support import TESTS
from support.filesystems import small_tmpfs

from kvstore.block import Block, check_identity, encode_block, verify_block
from kvstore.errors import TierError, TierFull, TierRefused, TierUnavailable
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.guarded import GuardedTier
from kvstore.store.stats import StoreStats
from kvstore.tiers import lmdb_tier
from kvstore.tiers.base import Tier
from kvstore.tiers.lmdb_tier import LMDBTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
NS = Namespace("test-model", LAYOUT)
OTHER_NS = Namespace("test-model", LAYOUT, tenant_salt="tenant-b")
# 4 KiB blocks: LMDB writes each as pages of its own, and a disk that fills mid-write
# comes up short (EIO) rather than out of space (ENOSPC).
WIDE_NS = Namespace(
    "wide-model",
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16),
)
# 256 KiB blocks for the crash test, so a kill is likely to land inside a commit.
BIG_NS = Namespace(
    "big-model",
    KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="float16", chunk_tokens=16),
)
BIG_BATCH = 8
CAPACITY = 64 << 20


def make_blocks(ns: Namespace, count: int, seed: int) -> list[tuple[ChunkKey, Block]]:
    """``count`` chained blocks of random payload; distinct seeds give distinct keys."""
    rng = np.random.default_rng(seed)
    tokens = np.arange(seed * count * ns.chunk_tokens, (seed + 1) * count * ns.chunk_tokens)
    blocks: list[tuple[ChunkKey, Block]] = []
    parent: ChunkKey | None = None
    for key in chunk_keys(ns, tokens):
        payload = rng.bytes(ns.layout.chunk_nbytes)
        blocks.append((key, encode_block(ns, key, parent, memoryview(payload))))
        parent = key
    return blocks


def crash_batch(index: int) -> list[tuple[ChunkKey, Block]]:
    """Batch ``index`` of the writer that the crash test kills (imported by the child)."""
    return make_blocks(BIG_NS, BIG_BATCH, seed=index)


def nbytes(items: list[tuple[ChunkKey, Block]]) -> int:
    return sum(block.nbytes for _, block in items)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[LMDBTier]:
    t = LMDBTier(tmp_path / "ssd", CAPACITY)
    yield t
    t.close()


def test_is_an_ssd_tier_that_wants_reads_verified(tier: LMDBTier) -> None:
    assert isinstance(tier, Tier)
    assert tier.kind is TierKind.SSD
    assert tier.verifies_reads
    assert tier.capacity_bytes() == CAPACITY
    assert tier.used_bytes() == 0


def test_round_trip_is_bit_for_bit_and_owned(tier: LMDBTier) -> None:
    items = make_blocks(NS, 8, seed=1)
    tier.put_many(NS.digest, items)
    got = tier.get_many(NS.digest, [key for key, _ in items])
    tier.close()  # the map is unmapped; owned copies must still read back
    for (key, block), value in zip(items, got, strict=True):
        assert isinstance(value, memoryview) and not value.readonly
        assert value == block.to_bytes()
        check_identity(verify_block(memoryview(value)), NS, key)


def test_misses_are_none_and_results_align_with_keys(tier: LMDBTier) -> None:
    stored = make_blocks(NS, 3, seed=1)
    absent = make_blocks(NS, 2, seed=2)
    tier.put_many(NS.digest, stored)
    keys = [absent[0][0], stored[0][0], absent[1][0], stored[2][0], stored[1][0]]
    got = tier.get_many(NS.digest, keys)
    assert got[0] is None and got[2] is None
    assert got[1] == stored[0][1].to_bytes()
    assert got[3] == stored[2][1].to_bytes()
    assert got[4] == stored[1][1].to_bytes()
    assert tier.contains_many(NS.digest, keys) == [False, True, False, True, True]
    assert tier.get_many(NS.digest, []) == []


def test_accounting_counts_overwrites_once_and_deletes(tier: LMDBTier) -> None:
    items = make_blocks(NS, 4, seed=1)
    tier.put_many(NS.digest, items)
    assert tier.used_bytes() == nbytes(items)

    tier.put_many(NS.digest, items[:2])  # same values again
    assert tier.used_bytes() == nbytes(items)

    key = items[0][0]
    small = encode_block(NS, key, None, memoryview(b"\x01" * 100))
    tier.put_many(NS.digest, [(key, small), (key, small)])  # duplicate within a batch
    assert tier.used_bytes() == nbytes(items) - items[0][1].nbytes + small.nbytes
    assert tier.get_many(NS.digest, [key]) == [small.to_bytes()]

    absent = make_blocks(NS, 1, seed=2)[0][0]
    assert tier.delete_many(NS.digest, [key, absent, items[1][0]]) == 2
    assert tier.used_bytes() == nbytes(items[2:])
    assert tier.contains_many(NS.digest, [k for k, _ in items]) == [False, False, True, True]
    assert tier.delete_many(NS.digest, [key]) == 0
    assert tier.delete_many(NS.digest, [k for k, _ in items]) == 2
    assert tier.used_bytes() == 0


def test_reopen_keeps_data_and_rebuilds_accounting(tmp_path: Path) -> None:
    first = LMDBTier(tmp_path / "ssd", CAPACITY)
    items = make_blocks(NS, 6, seed=1)
    other = make_blocks(OTHER_NS, 2, seed=2)
    first.put_many(NS.digest, items)
    first.put_many(OTHER_NS.digest, other)
    first.close()
    first.close()  # idempotent
    with pytest.raises(TierUnavailable):
        first.get_many(NS.digest, [items[0][0]])
    with pytest.raises(TierUnavailable):
        first.used_bytes()

    second = LMDBTier(tmp_path / "ssd", CAPACITY)
    try:
        assert second.used_bytes() == nbytes(items) + nbytes(other)
        expected = {(NS.digest, key): block for key, block in items} | {
            (OTHER_NS.digest, key): block for key, block in other
        }
        infos = list(second.scan())
        assert len(infos) == len(expected)
        for info in infos:
            block = expected[(info.namespace, info.key)]
            assert info.nbytes == block.nbytes
            assert info.header == block.header
        got = second.get_many(NS.digest, [key for key, _ in items])
        assert got == [block.to_bytes() for _, block in items]
    finally:
        second.close()


def test_scan_pages_through_every_entry(tier: LMDBTier, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_tier, "_SCAN_PAGE", 3)
    items = make_blocks(NS, 6, seed=1)  # an exact multiple of the page: last page empty
    tier.put_many(NS.digest, items)
    short_key = make_blocks(NS, 1, seed=2)[0][0]
    short = Block(header=b"tiny", payload=memoryview(b""))  # shorter than a header
    tier.put_many(NS.digest, [(short_key, short)])
    infos = list(tier.scan())
    assert sorted(info.key for info in infos) == sorted([k for k, _ in items] + [short_key])
    short_info = next(info for info in infos if info.key == short_key)
    assert short_info.header == b"tiny" and short_info.nbytes == 4
    assert tier.get_many(NS.digest, [short_key]) == [b"tiny"]  # as-is; the store rejects it


def test_same_chunk_key_under_two_namespaces_is_two_entries(tier: LMDBTier) -> None:
    key = make_blocks(NS, 1, seed=1)[0][0]
    mine = encode_block(NS, key, None, memoryview(b"\x01" * LAYOUT.chunk_nbytes))
    theirs = encode_block(OTHER_NS, key, None, memoryview(b"\x02" * LAYOUT.chunk_nbytes))
    tier.put_many(NS.digest, [(key, mine)])
    assert tier.contains_many(OTHER_NS.digest, [key]) == [False]
    tier.put_many(OTHER_NS.digest, [(key, theirs)])
    assert tier.get_many(NS.digest, [key]) == [mine.to_bytes()]
    assert tier.get_many(OTHER_NS.digest, [key]) == [theirs.to_bytes()]
    assert tier.used_bytes() == mine.nbytes + theirs.nbytes
    assert tier.delete_many(NS.digest, [key]) == 1
    assert tier.get_many(OTHER_NS.digest, [key]) == [theirs.to_bytes()]
    assert {(info.namespace, info.key) for info in tier.scan()} == {(OTHER_NS.digest, key)}


def test_keys_of_the_wrong_width_are_refused(tier: LMDBTier) -> None:
    with pytest.raises(ValueError):
        tier.contains_many(NS.digest[:8], [make_blocks(NS, 1, seed=1)[0][0]])


def test_map_full_is_tier_full_and_leaves_no_part_of_the_batch(tmp_path: Path) -> None:
    tier = LMDBTier(tmp_path / "ssd", 1 << 20, map_size=1 << 20)
    try:
        kept = make_blocks(NS, 40, seed=1)
        tier.put_many(NS.digest, kept)
        used = tier.used_bytes()
        too_big = make_blocks(NS, 400, seed=2)
        with pytest.raises(TierFull) as caught:
            tier.put_many(NS.digest, too_big)
        assert isinstance(caught.value, TierError) and caught.value.tier == "ssd"
        assert not any(tier.contains_many(NS.digest, [k for k, _ in too_big]))
        assert tier.used_bytes() == used
        assert sum(1 for _ in tier.scan()) == len(kept)
        assert tier.get_many(NS.digest, [k for k, _ in kept]) == [b.to_bytes() for _, b in kept]

        # Still usable: evicting makes room, and the next batch fits.
        assert tier.delete_many(NS.digest, [k for k, _ in kept]) == len(kept)
        tier.put_many(NS.digest, too_big[:40])
        assert tier.used_bytes() == nbytes(too_big[:40])
        assert all(tier.contains_many(NS.digest, [k for k, _ in too_big[:40]]))
    finally:
        tier.close()


def _small_blocks(
    start: int, count: int, namespace: Namespace = NS
) -> list[tuple[ChunkKey, Block]]:
    """``count`` blocks of zeros (2 KiB in ``NS``), keyed from ``start`` on: small beside
    what LMDB keeps per entry (a page of their own each, and a place in the tree)."""
    payload = memoryview(bytes(namespace.layout.chunk_nbytes))
    tokens = np.arange(start * namespace.chunk_tokens, (start + count) * namespace.chunk_tokens)
    return [
        (key, encode_block(namespace, key, None, payload)) for key in chunk_keys(namespace, tokens)
    ]


def _churn(tier: LMDBTier, first: int, count: int, held: list[ChunkKey]) -> None:
    """Write ``count`` small blocks from key ``first`` on, in batches, deleting the
    oldest of ``held`` first whenever a batch would pass the capacity, as eviction does."""
    batch = 256
    for start in range(first, first + count, batch):
        items = _small_blocks(start, batch)
        while held and tier.used_bytes() + nbytes(items) > tier.capacity_bytes():
            assert tier.delete_many(NS.digest, held[:batch]) == len(held[:batch])
            del held[:batch]
        tier.put_many(NS.digest, items)
        held.extend(key for key, _ in items)


def test_a_map_the_tier_sized_grows_when_small_blocks_fill_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Values kept under the capacity can still fill a map sized for them when they
    are small: the tier doubles its map and runs the batch again, so a store that is
    merely full never sees ``TierFull`` from the map, nor a delete fail."""
    capacity = 96 << 20
    slots = capacity // nbytes(_small_blocks(0, 1))
    caplog.set_level("INFO", logger="kvstore.tiers.lmdb_tier")
    tier = LMDBTier(tmp_path / "ssd", capacity, sync=False)
    held: list[ChunkKey] = []
    try:
        _churn(tier, 0, int(1.5 * slots), held)
        assert [r for r in caplog.records if "map grown" in r.getMessage()]
        assert tier.used_bytes() <= capacity
        assert all(tier.contains_many(NS.digest, held[-1000:]))
        assert all(tier.contains_many(NS.digest, held[:1000]))
    finally:
        tier.close()
    reopened = LMDBTier(tmp_path / "ssd", capacity, sync=False)  # the grown file opens
    try:
        assert reopened.used_bytes() == len(held) * nbytes(_small_blocks(0, 1))
    finally:
        reopened.close()


def test_threads_keep_writing_while_the_map_grows(tmp_path: Path) -> None:
    """Growing waits for every call in flight and holds new ones back; writers that
    find the map full together grow it once between them, and none is lost."""
    capacity = 96 << 20
    per_thread = capacity // nbytes(_small_blocks(0, 1)) // 3
    tier = LMDBTier(tmp_path / "ssd", capacity, sync=False)

    def worker(thread: int) -> list[ChunkKey]:
        held: list[ChunkKey] = []
        _churn(tier, thread * per_thread * 2, per_thread, held)
        assert all(tier.contains_many(NS.digest, held))
        return held

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            held = [key for keys in pool.map(worker, range(4)) for key in keys]
        assert tier.used_bytes() == len(held) * nbytes(_small_blocks(0, 1))
        assert sum(1 for _ in tier.scan()) == len(held)
    finally:
        tier.close()


def test_deletes_go_through_a_map_at_its_wall(tmp_path: Path) -> None:
    """An operator's map size is a wall: writes past it are ``TierFull``. A delete
    needs pages too, and a batch of them fails on a full map; the tier deletes it in
    halves, so eviction can always make room again."""
    tier = LMDBTier(tmp_path / "ssd", CAPACITY, map_size=1 << 20, sync=False)
    held: list[ChunkKey] = []
    try:
        with pytest.raises(TierFull):
            for start in range(0, 10_000, 4):
                items = _small_blocks(start, 4)
                tier.put_many(NS.digest, items)
                held.extend(key for key, _ in items)
        assert tier.delete_many(NS.digest, held) == len(held)
        assert tier.used_bytes() == 0
        assert sum(1 for _ in tier.scan()) == 0
        tier.put_many(NS.digest, _small_blocks(0, 4))
        assert all(tier.contains_many(NS.digest, held[:4]))
    finally:
        tier.close()


@pytest.mark.parametrize("namespace", [NS, WIDE_NS], ids=["2KiB-ENOSPC", "4KiB-EIO"])
def test_a_full_disk_refuses_writes_and_the_tier_stays_up(
    tmp_path: Path, namespace: Namespace
) -> None:
    """LMDB reports a commit the disk had no room for as ENOSPC, or, when the write
    came up short (blocks of a page and more), as EIO. Either is a refused write on a
    full disk (``TierRefused``: the guard counts it and trips nothing), not a tier that
    is down: what was written reads back, and deletes make room again. Pages a commit
    frees are reused from the commit after next on, so it takes two."""
    with small_tmpfs(tmp_path / "disk", 512 << 10) as disk:
        tier = LMDBTier(disk / "ssd", CAPACITY, sync=False)
        guarded = GuardedTier(tier, StoreStats().tier(TierKind.SSD), threading.RLock())
        held: list[tuple[ChunkKey, Block]] = []
        try:
            for start in range(0, 4096, 8):
                items = _small_blocks(start, 8, namespace)
                if not guarded.put_many(namespace.digest, items):
                    break
                held.extend(items)
            else:
                pytest.fail("the disk never filled: the test proves nothing")
            with pytest.raises(TierRefused):
                tier.put_many(namespace.digest, _small_blocks(start, 8, namespace))
            assert guarded.breaker.trips == 0
            keys = [key for key, _ in held]
            found = guarded.get_many(namespace.digest, keys)
            assert found == [block.to_bytes() for _, block in held]
            half = len(keys) // 2
            assert guarded.delete_many(namespace.digest, keys[:half]) == half
            assert guarded.delete_many(namespace.digest, keys[half:]) == len(keys) - half
            assert guarded.put_many(namespace.digest, held[:8])
            assert guarded.breaker.trips == 0
        finally:
            tier.close()


def test_threads_put_and_get_distinct_keys(tier: LMDBTier) -> None:
    rounds, per_batch = 6, 4

    def worker(thread: int) -> int:
        kept = 0
        for step in range(rounds):
            items = make_blocks(NS, per_batch, seed=1000 * thread + step)
            keys = [key for key, _ in items]
            tier.put_many(NS.digest, items)
            got = tier.get_many(NS.digest, keys)
            assert got == [block.to_bytes() for _, block in items]
            for value in got:
                assert value is not None
                verify_block(value)
            if step % 2:
                assert tier.delete_many(NS.digest, keys) == per_batch
            else:
                kept += nbytes(items)
        return kept

    with ThreadPoolExecutor(max_workers=8) as pool:
        kept = sum(pool.map(worker, range(8)))
    assert tier.used_bytes() == kept
    assert sum(info.nbytes for info in tier.scan()) == kept


def test_close_waits_for_reads_in_flight(tier: LMDBTier) -> None:
    items = make_blocks(NS, 16, seed=1)
    tier.put_many(NS.digest, items)
    keys = [key for key, _ in items]
    expected = [block.to_bytes() for _, block in items]
    outcomes: list[str] = []

    def reader() -> None:
        try:
            while True:
                assert tier.get_many(NS.digest, keys) == expected
        except TierUnavailable:
            outcomes.append("closed")

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    tier.close()
    for thread in threads:
        thread.join(timeout=10)
    assert outcomes == ["closed"] * 4


# The crash test runs three processes besides pytest. A holder keeps the
# environment open throughout, as a serving daemon would: otherwise the next
# opener finds no live user and simply resets the lock file, and the stale
# reader slot and the dead writer's lock would never be exercised.
_HOLDER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 30)
print("open", flush=True)
time.sleep(60)
"""
_READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 30)
txn = env.begin()
print("reading", flush=True)
time.sleep(60)
"""
_WRITER = """
import sys
sys.path[:0] = sys.argv[2:4]  # this file's folder, and the tests' (for support)
from test_lmdb import BIG_NS, crash_batch
from kvstore.tiers.lmdb_tier import LMDBTier
tier = LMDBTier(sys.argv[1], 512 << 20, map_size=1 << 30)
for index in range(200):
    tier.put_many(BIG_NS.digest, crash_batch(index))
    print(f"committed {index}", flush=True)
"""


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child exited early with {proc.wait()}"
    return line.strip()


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def test_kill_9_mid_write_loses_no_commit_and_tears_no_value(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    LMDBTier(path, CAPACITY, map_size=1 << 30).close()  # create the environment
    holder = _start(_HOLDER, str(path))
    try:
        assert _read_line(holder) == "open"
        writer = _start(_WRITER, str(path), str(Path(__file__).parent), str(TESTS))
        assert _read_line(writer) == "committed 0"
        # Started after the writer opened, which would have reaped the slot.
        reader = _start(_READER, str(path))
        assert _read_line(reader) == "reading"
        _kill(reader)
        for expected in range(1, 5):
            assert _read_line(writer) == f"committed {expected}"
        _kill(writer)  # most likely inside the put_many of a later batch
        assert writer.returncode == -signal.SIGKILL

        tier = LMDBTier(path, CAPACITY, map_size=1 << 30)
        try:
            assert tier.stale_readers_cleared >= 1
            for index in range(5):
                items = crash_batch(index)
                got = tier.get_many(BIG_NS.digest, [key for key, _ in items])
                assert got == [block.to_bytes() for _, block in items]
            for index in range(5, 8):  # in flight when killed: all or nothing
                present = tier.contains_many(BIG_NS.digest, [k for k, _ in crash_batch(index)])
                assert all(present) or not any(present)
            infos = list(tier.scan())
            values = tier.get_many(BIG_NS.digest, [info.key for info in infos])
            for info, value in zip(infos, values, strict=True):
                assert value is not None
                check_identity(verify_block(value), BIG_NS, info.key)
            assert tier.used_bytes() == sum(info.nbytes for info in infos)
            # The dead writer's lock is recovered: writing works.
            extra = make_blocks(BIG_NS, 2, seed=500)
            tier.put_many(BIG_NS.digest, extra)
            assert all(tier.contains_many(BIG_NS.digest, [k for k, _ in extra]))
        finally:
            tier.close()
    finally:
        _kill(holder)

    reopened = LMDBTier(path, CAPACITY, map_size=1 << 30)
    assert reopened.stale_readers_cleared == 0
    reopened.close()

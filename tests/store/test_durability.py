"""What a ``TieredStore`` keeps across a close, a reopen, a kill -9 in the middle of
LMDB writes, and an LMDB map that fills before the configured capacity; and the
README's embedded default starting on a machine with no cache directory yet."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from support import TESTS, kv
from support.kv import assert_chunks_equal

from kvstore import TieredStore, TierKind
from kvstore.tiers.registry import TierConfig

DRAM, SSD = TierKind.DRAM, TierKind.SSD


def test_reopen_rebuilds_the_index_from_lmdb(tmp_path: Path) -> None:
    ns = kv.namespace()
    data = kv.chunks(4)
    config = kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(4), data)
        store.demote(ns, store.keys_for(ns, kv.tokens(4)))  # write back to LMDB
    with TieredStore(config) as reopened:
        prefix = reopened.lookup(ns, kv.tokens(4))
        assert prefix.tiers == (SSD,) * 4
        assert_chunks_equal(reopened, ns, list(prefix.keys), data)


WRITER = """
import sys
from support import kv
from kvstore import TieredStore
store = TieredStore(kv.config(kv.ssd(sys.argv[1])))
ns = kv.namespace()
for chain in range(10_000):
    store.put(ns, kv.tokens(4, start=chain * 1_000), kv.chunks(4, seed=chain))
    print(chain, flush=True)
"""


def test_kill_9_during_lmdb_writes_then_reopen(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "lmdb")],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert writer.stdout is not None
    committed = [int(writer.stdout.readline()) for _ in range(6)]
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    writer.stdout.close()
    ns = kv.namespace()
    with TieredStore(kv.config(kv.ssd(tmp_path / "lmdb"))) as store:
        for chain in committed:
            keys = store.keys_for(ns, kv.tokens(4, start=chain * 1_000))
            assert_chunks_equal(store, ns, keys, kv.chunks(4, seed=chain))
        # The chain in flight at the kill is all there or absent, never torn or wrong.
        in_flight = committed[-1] + 1
        keys = store.keys_for(ns, kv.tokens(4, start=in_flight * 1_000))
        got = store.get(ns, keys)
        expected = kv.chunks(4, seed=in_flight)
        assert all(
            c is None or torch.equal(c.tensor(), t) for c, t in zip(got, expected, strict=True)
        )
        assert store.stats().tiers[SSD].corrupt_blocks == 0


def test_a_full_lmdb_map_triggers_eviction_not_a_crash(tmp_path: Path) -> None:
    """Capacity set above what the map can hold: MapFullError must become eviction."""
    tier = TierConfig(SSD, 1 << 30, path=tmp_path / "lmdb", map_size_bytes=256 << 10)
    with TieredStore(kv.config(tier)) as store:
        ns = kv.namespace()
        for chain in range(40):  # ~87 KiB of blocks per chain, far past a 256 KiB map
            data = kv.chunks(40, seed=chain)
            store.put(ns, kv.tokens(40, start=chain * 10_000), data)
        stats = store.stats().tiers[SSD]
        assert stats.evictions > 0
        last = kv.tokens(40, start=39 * 10_000)
        prefix = store.lookup(ns, last)
        assert prefix.num_chunks > 0
        assert_chunks_equal(
            store, ns, list(prefix.keys), kv.chunks(40, seed=39)[: prefix.num_chunks]
        )


def test_close_writes_what_only_memory_holds_so_a_reopened_store_has_it(tmp_path: Path) -> None:
    ns = kv.namespace()
    data = kv.chunks(3)
    config = kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(3), data)  # fits DRAM: nothing written to SSD yet
        assert store.lookup(ns, kv.tokens(3)).tiers == (DRAM,) * 3
        assert store.stats().tiers[SSD].blocks == 0
    with TieredStore(config) as reopened:
        assert reopened.lookup(ns, kv.tokens(3)).tiers == (SSD,) * 3
        assert_chunks_equal(reopened, ns, reopened.keys_for(ns, kv.tokens(3)), data)
    unflushed = dataclasses.replace(config, flush_on_close=False)
    with TieredStore(unflushed) as store:
        store.put(ns, kv.tokens(2, start=900), kv.chunks(2))
    with TieredStore(unflushed) as reopened:
        assert reopened.lookup(ns, kv.tokens(2, start=900)).num_chunks == 0


def test_the_readmes_embedded_store_starts_on_a_fresh_machine(tmp_path: Path) -> None:
    """``TieredStore()`` with a home that has no cache directory yet, in a process of its
    own (the default DRAM tier is 2 GiB of /dev/shm: sized down if there is less)."""
    home = tmp_path / "home"
    home.mkdir()
    script = (
        "from kvstore import TieredStore, Namespace, KVLayout\n"
        "import torch, numpy as np\n"
        "layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype='float16',"
        " chunk_tokens=16)\n"
        "ns = Namespace('fresh', layout)\n"
        "with TieredStore() as store:\n"
        "    store.put(ns, np.arange(16), [torch.ones(layout.chunk_shape, dtype=torch.float16)])\n"
        "with TieredStore() as store:\n"
        "    print(store.lookup(ns, np.arange(16)).tiers)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "XDG_"))}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SSD" in done.stdout  # written down at close, found again at the next open
    assert (home / ".cache" / "kvstore" / "lmdb" / "data.mdb").exists()

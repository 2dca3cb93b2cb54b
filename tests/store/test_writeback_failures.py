"""A write-back that fails keeps its victim: a full disk under the SSD tier refuses new
puts and loses none that were acknowledged (a real LMDB on a real, small tmpfs)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from support import kv
from support.filesystems import small_tmpfs

from kvstore.keys import chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.tiered_store import TieredStore

NS = kv.namespace()


def test_a_full_disk_refuses_new_puts_and_loses_no_acknowledged_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_tmpfs(tmp_path / "disk", 512 << 10) as disk:
        # The SSD tier believes it has 64 MiB; the disk under it holds 512 KiB.
        store = TieredStore(kv.config(kv.dram(8), kv.ssd(disk / "lmdb")))
        acknowledged: dict[int, torch.Tensor] = {}
        caplog.set_level(logging.WARNING, logger="kvstore.store.placement")
        try:
            for n in range(600):
                tokens = kv.tokens(1, start=100 * n)
                chunk = kv.chunks(1, seed=n)
                if store.put(NS, tokens, chunk) == 1:
                    acknowledged[n] = chunk[0]
            stats = store.stats()
            refused = 600 - len(acknowledged)
            assert refused > 0, "the disk never filled: the test proves nothing"
            assert stats.tier(TierKind.DRAM).writebacks_failed > 0
            assert stats.puts_dropped >= refused
            for n, chunk in acknowledged.items():
                key = chunk_keys(NS, kv.tokens(1, start=100 * n))
                got = store.get(NS, key)[0]
                assert got is not None, f"acknowledged chunk {n} was lost"
                assert torch.equal(got.tensor(), chunk)
        finally:
            store.close()
    failures = [r for r in caplog.records if "write-back" in r.getMessage()]
    assert 1 <= len(failures) < 10, "logged once per interval, not once per put"

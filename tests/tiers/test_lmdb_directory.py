"""The LMDB tier's directory: a damaged environment is moved aside and the tier starts
empty; a second kvstore process on the same directory is refused, naming the first;
room that the disk does not have is warned about (real LMDB files, real processes)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import kv
from support.filesystems import small_tmpfs

from kvstore.errors import TierUnavailable
from kvstore.keys import chunk_keys
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.lmdb_tier import LMDBTier

NS = kv.namespace()


def _fill(path: Path) -> None:
    with TieredStore(kv.config(kv.ssd(path))) as store:
        store.put(NS, kv.tokens(4), kv.chunks(4))


@pytest.mark.parametrize("damage", ["meta pages", "whole file"])
def test_a_damaged_environment_is_moved_aside_and_the_store_starts_empty(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "lmdb"
    _fill(path)
    data = path / "data.mdb"
    with data.open("r+b") as file:  # LMDB's two meta pages are the first two pages
        if damage == "meta pages":
            file.write(b"\xa5" * 8192)
        else:
            file.write(b"\x00" * data.stat().st_size)
    caplog.set_level(logging.ERROR, logger="kvstore.tiers.lmdb_directory")
    with TieredStore(kv.config(kv.ssd(path))) as store:
        assert store.lookup(NS, kv.tokens(4)).num_chunks == 0
        store.put(NS, kv.tokens(2, start=500), kv.chunks(2))  # and it works
        assert store.lookup(NS, kv.tokens(2, start=500)).num_chunks == 2
    (aside,) = tmp_path.glob("lmdb.corrupt-*")
    assert (aside / "data.mdb").exists(), "kept for a post-mortem"
    assert any("damaged" in record.getMessage() for record in caplog.records)
    with TieredStore(kv.config(kv.ssd(path))) as reopened:  # and it stays fixed
        assert reopened.lookup(NS, kv.tokens(2, start=500)).num_chunks == 2


def test_a_second_process_on_the_same_directory_is_refused_naming_the_first(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lmdb"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from kvstore.tiers.lmdb_tier import LMDBTier\n"
            f"tier = LMDBTier({str(path)!r}, 1 << 20)\n"
            "print('open', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(TierUnavailable, match=rf"another kvstore process \(pid {holder.pid}\)"):
            LMDBTier(path, 1 << 20)
        with pytest.raises(TierUnavailable, match="must not share"):
            TieredStore(kv.config(kv.dram(4), kv.ssd(path)))
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
    LMDBTier(path, 1 << 20).close()  # the dead holder's lock went with it


def test_the_same_directory_twice_in_one_process_is_refused_until_closed(tmp_path: Path) -> None:
    first = LMDBTier(tmp_path / "lmdb", 1 << 20)
    with pytest.raises(TierUnavailable, match="another kvstore process"):
        LMDBTier(tmp_path / "lmdb", 1 << 20)
    first.close()
    LMDBTier(tmp_path / "lmdb", 1 << 20).close()


def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    with TieredStore(kv.config(kv.ssd(tmp_path / "fresh" / "home" / "lmdb"))) as store:
        store.put(NS, kv.tokens(1), kv.chunks(1))
        assert store.get(NS, chunk_keys(NS, kv.tokens(1)))[0] is not None


def test_a_capacity_beyond_the_disk_or_the_map_is_warned_about_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.tiers.lmdb_directory")
    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:
        LMDBTier(disk / "lmdb", 64 << 20, map_size=8 << 20).close()
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "map_size (8 MiB) is below the tier's capacity (64 MiB)" in messages
    assert re.search(r"capacity is 64 MiB but its disk has [01] MiB free", messages)

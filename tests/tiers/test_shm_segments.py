"""The DRAM tier's segments in /dev/shm: sized to the room there is (a real 16 MiB tmpfs
over /dev/shm in a mount namespace of its own), and the ones that a killed process
group left behind removed by the next store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstore.tiers import shm_segments
from kvstore.tiers.dram import DRAMTier

SHM = Path("/dev/shm")
needs_linux_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


TESTS = Path(__file__).resolve().parents[1]


def _in_small_shm(script: str, shm_bytes: int, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a mount namespace where /dev/shm is a tmpfs of ``shm_bytes``."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /dev/shm needs root and unshare")
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    command = f"mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec {sys.executable} {path}"
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )


def test_a_dram_tier_larger_than_dev_shm_is_sized_down_and_never_dies_of_sigbus(
    tmp_path: Path,
) -> None:
    result = _in_small_shm(
        """
        import logging, sys
        logging.basicConfig(level=logging.WARNING)
        from support import kv
        from kvstore.store.tiered_store import TieredStore
        from kvstore.kinds import TierKind
        store = TieredStore(kv.config(kv.dram(64 << 20 >> 12)))  # 64 MiB of 4 KiB slots
        capacity = store.stats().tiers[TierKind.DRAM].capacity_bytes
        assert 0 < capacity < 16 << 20, capacity
        stored = 0
        chunks = kv.chunks(16)
        for n in range(750):  # 48 MiB of chunks through a tier of under 16 MiB
            stored += store.put(kv.namespace(), kv.tokens(16, start=256 * n), chunks)
        assert store.stats().tiers[TierKind.DRAM].used_bytes <= capacity
        store.close()
        print("stored", stored)
        """,
        16 << 20,
        tmp_path,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "sizing it down" in result.stderr
    assert "stored 12000" in result.stdout


def test_no_room_at_all_is_a_clear_error(tmp_path: Path) -> None:
    result = _in_small_shm(
        """
        from support import kv
        from kvstore.store.tiered_store import TieredStore
        try:
            TieredStore(kv.config(kv.dram(4096)))
        except Exception as exc:
            print(type(exc).__name__, exc)
        """,
        1 << 20,  # with headroom kept for others, under the 1 MiB a tier needs
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TierUnavailable" in result.stdout and "no room" in result.stdout


def test_segments_of_a_killed_process_group_are_removed_by_the_next_tier(tmp_path: Path) -> None:
    """Run in a /dev/shm of its own: any tier another test creates meanwhile would reap the
    killed group's segment before this test's own tier could show that it does."""
    result = _in_small_shm(
        f"""
        import os, signal, subprocess, sys, time
        from pathlib import Path
        from kvstore.tiers import shm_segments
        from kvstore.tiers.dram import DRAMTier
        ready = Path({str(tmp_path / "name")!r})
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import time\\n"
             "from kvstore.tiers.dram import DRAMTier\\n"
             "tier = DRAMTier(1 << 20)\\n"
             f"open({{str(ready)!r}}, 'w').write(tier.arena.name)\\n"
             "time.sleep(60)\\n"],
            start_new_session=True,  # its own process group, resource tracker included
        )
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text()):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        name = ready.read_text()
        os.killpg(child.pid, signal.SIGKILL)  # as `systemctl kill` does: the tracker dies too
        child.wait(timeout=10)
        shm = Path("/dev/shm")
        assert (shm / name).exists(), "the segment outlives its process group"
        alive = DRAMTier(1 << 20)  # a live process's segment, which must stay
        assert not (shm / name).exists()
        assert (shm / alive.arena.name).exists()
        assert name not in shm_segments.reap_stale()
        alive.close()
        print("reaped", name)
        """,
        64 << 20,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reaped kvstore-" in result.stdout


@needs_linux_shm
def test_a_segment_whose_creator_holds_its_lock_is_kept_even_if_its_pid_looks_dead() -> None:
    """A creator in another pid namespace: its pid means nothing here, its lock does."""
    tier = DRAMTier(1 << 20)
    dead_pid = _dead_pid()
    lookalike = SHM / f"{shm_segments.PREFIX}{dead_pid}-00c0ffee"
    os.link(SHM / tier.arena.name, lookalike)  # the same file, so the same flock
    try:
        assert lookalike.name not in shm_segments.reap_stale()
        assert lookalike.exists()
    finally:
        lookalike.unlink()
        tier.close()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid

"""The soak's short form: half a minute of mixed load from three clients (shared memory,
bytes, TCP) on DRAM + LMDB + Redis while Redis is paused and restarted; every read right
or a miss, nothing raised to a caller, no stale LMDB reader."""

from __future__ import annotations

from pathlib import Path

from faults import soak
from faults.campaign import SHORT


def test_mixed_load_through_redis_faults_reads_nothing_wrong(tmp_path: Path) -> None:
    report = soak.run(SHORT, tmp_path)
    figures = report.figures
    assert report.failures() == {}, figures
    assert figures["faults_injected"] >= 2 and figures["requests"] > 1000
    assert figures["stale_readers_max"] == 0

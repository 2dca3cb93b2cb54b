"""The kill -9 loop's short form: a real daemon killed (process group and all) during
write bursts and during startup; every block it acknowledged reads back right or not at
all, none that was flushed is lost, and no shared-memory segment is left behind."""

from __future__ import annotations

from pathlib import Path

from faults import kill_loop
from faults.campaign import SHORT


def test_kill_9_loses_nothing_flushed_and_serves_nothing_wrong(tmp_path: Path) -> None:
    report = kill_loop.run(SHORT, tmp_path)
    figures = report.figures
    assert report.failures() == {}, figures
    assert figures["cycles"] == SHORT.cycles
    assert figures["killed_writing"] >= 2 and figures["killed_starting"] >= 1
    assert figures["graceful_stops"] >= 1
    assert figures["restarts_ok"] == figures["cycles"] - figures["killed_starting"]
    assert figures["chunks_verified"] > 0 and figures["chains_acknowledged"] > 0

"""``bench/startup.py --quick`` end to end: every command and the daemon timed against
its peer, as fresh processes. No timing thresholds: the figures must be there and sane."""

from __future__ import annotations

import json
import math

import pytest
import startup


@pytest.mark.slow
def test_quick_run_reports_every_command_against_its_peer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    startup.main(["--quick", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = {row["command"]: row for row in report["results"]}
    assert sorted(rows) == sorted(
        [
            "kvstore --help",
            "kvstore --version",
            "kvstore stats",
            "kvstore ready",
            "kvstore namespaces",
            "kvstore serve to /healthz",
        ]
    )
    for row in rows.values():
        assert 0 < row["median_s"] <= row["max_s"] and row["runs"] >= 3
        assert 0 < row["ratio"] < math.inf
        assert row["ratio"] == pytest.approx(row["median_s"] / row["peer_median_s"], rel=1e-2)

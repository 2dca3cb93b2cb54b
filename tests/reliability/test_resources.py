"""The resource-fault scenario's short form: /dev/shm too small, a full disk, a corrupt
LMDB meta page, a full namespace table and file descriptors exhausted, each against a
real daemon or store; none may crash it or lose an acknowledged block."""

from __future__ import annotations

from pathlib import Path

from faults import resources
from faults.campaign import SHORT


def test_resource_faults_degrade_and_lose_nothing(tmp_path: Path) -> None:
    report = resources.run(SHORT, tmp_path)
    assert report.failures() == {}, report.figures
    figures = report.figures
    if "disk_full_refused" in figures:  # run as root
        assert figures["disk_full_refused"] > 0 and figures["disk_full_writebacks_failed"] > 0
        assert 0 < figures["shm_small_capacity_mib"] < 16
    assert figures["corrupt_meta_moved_aside"] == 1
    assert figures["namespaces_forgotten"] > 0
    assert figures["fd_connections_opened"] > 0

"""The wheel installs everything under the ``kvstore`` namespace and imports on its own."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from support import REPO

ROOT = REPO


def test_wheel_maps_folders_under_kvstore_and_imports(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("kvstore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names if name.endswith(".py")}
    assert packages == {"kvstore"}, packages  # no top-level `tiers`, `client`, ...
    assert "kvstore/tiers/lmdb_tier.py" in names
    assert "kvstore/client/__init__.py" in names
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    probe = (
        "import kvstore, kvstore.tiers.redis_tier, kvstore.tiers.lmdb_tier, kvstore.client;"
        "print(kvstore.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout.startswith(str(target))

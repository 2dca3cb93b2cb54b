"""Small real filesystems for resource-fault tests: a tmpfs of a given size, mounted
in a temp dir (root only; tests that need one skip elsewhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a ``size_bytes`` tmpfs at ``path`` for the duration (skips unless root)."""
    if not can_mount():
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)

"""Fixtures the replay's tests share: four small real conversations of the data set,
shipped with the tests (``tests/fixtures/kv-cache-tester``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import REPO

FIXTURES = REPO / "tests" / "fixtures" / "kv-cache-tester"
FOUR = ("trace_0361", "trace_0448", "trace_0555", "trace_0298")  # 7 KB each, gzipped


@pytest.fixture
def conversations(tmp_path: Path) -> Path:
    """A folder of four kv-cache-tester conversations (links to the fixtures)."""
    folder = tmp_path / "conversations"
    folder.mkdir()
    for name in FOUR:
        (folder / f"{name}.json.gz").symlink_to(FIXTURES / f"{name}.json.gz")
    return folder

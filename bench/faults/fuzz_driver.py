"""How the fuzzer drives hypothesis over a target and records what it finds: one
module for the HTTP and the in-process targets alike."""

from __future__ import annotations

import json
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

_BATCH = 50
MIN_CASES = 10
"""Cases every target runs whatever the clock says: on a loaded machine the targets
fuzzed first can spend a scenario's time, and a target that ran nothing was not fuzzed."""
_SAVED_FAILURES = 100
_REPORTED_FAILURES = 5

# -- findings --------------------------------------------------------------------------


class Findings:
    """What went wrong, counted by kind, the first ``_SAVED_FAILURES`` inputs saved
    under ``directory``; and every answer's status."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.counts: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.by_target: dict[str, Counter[str]] = {}
        self.first: list[dict[str, Any]] = []
        self._saved = 0

    def answered(self, target: str, status: str) -> None:
        """Count an HTTP exchange by how it ended: a status, ``closed``, ``hang``..."""
        self.statuses[status] += 1
        self.by_target.setdefault(target, Counter())[status] += 1

    def record(self, kind: str, target: str, detail: str, data: bytes) -> None:
        self.counts[kind] += 1
        if self._saved >= _SAVED_FAILURES:
            return
        self._saved += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"{self._saved:04d}-{target}-{kind}"
        stem.with_suffix(".bin").write_bytes(data)
        note = {"target": target, "kind": kind, "detail": detail, "input": str(stem) + ".bin"}
        stem.with_suffix(".json").write_text(json.dumps(note, indent=2) + "\n")
        if len(self.first) < _REPORTED_FAILURES:
            shown = data[:160].decode("latin-1").encode("unicode_escape").decode()
            self.first.append({**note, "detail": detail[-600:], "input_head": shown})


# -- driving hypothesis ------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One thing fuzzed: its inputs, and ``check``, which sends one and records
    whatever went wrong in the ``Findings`` (it never raises for a finding)."""

    name: str
    inputs: st.SearchStrategy[Any]
    check: Callable[[Any], None]
    over_http: bool = True


def drive(target: Target, count: int, deadline: float, seed: int, findings: Findings) -> int:
    """Run ``target`` on up to ``count`` generated inputs before ``deadline``, and on at
    least ``MIN_CASES`` of them (or ``count``) however late; how many ran."""
    ran = 0
    floor = min(MIN_CASES, count)

    def more() -> bool:
        return ran < count and (ran < floor or time.monotonic() < deadline)

    for batch in range(count):
        if not more():
            break
        before = ran
        size = min(_BATCH, count - ran)

        @hypothesis_seed(zlib.crc32(f"{seed}:{target.name}:{batch}".encode()))
        @settings(
            max_examples=size,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(target.inputs)
        def one(case: Any) -> None:
            nonlocal ran
            if more():
                ran += 1
                try:
                    target.check(case)
                except Exception:  # the fuzzer's own bug: counted, and the run goes on
                    findings.record("harness_errors", target.name, traceback.format_exc(), b"")

        one()
        if ran == before:  # hypothesis found nothing new to try
            break
    return ran

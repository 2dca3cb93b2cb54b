"""The fuzzing scenario's short form: every route, header and decoder fuzzed against a
real daemon, and nothing failed (no 5xx, no unexpected exception, no hang, no crash,
canary data unchanged)."""

from __future__ import annotations

import time
from pathlib import Path

from faults import fuzz_decoders, fuzzing
from faults.campaign import SHORT
from faults.fuzz_driver import MIN_CASES, Findings, Target, drive
from faults.fuzzing import SEED
from hypothesis import strategies as st


def test_fuzzing_short_form_finds_nothing(tmp_path: Path) -> None:
    report = fuzzing.run(SHORT, tmp_path)
    assert report.failures() == {}, report.figures["first_failures"]
    cases = report.figures["cases"]
    assert set(cases) == {*fuzzing.HTTP_TARGETS, *fuzz_decoders.IN_PROCESS_TARGETS}
    assert all(count > 0 for count in cases.values()), cases
    # Every HTTP target was answered, and some of its requests were accepted or refused
    # deep in a route rather than all at the door.
    assert set(report.figures["statuses_by_target"]) == set(fuzzing.HTTP_TARGETS)
    assert report.figures["statuses"].get("200", 0) > 0
    assert not (tmp_path / "failures").exists()


def test_a_target_fuzzed_after_the_deadline_still_runs_its_floor(tmp_path: Path) -> None:
    """On a loaded machine the first targets can spend the scenario's time; the last
    one still runs ``MIN_CASES`` cases, and never more than its count."""
    seen: list[int] = []
    target = Target("late", st.integers(), seen.append, over_http=False)
    findings = Findings(tmp_path)
    past = time.monotonic() - 1.0
    assert drive(target, 1000, past, SEED, findings) == MIN_CASES == len(seen)
    assert drive(target, 3, past, SEED, findings) == 3
    assert drive(target, 1000, time.monotonic() + 60.0, SEED, findings) == 1000
    assert findings.counts == {}

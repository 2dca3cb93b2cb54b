"""The fuzzing scenario's short form: every route, header and decoder fuzzed against a
real daemon, and nothing failed (no 5xx, no unexpected exception, no hang, no crash,
canary data unchanged)."""

from __future__ import annotations

from pathlib import Path

from faults import fuzz_decoders, fuzzing
from faults.campaign import SHORT


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

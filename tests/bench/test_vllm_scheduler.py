"""``bench/vllm_scheduler.py`` end to end, short: every case drives the vLLM connector's
scheduler side through a real daemon and reports its figures. No timing thresholds:
what must hold on any machine is that every measured call found its cached context."""

from __future__ import annotations

import json

import pytest
import vllm_scheduler


@pytest.mark.slow
def test_every_case_reports_its_calls_and_finds_the_cached_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert vllm_scheduler.main(["--quick", "--json", "--sessions", "1", "--calls", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    cases = report["cases"]
    assert list(cases) == [case.name for case in vllm_scheduler.CASES]
    loadable = vllm_scheduler.CONTEXT_TOKENS // vllm_scheduler.PAGES.block_size
    for figures in cases.values():
        assert figures["calls"] == 2  # the first call of a session is not measured
        assert 0 < figures["scheduler_ms_p50"] <= figures["scheduler_ms_p99"]
        assert 0 < figures["lookup_ms_p50"] <= figures["lookup_ms_p99"]
        # Each call's context was put before it: every block up to the last is loaded.
        assert figures["loaded_tokens_p50"] >= loadable * vllm_scheduler.PAGES.block_size
    assert cases["ahead"]["p50_vs_ahead"] == 1.0
    blocking = [figures for name, figures in cases.items() if name.startswith("blocking")]
    assert all(figures["late_lookups"] == 0 for figures in blocking)

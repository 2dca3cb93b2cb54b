"""``bench/vllm_loads.py`` end to end, short: every case loads one request's blocks into
vLLM-shaped CPU caches through a real daemon, checked bit for bit after every
repetition (``Shape.check``). No timing thresholds: what must hold on any machine
is that every case reports its figures against the same memcpy and staged runs."""

from __future__ import annotations

import json

import pytest
import vllm_loads


@pytest.mark.slow
def test_every_shape_reports_every_case_against_memcpy_and_staged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert vllm_loads.main(["--json", "--load-mib", "4", "--reps", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["shapes"]) == list(vllm_loads.SHAPES)
    for name, shape in report["shapes"].items():
        assert shape["blocks"] * shape["block_bytes"] <= 4 << 20
        assert shape["block_bytes"] == vllm_loads.SHAPES[name].block_bytes
        cases = shape["cases"]
        assert list(cases) == ["memcpy", "in place", "in place, full", "staged"]
        assert cases["memcpy"]["vs_memcpy"] == 1.0 and cases["staged"]["vs_staged"] == 1.0
        for figures in cases.values():
            assert figures["ms_p50"] > 0 and figures["gbps"] > 0

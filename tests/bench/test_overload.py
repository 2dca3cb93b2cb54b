"""``bench/agent_trace.py``: the generated coding-agent trace reads back through the
replay's own Mooncake reader as the sessions it was written as; ``bench/overload.py``
replays it for every policy against LRU."""

from __future__ import annotations

import json
from pathlib import Path

import agent_trace
import overload
import pytest
from agent_trace import BLOCK_TOKENS, Shape

from kvstore.predictor.replay.traces import TraceFormat, load_trace

SHAPE = Shape(sessions_per_hour=120.0, hours=0.5, max_context=60_000, summary_tokens=8_192)


def test_the_same_seed_writes_the_same_trace_and_another_seed_another() -> None:
    assert agent_trace.generate(SHAPE, 1) == agent_trace.generate(SHAPE, 1)
    assert agent_trace.generate(SHAPE, 1) != agent_trace.generate(SHAPE, 2)


def test_every_call_starts_with_the_shared_system_prompt_and_fits_the_context() -> None:
    calls = agent_trace.generate(SHAPE, 0)
    assert calls and [c.timestamp_ms for c in calls] == sorted(c.timestamp_ms for c in calls)
    assert calls[-1].timestamp_ms < SHAPE.hours * 3.6e6
    system = tuple(range(SHAPE.system_tokens // BLOCK_TOKENS))
    for call in calls:
        assert call.hash_ids[: len(system)] == system
        assert len(call.hash_ids) == -(-call.input_length // BLOCK_TOKENS)
        assert call.input_length <= SHAPE.max_context


def test_the_replay_reads_back_the_chains_it_was_written_as(tmp_path: Path) -> None:
    path = tmp_path / "agents.jsonl"
    calls = agent_trace.generate(SHAPE, 0)
    agent_trace.write(calls, path)
    trace = load_trace(path, TraceFormat.MOONCAKE)
    assert [r.prompt_tokens for r in trace.requests] == [c.input_length for c in calls]
    # Each session the reader infers from prefixes is one chain of the generator's:
    # the shared system prompt glues none together, and compaction starts a new one.
    read = sorted(tuple(r.time for r in requests) for requests in trace.sessions().values())
    chains: dict[int, list[float]] = {}
    for call in calls:
        chains.setdefault(call.chain, []).append(call.timestamp_ms / 1e3)
    assert read == sorted(tuple(times) for times in chains.values())
    assert max(map(len, chains.values())) > 10  # agent loops, many calls a chain


def test_the_command_writes_the_file_and_reports_what_it_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "quick.jsonl"
    assert agent_trace.main(["--quick", "--json", "--out", str(out), "--hours", "0.1"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["requests"] == len(out.read_text().splitlines()) > 0
    assert 0 < figures["hours"] <= 0.1


@pytest.mark.slow
@pytest.mark.parametrize("started_at", ["arrival", "admission"])
def test_the_overload_benchmark_compares_every_policy_with_lru_in_the_same_run(
    started_at: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert overload.main(["--quick", "--json", "--started-at", started_at]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["started_at"] == started_at
    figures = report["scenarios"]["agents-1gpu"]
    assert list(figures) == list(overload.QUICK_POLICIES)
    assert figures["lru"]["vs_lru"] == 1.0
    for row in figures.values():
        assert row["gpu_seconds"] > 0 and row["ttft_p50"] > 0
        assert 0 <= row["prefetches_wasted"] <= row["prefetches_issued"]
    assert figures["lru"]["prefetches_issued"] == 0  # LRU never prefetches
    assert figures["lru"]["prefetch_bytes"] == {"wasted": 0}
    issued = figures["predictor"]["prefetch_bytes"]
    chunk = 1024 * 131072  # the replay's chunk of Llama-3.1-8B KV
    routes = sum(n for route, n in issued.items() if route != "wasted")
    assert routes == figures["predictor"]["prefetches_issued"] * chunk
    assert all(row["link_wait_seconds"] >= 0 for row in figures.values())
    assert figures["lru"]["overload"] is None  # a baseline has no fallback to count
    counted = {"entered", "overloaded_s", "held_back", "late"}
    assert set(figures["predictor"]["overload"]) == counted


def test_the_plot_is_drawn_from_saved_reports(tmp_path: Path) -> None:
    def report(scenario: str, predictor: float) -> Path:
        rows = {"lru": {"vs_lru": 1.0}, "predictor": {"vs_lru": predictor}}
        path = tmp_path / f"{scenario}.json"
        path.write_text(json.dumps({"scenarios": {scenario: rows}}))
        return path

    png = tmp_path / "img" / "overload.png"
    saved = [str(report("agents-1gpu", 1.01)), str(report("conversations", 0.7))]
    assert overload.main(["--replot", *saved, "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")

"""Trace replay through the real store: accounting, determinism, the oracle's bound, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from support import PUBLIC_TRACES

from kvstore.cli import main
from kvstore.errors import ConfigError
from kvstore.kinds import TierKind
from kvstore.predictor.learning.features import FEATURES, feature_names
from kvstore.predictor.learning.model import ReturnModel
from kvstore.predictor.learning.online import OnlineLearner
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.replay.ablation import (
    ablation,
    columns_of,
    head,
    idle_examples,
    prequential,
)
from kvstore.predictor.replay.config import ReplayConfig
from kvstore.predictor.replay.costs import Sizing
from kvstore.predictor.replay.oracle import BlurredOracle, base_rates
from kvstore.predictor.replay.parallel import replay
from kvstore.predictor.replay.policies import PolicyKind, PolicySpec, parse_policies
from kvstore.predictor.replay.report import calibration_curves, gap_closed, summarize
from kvstore.predictor.replay.results import PolicyResult
from kvstore.predictor.replay.simulator import horizons_for
from kvstore.predictor.replay.traces import load_trace
from kvstore.predictor.replay.training import train
from kvstore.predictor.replay.workload import from_trace, load_workload
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger

TRACES = PUBLIC_TRACES
SLOT_GB = 512 * 131072 / 1e9  # one 512-token chunk of Llama-3.1-8B KV
# 8, 24 and 96 chunks: HBM holds about one chain, DRAM a few, SSD most of the trace.
SMALL = Sizing(hbm_gb=8.5 * SLOT_GB, dram_gb=24.5 * SLOT_GB, ssd_gb=96.5 * SLOT_GB)


def conversations(path: Path, sessions: int = 40, seed: int = 0) -> Path:
    """A Mooncake-format trace: half the sessions chat for several turns 20-300 s apart
    (long answers), half ask once (short answers); every prompt starts with block 0."""
    rng = np.random.default_rng(seed)
    rows = []
    next_id = 1
    for _ in range(sessions):
        now = float(rng.uniform(0.0, 1500.0))
        chatty = bool(rng.random() < 0.5)
        blocks = [0]
        for _ in range(int(rng.integers(2, 6)) if chatty else 1):
            new = int(rng.integers(2, 6))
            blocks += range(next_id, next_id + new)
            next_id += new
            rows.append(
                {
                    "timestamp": int(now * 1000),
                    "input_length": len(blocks) * 512 - int(rng.integers(1, 511)),
                    "output_length": 400 if chatty else 40,
                    "hash_ids": list(blocks),
                }
            )
            now += float(rng.uniform(20.0, 300.0))
    rows.sort(key=lambda row: row["timestamp"])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return conversations(tmp_path_factory.mktemp("traces") / "conversations.jsonl")


@pytest.fixture(scope="module")
def results(trace_file: Path):
    trace = load_trace(trace_file)
    specs = parse_policies("lru,ttl:30,ttl:120,predictor,oracle")
    return trace, replay(from_trace(trace), specs, ReplayConfig(SMALL))


def test_parse_policies() -> None:
    specs = parse_policies("lru, ttl:60,ttl:300,predictor,oracle,lru")
    assert [spec.name for spec in specs] == ["lru", "ttl:60", "ttl:300", "predictor", "oracle"]
    assert specs[1] == PolicySpec(PolicyKind.TTL, 60.0) and specs[1].baseline
    assert not specs[3].baseline
    assert parse_policies("lognormal-tools") == [PolicySpec(PolicyKind.LOGNORMAL_TOOLS)]
    assert PolicySpec(PolicyKind.LOGNORMAL_TOOLS).baseline
    for bad in ("", "lru,fifo", "ttl", "ttl:x", "ttl:-5", "oracle:3"):
        with pytest.raises(ConfigError):
            parse_policies(bad)


def test_every_prompt_token_is_a_hit_or_recomputed(results) -> None:
    trace, runs = results
    total = sum(request.prompt_tokens for request in trace.requests)
    for run in runs:
        assert run.requests == len(trace.requests)
        assert run.prompt_tokens == total
        assert run.hit_tokens + run.recomputed_tokens == total
        assert sum(run.hit_tokens_by_tier.values()) == run.hit_tokens
        assert 0 < run.hit_tokens < total
        assert len(run.ttft_s) == len(trace.requests)
        assert run.gpu_seconds == pytest.approx(sum(run.ttft_s) - run.queue_seconds)
        assert run.gpu_seconds == pytest.approx(
            run.load_seconds + run.writeback_seconds + run.recomputed_tokens / 17_500.0
        )
        by_turn = run.load_seconds_by_turn
        assert sum(sum(tiers.values()) for tiers in by_turn.values()) == pytest.approx(
            run.load_seconds
        )
        assert set(by_turn) <= {"human", "tool"}
        assert run.prefetches.used + run.prefetches.wasted <= run.prefetches.issued


def test_replay_is_deterministic(trace_file: Path, results) -> None:
    trace, runs = results
    config = ReplayConfig(SMALL)
    again = replay(from_trace(load_trace(trace_file)), parse_policies("predictor,lru"), config)
    horizons = horizons_for(from_trace(trace), config)
    first = summarize(from_trace(trace), [runs[3], runs[0]], config, horizons)
    second = summarize(from_trace(trace), again, config, horizons)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_the_oracle_does_no_worse_than_any_baseline(results) -> None:
    _, runs = results
    by_name = {run.name: run for run in runs}
    oracle = by_name["oracle"]
    for run in runs:
        if run.baseline:
            assert oracle.gpu_seconds <= run.gpu_seconds, run.name
    # Idle placement keeps HBM for running requests: less of it idles than under LRU.
    assert oracle.hbm_byte_seconds_idle < by_name["lru"].hbm_byte_seconds_idle


def test_the_predictor_reports_prequential_scores(results) -> None:
    trace, runs = results
    predictor = next(run for run in runs if run.name == "predictor")
    assert predictor.quality is not None
    assert set(predictor.quality["auc"]) == {
        f"{h:g}" for h in horizons_for(from_trace(trace), ReplayConfig(SMALL))
    }
    assert predictor.calibration
    assert all(run.quality is None for run in runs if run.name != "predictor")


def test_gap_closed() -> None:
    assert gap_closed(100.0, 80.0, 60.0) == pytest.approx(0.5)
    assert math.isnan(gap_closed(100.0, 80.0, 100.0))


def test_learning_at_the_horizon_holds_a_return_until_its_horizon_passes() -> None:
    tracker = SessionTracker()
    scores = PrequentialScores()
    model = ReturnModel(len(feature_names()), (60.0, 600.0))
    learner = OnlineLearner(model, tracker, scores)  # learn_at_horizon is the default
    learner.observe(RequestStarted("s", Trigger.USER, 10, 0, 0.0))
    learner.observe(RequestFinished("s", 1, 5, 15, False, 0, 0, 1.0))
    learner.observe(RequestStarted("s", Trigger.USER, 20, 0, 31.0))  # back after 30 s
    assert scores.report() == {}  # known, but not learnt before the horizons pass
    learner.tick(62.0)
    assert scores.report()["positive_rate"] == {"60": 1.0}
    learner.tick(602.0)
    assert scores.report()["positive_rate"] == {"60": 1.0, "600": 1.0}


def test_cli_replay_json_train_and_plots(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sizes = ["--hbm-gb", str(SMALL.hbm_gb), "--dram-gb", str(SMALL.dram_gb)]
    sizes += ["--ssd-gb", str(SMALL.ssd_gb)]
    model = tmp_path / "model.pt"
    assert main(["train-predictor", str(trace_file), "--out", str(model)]) == 0
    assert ReturnModel.load(model).n_features == len(feature_names())
    capsys.readouterr()
    argv = ["replay", str(trace_file), "--policy", "lru,predictor,oracle", *sizes]
    argv += ["--model", str(model), "--json", "--no-progress", "--plot", str(tmp_path / "plots")]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"lru", "predictor", "oracle"}
    predictor = report["policies"]["predictor"]
    for field in ("hit_rate", "hit_rate_by_tier", "recomputed_tokens", "gpu_seconds"):
        assert field in predictor
    for field in ("ttft_p50", "ttft_p99", "hbm_gb_hours_idle", "auc", "brier"):
        assert field in predictor
    assert set(predictor["hit_rate_by_tier"]) == {"hbm", "dram", "ssd"}
    assert report["summary"]["best_baseline"] == "lru"
    summary = report["summary"]
    assert "predictor_gap_closed" in summary
    # Above the floor every policy spends: the share of the best baseline's excess saved.
    floor, best = summary["floor_gpu_seconds"], summary["best_baseline_gpu_seconds"]
    assert 0 < floor <= min(p["gpu_seconds"] for p in report["policies"].values())
    for name in ("predictor", "oracle"):
        spent = report["policies"][name]["gpu_seconds"]
        assert summary[f"{name}_saves_above_floor"] == pytest.approx(
            (best - spent) / (best - floor)
        )
    written = {path.name for path in (tmp_path / "plots").iterdir()}
    assert written == {"policies.png", "gap_cdf.png", "calibration.png"}


def test_train_predictor_on_conversations_saves_what_the_replay_learnt(
    conversations: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.pt"
    argv = ["train-predictor", str(conversations), "--users", "2", "--out", str(model)]
    assert main([*argv, "--hidden", "0", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    trained = ReturnModel.load(model)
    assert trained.n_features == len(feature_names())
    assert scores["n"]["60"] > 0  # the learner saw idle periods and labelled them
    # The same replay with the same seed learns the same scores: what was saved is its model.
    (run,) = replay(
        load_workload([conversations], users=2),
        parse_policies("predictor"),
        ReplayConfig(Sizing(100.0, 200.0, 4000.0), chunk_blocks=16, model_hidden=0),
    )
    assert run.quality is not None and run.quality["auc"] == scores["auc"]
    argv = ["replay", str(conversations), "--users", "2", "--policy", "predictor"]
    argv += ["--hbm-gb", "20", "--dram-gb", "10", "--ssd-gb", "1000", "--model", str(model)]
    assert main([*argv, "--no-progress"]) == 0


def test_the_calibration_curve_is_the_predictors_in_bins_of_equal_count() -> None:
    lognormal = PolicyResult("lognormal", baseline=True, calibration=[(60.0, 0.9, 0)] * 20)
    samples = [(60.0, p / 20, int(p >= 10)) for p in range(20)] + [(600.0, 0.5, 1)] * 4
    predictor = PolicyResult("predictor", baseline=False, calibration=samples)
    curves = calibration_curves([lognormal, predictor], bins=4)
    assert set(curves) == {60.0, 600.0}
    flat = [x for point in curves[60.0] for x in point]
    assert flat == pytest.approx([0.1, 0.0, 0.35, 0.0, 0.6, 1.0, 0.85, 1.0])
    assert curves[600.0] == [(0.5, 1.0)] * 4
    assert calibration_curves([lognormal]) == {}  # only the model's forecasts count


def test_cli_rejects_an_unknown_policy(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", str(trace_file), "--policy", "mru", "--hbm-gb", "1"]
    assert main([*argv, "--dram-gb", "1", "--ssd-gb", "1"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_a_redis_tier_runs_on_a_private_server(trace_file: Path) -> None:
    sizing = Sizing(SMALL.hbm_gb, SMALL.dram_gb, 16.5 * SLOT_GB, redis_gb=64.5 * SLOT_GB)
    from kvstore.local.redis_server import RedisServer

    with RedisServer() as server:
        url = server.url
        assert not url.endswith(":6379/0")
        workload = from_trace(load_trace(trace_file))
        (run,) = replay(workload, parse_policies("lru"), ReplayConfig(sizing, redis_url=url))
    assert run.hit_tokens + run.recomputed_tokens == run.prompt_tokens
    redis = run.tier_counters["redis"]
    assert redis["errors"] == 0 and redis["evictions"] > 0  # it filled up and shed blocks
    # Reloading from Redis (1.5 GB/s) loses to recomputing 128 KiB tokens, so a Redis
    # chunk is loaded only to reach faster ones behind it: fewer than from any other tier.
    assert run.hit_tokens_by_tier[TierKind.REDIS] < min(
        run.hit_tokens_by_tier[kind] for kind in (TierKind.HBM, TierKind.DRAM, TierKind.SSD)
    )


@pytest.mark.skipif(
    not (TRACES / "mooncake_conversation_trace.jsonl").is_file(),
    reason="Mooncake's conversation trace is absent (set KVSTORE_TEST_TRACES)",
)
def test_mooncake_conversation_trace_quick() -> None:
    trace = load_trace(TRACES / "mooncake_conversation_trace.jsonl")
    config = ReplayConfig(Sizing(40, 200, 2000), max_requests=300)
    runs = replay(from_trace(trace), parse_policies("lru,predictor"), config)
    for run in runs:
        assert run.requests == 300
        assert run.hit_tokens + run.recomputed_tokens == run.prompt_tokens
        assert run.hit_rate > 0.05  # the shared system prompt alone is a hit for every request


def test_ablation_replays_the_learners_labels_and_blanks_features(trace_file: Path) -> None:
    trace = load_trace(trace_file)
    examples = idle_examples(trace)
    assert len(examples.at) == len(trace.requests)  # every request ends idle: no overlaps here
    returned = np.isfinite(examples.gap)
    assert returned.sum() == len(trace.requests) - len(trace.sessions())
    assert (examples.gap[returned] > 0).all()

    # Same labels, same censoring as the online learner over the same events.
    horizons = (60.0, 600.0)
    online = train([trace], ReturnModel(len(feature_names()), horizons)).report()
    windowed = prequential(examples, horizons)
    assert windowed["n"] == online["n"]
    assert windowed["positive_rate"] == online["positive_rate"]
    assert windowed["last_gap_auc"] == online["last_gap_auc"]

    # Feature names map to their columns; the table has one row per feature blanked.
    names = [name for name, _, _ in FEATURES]
    assert columns_of(["requests"]) == [feature_names().index("requests")]
    assert len(columns_of(names)) == len(feature_names())
    with pytest.raises(ConfigError, match="unknown features"):
        columns_of(["no-such-feature"])
    table = ablation(examples, horizons)
    assert set(table) == {"all", *names}
    assert all(set(aucs) == {"60", "600"} for aucs in table.values())


def test_a_blurred_oracle_has_the_auc_asked_for_and_stays_calibrated() -> None:
    rng = np.random.default_rng(1)
    gaps = np.where(rng.random(20_000) < 0.4, rng.uniform(1, 600, 20_000), math.inf)
    rates = base_rates([0.0] * len(gaps), list(gaps), (60.0, 600.0), end=1e9)
    assert rates[1] == pytest.approx(0.4, abs=0.01)
    oracle = BlurredOracle(0.7, rates, seed=0)
    forecasts = [oracle.forecast("s", 0.0, float(g), (60.0, 600.0)) for g in gaps]
    p = np.array([f.probabilities for f in forecasts])
    assert (p[:, 1] >= p[:, 0]).all()  # monotone across horizons
    labels = gaps <= 600.0
    scores = PrequentialScores()
    for probability, label in zip(p[:, 1], labels, strict=True):
        scores.record(600.0, float(probability), int(label), None)
    assert scores.report()["auc"]["600"] == pytest.approx(0.7, abs=0.015)
    assert p[:, 1].mean() == pytest.approx(labels.mean(), abs=0.02)  # calibrated on average
    assert parse_policies("oracle:0.7,oracle")[0].name == "oracle:0.7"
    with pytest.raises(ConfigError, match=r"\(0.5, 1\)"):
        parse_policies("oracle:1.5")


def test_the_head_of_a_trace_hides_returns_after_its_end(trace_file: Path) -> None:
    examples = idle_examples(load_trace(trace_file))
    until = float(np.median(examples.at))
    first = head(examples, until)
    assert len(first.at) == int((examples.at < until).sum())
    assert first.end == until
    late = first.at + examples.gap[examples.at < until] >= until
    assert late.any()  # some sessions came back only after the cut ...
    assert np.isinf(first.gap[late]).all()  # ... and the head does not know it
    assert (first.gap[~late] == examples.gap[examples.at < until][~late]).all()


def test_score_from_charges_only_the_later_requests_after_the_same_warm_up(
    trace_file: Path, results
) -> None:
    trace, everything = results
    cut = trace.requests[len(trace.requests) // 2].time
    later = [r for r in trace.requests if r.time >= cut]
    (lru,) = replay(from_trace(trace), parse_policies("lru"), ReplayConfig(SMALL, score_from=cut))
    assert lru.requests == len(later)
    assert lru.prompt_tokens == sum(r.prompt_tokens for r in later)
    assert lru.hit_tokens + lru.recomputed_tokens == lru.prompt_tokens
    # The same run, charged from the cut: the later requests cost what they cost in full.
    full = everything[0]
    assert full.name == "lru"
    assert lru.ttft_s == full.ttft_s[len(full.ttft_s) - len(later) :]

"""OnlineLearner and PrequentialScores: labels, forecasts, scores, and learning a planted rule."""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.predictor.learning.features import feature_names
from kvstore.predictor.learning.model import ReturnModel
from kvstore.predictor.learning.online import OnlineLearner, ReturnForecast
from kvstore.predictor.learning.portable import settle
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.wire.events import RequestFinished, RequestStarted, SessionEvent, Trigger

torch.set_num_threads(1)


class RecordingModel(ReturnModel):
    """A real model that also remembers every batch of labels it was given."""

    def __init__(self) -> None:
        super().__init__(len(feature_names()))
        self.batches: list[tuple[list[list[float]], list[list[bool]]]] = []

    def update(self, features: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
        self.batches.append((labels.tolist(), mask.tolist()))
        return super().update(features, labels, mask)


def start(session: str, at: float, trigger: Trigger = Trigger.USER) -> RequestStarted:
    return RequestStarted(session, trigger, 100, 0, at)


def finish(session: str, at: float, tool: bool = False) -> RequestFinished:
    return RequestFinished(session, 2, 50, 1000, tool, 0, 0, at)


def learner() -> tuple[OnlineLearner, RecordingModel, PrequentialScores]:
    model, scores = RecordingModel(), PrequentialScores()
    return OnlineLearner(model, SessionTracker(), scores, learn_at_horizon=False), model, scores


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney with ties (average ranks), the reference for the histogram AUC."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    return float((ranks[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# --- forecasts -----------------------------------------------------------------------


def test_within_interpolates_between_horizons() -> None:
    f = ReturnForecast("s", 0.0, (60.0, 600.0, 3600.0), (0.4, 0.8, 0.9))
    assert f.within(0.0) == 0.0
    assert [f.within(h) for h in f.horizons] == pytest.approx([0.4, 0.8, 0.9])
    assert 0.4 < f.within(200.0) < 0.8
    assert f.within(86400.0) == pytest.approx(0.9)
    grid = [f.within(s) for s in np.geomspace(1, 1e5, 50)]
    assert all(a <= b for a, b in pairwise(grid))


def test_forecast_is_open_while_idle_and_closes_on_return() -> None:
    online, _, _ = learner()
    online.observe(start("s", 0.0))
    forecast = online.observe(finish("s", 10.0))
    assert forecast is not None and forecast.at == 10.0
    assert online.forecast("s") == forecast
    online.tick(10_000.0)  # every horizon known, the session still idle
    assert online.forecast("s") is not None
    online.observe(start("s", 20_000.0))
    assert online.forecast("s") is None


# --- labels --------------------------------------------------------------------------


def test_return_after_90s_labels_0_at_1min_and_1_beyond_in_one_step() -> None:
    online, model, _ = learner()
    tracker = online.tracker
    tracker.started(start("s", 0.0))
    online.on_idle(tracker.finished(finish("s", 10.0)), 10.0)
    state, gap = tracker.started(start("s", 100.0))
    assert gap == 90.0
    online.on_return(state, gap)
    assert model.batches == [([[0.0, 1.0, 1.0]], [[True, True, True]])]
    online.on_return(state, gap)  # no double counting
    assert len(model.batches) == 1


def test_a_session_idle_while_its_tool_runs_is_forecast_from_tool_returns() -> None:
    online, model, scores = learner()
    before = online.observe(finish("t", 0.0, tool=True))
    assert before is not None and before.probabilities == (0.9, 0.9, 0.9)  # the prior
    online.observe(start("t", 3.0, Trigger.TOOL))  # back in 3 s: within every horizon
    after = online.observe(finish("t", 4.0, tool=True))
    assert after is not None and after.probabilities == settle([10 / 11] * 3)  # on the grid
    assert model.batches == []  # the model learns from the waits a human ends only
    assert scores.report()["n"] == {"60": 1, "600": 1, "3600": 1}  # yet every one is scored
    human = online.observe(finish("h", 5.0))
    assert human is not None and human.probabilities != after.probabilities


def test_passing_horizon_is_labelled_0_then_the_return_labels_the_rest() -> None:
    online, model, scores = learner()
    online.observe(start("s", 0.0))
    online.observe(finish("s", 10.0))
    online.tick(70.0)  # exactly 60 s idle: not passed yet
    assert model.batches == []
    online.tick(70.5)
    online.tick(71.0)  # no double counting
    assert model.batches == [([[0.0, 0.0, 0.0]], [[True, False, False]])]
    online.observe(start("s", 100.0))
    assert model.batches[1] == ([[0.0, 1.0, 1.0]], [[False, True, True]])
    assert scores.report()["n"] == {"60": 1.0, "600": 1.0, "3600": 1.0}


def test_a_return_exactly_at_the_horizon_counts_as_within() -> None:
    online, model, _ = learner()
    online.observe(finish("s", 0.0))
    online.observe(start("s", 60.0))
    assert model.batches == [([[1.0, 1.0, 1.0]], [[True, True, True]])]


def test_no_return_labels_every_horizon_0_once() -> None:
    online, model, scores = learner()
    online.observe(finish("a", 0.0))
    online.observe(finish("b", 0.0))
    online.tick(5000.0)  # all six labels in one batch, one step
    assert model.batches == [([[0.0] * 3, [0.0] * 3], [[True] * 3, [True] * 3])]
    online.observe(start("a", 6000.0))  # a late return labels nothing new
    assert len(model.batches) == 1
    assert scores.report()["n"] == {"60": 2.0, "600": 2.0, "3600": 2.0}
    assert scores.report()["positive_rate"]["3600"] == 0.0


def test_overlapping_requests_forecast_only_when_the_last_ends() -> None:
    online, model, _ = learner()
    online.observe(start("s", 0.0))
    online.observe(start("s", 1.0))
    assert online.observe(finish("s", 2.0)) is None
    assert online.observe(finish("s", 3.0)) is not None


def test_forgotten_or_superseded_forecasts_are_never_labelled() -> None:
    online, model, _ = learner()
    online.observe(finish("s", 0.0))
    online.forget("s")
    online.tick(5000.0)
    online.observe(finish("t", 5000.0))
    online.observe(finish("t", 5010.0))  # idle again without a return: a start was lost
    online.tick(9000.0)
    assert model.batches == [([[0.0] * 3], [[True] * 3])]  # only t's second forecast


def test_an_idle_period_that_ended_on_another_host_is_not_labelled_here() -> None:
    online, model, scores = learner()
    online.observe(finish("m", 0.0))  # idle here; its next request went to another host
    back = RequestStarted("m", Trigger.USER, 100, 0, 40.0, idle_since=30.0)
    online.observe(back)
    online.tick(9000.0)
    assert model.batches == [] and online.forecast("m") is None
    # The same return seen here end to end is labelled, once.
    online.observe(finish("m", 50.0))
    online.observe(RequestStarted("m", Trigger.USER, 100, 0, 80.0, idle_since=50.0))
    assert model.batches == [([[1.0] * 3], [[True] * 3])]


# --- scores --------------------------------------------------------------------------


def test_histogram_auc_equals_mann_whitney_with_ties() -> None:
    rng = np.random.default_rng(0)
    probabilities = rng.choice([0.05, 0.2, 0.5, 0.8, 0.95], size=2000)
    labels = (rng.random(2000) < probabilities).astype(int)
    scores = PrequentialScores()
    for p, y in zip(probabilities, labels, strict=True):
        scores.record(60.0, float(p), int(y), None)
    assert scores.report()["auc"]["60"] == pytest.approx(
        exact_auc(probabilities, labels), abs=1e-12
    )

    continuous = rng.random(2000)
    scores = PrequentialScores()
    for p, y in zip(continuous, labels, strict=True):
        scores.record(60.0, float(p), int(y), None)
    assert scores.report()["auc"]["60"] == pytest.approx(exact_auc(continuous, labels), abs=2e-3)


def test_brier_log_loss_and_baselines_by_hand() -> None:
    scores = PrequentialScores()
    scores.record(60.0, 0.8, 1, 30.0)
    scores.record(60.0, 0.4, 0, 30.0)
    report = scores.report()
    assert report["brier"]["60"] == pytest.approx((0.2**2 + 0.4**2) / 2)
    assert report["log_loss"]["60"] == pytest.approx(-(math.log(0.8) + math.log(0.6)) / 2)
    # base rate: 1/2 before any label, then (1 + 1) / (1 + 2) after one positive
    assert report["base_rate_brier"]["60"] == pytest.approx((0.5**2 + (2 / 3) ** 2) / 2)
    assert report["last_gap_brier"]["60"] == report["base_rate_brier"]["60"]  # same bin twice
    assert report["auc"]["60"] == 1.0


def test_auc_is_nan_until_both_labels_are_seen() -> None:
    scores = PrequentialScores()
    scores.record(600.0, 0.9, 1, None)
    assert math.isnan(scores.report()["auc"]["600"])


def test_last_gap_baseline_ranks_by_whether_the_last_gap_was_short() -> None:
    scores = PrequentialScores()
    rng = np.random.default_rng(0)
    for _ in range(200):
        last_gap = float(rng.choice([10.0, 5000.0]))
        scores.record(60.0, 0.5, int(last_gap < 60.0), last_gap)
    report = scores.report()
    assert report["last_gap_auc"]["60"] > 0.95
    assert report["base_rate_auc"]["60"] < 0.7


# --- a planted rule ------------------------------------------------------------------


def planted_sessions(
    rng: np.random.Generator, n_sessions: int
) -> tuple[list[SessionEvent], dict[tuple[str, float], float]]:
    """Sessions whose return within 60 s depends only on ``tool_running``.

    After a request that ended with a tool still running the session is back
    within 60 s with probability 0.9, otherwise 0.1; the slow returns take
    60 s plus an exponential of mean 20 min. Steps, output and context tokens,
    time of day and triggers vary but carry no signal. Returns the events in
    time order and, per idle event (session, time), the true P(<= 60 s).
    """
    events: list[SessionEvent] = []
    truth: dict[tuple[str, float], float] = {}
    for s in range(n_sessions):
        session, at, context, trigger = f"s{s}", rng.uniform(0, 3 * 86400), 1000, Trigger.USER
        for _ in range(int(rng.integers(3, 13))):
            events.append(RequestStarted(session, trigger, context, 0, at))
            at += rng.uniform(2, 60)
            tool = bool(rng.random() < 0.4)
            context += int(rng.integers(100, 5000))
            steps, output = int(rng.integers(1, 30)), int(rng.integers(10, 2000))
            events.append(RequestFinished(session, steps, output, context, tool, 0, 0, at))
            truth[(session, at)] = p = 0.9 if tool else 0.1
            at += rng.uniform(1, 60) if rng.random() < p else 60 + rng.exponential(1200)
            trigger = Trigger.TOOL if tool else Trigger.USER
        events.append(RequestStarted(session, trigger, context, 0, at))
    events.sort(key=lambda e: e.time)
    return events, truth


def test_online_learning_finds_a_planted_rule_and_stays_calibrated() -> None:
    events, truth = planted_sessions(np.random.default_rng(0), n_sessions=420)
    scores = PrequentialScores()
    online = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker(), scores)
    forecasts = [f for event in events if (f := online.observe(event)) is not None]
    online.tick(math.inf)

    p_model = np.array([f.probabilities[0] for f in forecasts])
    p_true = np.array([truth[(f.session, f.at)] for f in forecasts])
    report = scores.report()
    assert 3000 <= report["n"]["60"] == len(forecasts)
    labels = positives_at_60s(events, forecasts)
    assert report["positive_rate"]["60"] == pytest.approx(labels.mean())

    ceiling = exact_auc(p_true, labels)
    auc = report["auc"]["60"]
    assert auc == pytest.approx(exact_auc(p_model, labels), abs=2e-3)
    assert auc > ceiling - 0.02
    assert auc > report["base_rate_auc"]["60"] + 0.3
    assert auc > report["last_gap_auc"]["60"] + 0.3
    assert report["brier"]["60"] < report["base_rate_brier"]["60"] - 0.1
    assert report["log_loss"]["600"] < report["base_rate_log_loss"]["600"] - 0.05

    # Calibration over the second half (the first is still learning the rule).
    late_p, late_y = p_model[len(p_model) // 2 :], labels[len(labels) // 2 :]
    for low, high in ((0.0, 0.3), (0.7, 1.0)):
        in_bin = (late_p >= low) & (late_p < high)
        assert in_bin.sum() > 300
        assert late_p[in_bin].mean() == pytest.approx(late_y[in_bin].mean(), abs=0.04)


def positives_at_60s(events: list[SessionEvent], forecasts: list[ReturnForecast]) -> np.ndarray:
    """The true label at 60 s of each forecast, read from the next start of its session."""
    starts: dict[str, list[float]] = {}
    for event in events:
        if isinstance(event, RequestStarted):
            starts.setdefault(event.session, []).append(event.time)
    labels = [min(t for t in starts[f.session] if t > f.at) - f.at <= 60.0 for f in forecasts]
    return np.array(labels, dtype=int)


def conditional(forecast: ReturnForecast, elapsed: float) -> list[float]:
    """P(back within h more seconds | not back after ``elapsed``), at each horizon."""
    before = forecast.within(elapsed)
    return [(forecast.within(elapsed + h) - before) / (1 - before) for h in forecast.horizons]


def test_a_new_session_of_its_user_forecasts_an_idle_session_again() -> None:
    learner = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker())
    learner.observe(start("a", 0.0), user="u")
    learner.observe(finish("a", 10.0))
    learner.observe(start("x", 0.0), user="v")  # another user's session: untouched
    learner.observe(finish("x", 10.0))
    at_idle = learner.forecast("a")
    assert at_idle is not None
    learner.observe(start("b", 100.0), user="u")
    ((state, revised),) = learner.take_revisions()
    assert state.session == "a" and revised.at == 100.0
    # Nothing known yet of superseded sessions: half of what it would have been.
    halves = [0.5 * p for p in conditional(at_idle, 90.0)]
    assert revised.probabilities == pytest.approx(halves, abs=0.5e-6)  # on the forecast grid
    assert learner.take_revisions() == []
    assert learner.forecast("a") is at_idle  # scores stay on the forecast made at idle
    learner.observe(start("b", 120.0), user="u")  # not a new session: supersedes nothing
    assert learner.take_revisions() == []


def test_how_often_superseded_sessions_come_back_is_learnt() -> None:
    learner = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker())
    learner.observe(start("a", 0.0), user="u")
    learner.observe(finish("a", 10.0))
    learner.observe(start("b", 100.0), user="u")  # supersedes "a", which never returns
    learner.observe(finish("b", 110.0))
    learner.take_revisions()
    learner.tick(100.0 + 3600.0 + 1.0)  # the longest horizon passed: "a" counts as not back
    learner.observe(start("c", 4000.0), user="u")  # supersedes "b"
    ((state, revised),) = learner.take_revisions()
    b = learner.forecast("b")
    assert state.session == "b" and b is not None
    thirds = [p / 3 for p in conditional(b, 4000.0 - 110.0)]
    assert revised.probabilities == pytest.approx(thirds)


def test_sessions_waiting_on_a_tool_are_counted_apart() -> None:
    learner = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker())
    # A parent hands off to a subagent (its call ended in a tool call) which comes back.
    learner.observe(start("parent", 0.0), user="u")
    learner.observe(finish("parent", 10.0, tool=True))
    learner.observe(start("subagent", 11.0), user="u")
    ((state, _),) = learner.take_revisions()
    assert state.session == "parent"
    learner.observe(finish("subagent", 50.0))
    learner.observe(start("parent", 60.0), user="u")  # back: one return of a waiting parent
    learner.observe(finish("parent", 70.0, tool=True))
    learner.observe(start("subagent-2", 80.0), user="u")
    revisions = dict((s.session, f) for s, f in learner.take_revisions())
    parent = learner.forecast("parent")
    assert set(revisions) == {"parent", "subagent"} and parent is not None
    twothirds = [2 / 3 * p for p in conditional(parent, 10.0)]
    assert revisions["parent"].probabilities == pytest.approx(twothirds)
    # The finished subagent waits for its human, not a tool: that count knows nothing yet.
    subagent = learner.forecast("subagent")
    assert subagent is not None
    halves = [0.5 * p for p in conditional(subagent, 30.0)]
    assert revisions["subagent"].probabilities == pytest.approx(halves, abs=0.5e-6)


def test_the_counting_tables_are_saved_with_the_model_and_restored(tmp_path: Path) -> None:
    """A learner over a reloaded model forecasts tools, human waits and superseded sessions
    from what the first one counted, not from the priors."""
    first = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker())
    for k in range(4):  # tools that took two minutes: not back within one
        first.observe(finish(f"tool-{k}", 100.0 * k, tool=True))
        first.observe(start(f"tool-{k}", 100.0 * k + 120.0, Trigger.TOOL))
    first.observe(start("h", 1000.0))
    first.observe(finish("h", 1010.0))
    first.observe(start("h", 1020.0))  # a human wait of 10 s: the table's bin 0
    first.observe(start("a", 2000.0), user="u")
    first.observe(finish("a", 2010.0))
    first.observe(start("b", 2100.0), user="u")  # supersedes "a", which never returns
    first.tick(2100.0 + 3600.0 + 1.0)
    path = tmp_path / "model.pt"
    first.model.save(path)

    fresh = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker())
    again = OnlineLearner(ReturnModel.load(path), SessionTracker())
    learnt, restored, prior = (
        learner.model.counts.to_state() for learner in (first, again, fresh)
    )
    assert restored == learnt != prior
    at = 10_000.0
    forecasts = [learner.observe(finish("t", at, tool=True)) for learner in (first, again)]
    assert forecasts[0] is not None and forecasts[1] is not None
    assert forecasts[0].probabilities == forecasts[1].probabilities
    assert forecasts[0].probabilities[0] < 0.9  # the prior: 9 in 10 within every horizon


def test_saved_counts_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    model = ReturnModel(len(feature_names()))
    path = tmp_path / "model.pt"
    model.save(path)
    data = torch.load(path, weights_only=True)
    data["counts"]["tools"] = [[1.0, 2.0], [3.0, 4.0]]  # two horizons, the model has three
    torch.save(data, path)
    with pytest.raises(ConfigError, match="do not fit a model of 3 horizons"):
        ReturnModel.load(path)
    data["counts"] = {"tools": "nonsense"}
    torch.save(data, path)
    with pytest.raises(ConfigError, match="malformed"):
        ReturnModel.load(path)

"""How much each feature is worth: prequential scores of the return model with a
feature blanked out, on the idle periods of a trace.

The online learner forecasts when a session goes idle and learns each label
when its horizon closes (``OnlineLearner``, ``learn_at_horizon``). Replaying a
trace through it costs one model call per event, about a minute for the
Mooncake conversation trace; an ablation needs one such run per feature. So
this module extracts the idle periods once (``idle_examples``: the features at
idle, exactly as ``feature_vector`` computes them, and the true gap) and then
replays the same predict-then-learn order in windows of ``window_s`` seconds
(``prequential``): every forecast made in a window uses the model as it was at
the window's start, and every label whose horizon closed in it is learnt in one
step at its end. With the replay's 10 s tick that is what the daemon and the
replay do, up to the order of events inside one tick.

A blanked feature is set to zero in every example: the model's running
standardisation then sees a constant, which reads zero after scaling, so the
feature carries nothing while the input width (and every other weight) stays
the same. The importance of a feature is the AUC it loses when blanked
(``ablation``); ``docs/predictor_features.md`` has the numbers.

Labels a trace cannot tell (the horizon runs past its end without a return)
are censored, as in the replay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.predictor.learning.features import FEATURES, feature_names, feature_vector
from kvstore.predictor.learning.model import DEFAULT_LR, REHEARSAL, Rehearsal, ReturnModel
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.replay.costs import DECODE_TOKENS_PER_S, stand_in_layout
from kvstore.predictor.replay.timeline import BlockKeys, Step, finished_event, session_events
from kvstore.predictor.replay.traces import Trace
from kvstore.wire.events import RequestStarted


@dataclass(frozen=True)
class IdleExamples:
    """Every idle period of a trace: when, the features at that moment, and the truth."""

    at: np.ndarray  # (n,) when the session went idle, trace seconds
    features: np.ndarray  # (n, F) float32, ``feature_vector`` at that moment
    gap: np.ndarray  # (n,) seconds to the session's next request; inf: none in the trace
    last_gap: np.ndarray  # (n,) the session's previous gap at idle; nan: none (baseline)
    end: float  # the trace's last event: labels closing later are censored


def idle_examples(trace: Trace, decode_tokens_per_s: float = DECODE_TOKENS_PER_S) -> IdleExamples:
    """The idle periods of ``trace``, with features from a ``SessionTracker`` fed the same
    events the replay feeds it."""
    tracker = SessionTracker()
    chains = BlockKeys(Namespace("replay", stand_in_layout(trace.block_tokens)))
    digest = chains.namespace.digest
    at: list[float] = []
    rows: list[np.ndarray] = []
    gaps: list[float] = []
    last: list[float] = []
    end = 0.0
    for event in session_events(trace.requests, decode_tokens_per_s):
        request = trace.requests[event.request]
        keys = chains.of(request)
        end = max(end, event.time)
        if event.step is Step.START:
            started = RequestStarted(
                request.session, request.trigger, request.prompt_tokens, 0, event.time
            )
            tracker.started(started, keys, digest, request.user)
            continue
        state = tracker.finished(finished_event(request, event, 0, 0), keys, digest)
        if state.active:
            continue
        at.append(event.time)
        rows.append(feature_vector(state, event.time, tracker))
        gaps.append(math.inf if event.next_start is None else event.next_start - event.time)
        last.append(state.gaps[-1] if state.gaps else math.nan)
    width = len(feature_names())
    return IdleExamples(
        at=np.asarray(at, dtype=np.float64),
        features=np.stack(rows) if rows else np.zeros((0, width), dtype=np.float32),
        gap=np.asarray(gaps, dtype=np.float64),
        last_gap=np.asarray(last, dtype=np.float64),
        end=end,
    )


def head(examples: IdleExamples, until: float) -> IdleExamples:
    """The idle periods before ``until``, as a trace ending there would have shown them:
    a return after ``until`` is unknown (``inf``), so nothing later leaks in. For
    pre-training on the first part of a trace and scoring on the rest."""
    keep = examples.at < until
    at = examples.at[keep]
    gap = examples.gap[keep]
    return IdleExamples(
        at=at,
        features=examples.features[keep],
        gap=np.where(at + gap < until, gap, math.inf),
        last_gap=examples.last_gap[keep],
        end=min(examples.end, until),
    )


def columns_of(names: Sequence[str]) -> list[int]:
    """The feature-vector columns of the features named (``FEATURES`` names)."""
    columns: list[int] = []
    start = 0
    wanted = set(names)
    unknown = wanted - {name for name, _, _ in FEATURES}
    if unknown:
        raise ConfigError(f"unknown features: {sorted(unknown)}")
    for name, width, _ in FEATURES:
        if name in wanted:
            columns.extend(range(start, start + width))
        start += width
    return columns


def prequential(
    examples: IdleExamples,
    horizons: Sequence[float],
    *,
    blank: Sequence[str] = (),
    hidden: int = 16,
    lr: float = DEFAULT_LR,
    rehearsal: Rehearsal | None = REHEARSAL,
    seed: int = 0,
    window_s: float = 10.0,
    model: ReturnModel | None = None,
    since: float = -math.inf,
) -> dict[str, dict[str, float]]:
    """Prequential scores (``PrequentialScores.report``) of a fresh model (or ``model``,
    which keeps learning) over ``examples`` with the features in ``blank`` zeroed.

    ``since``: score only forecasts made at or after this time (the model still
    learns from the earlier ones): the held-out half of a trace.
    """
    x = examples.features.copy()
    if blank:
        x[:, columns_of(blank)] = 0.0
    if model is None:
        model = ReturnModel(
            x.shape[1], horizons, hidden=hidden, lr=lr, rehearsal=rehearsal, seed=seed
        )
    horizons = model.horizons
    scores = PrequentialScores()
    # (time the label is known, example, horizon index), censored ones left out
    closing = sorted(
        (at + h, i, k)
        for i, at in enumerate(examples.at)
        for k, h in enumerate(horizons)
        if at + h < examples.end
    )
    probabilities = np.zeros((len(x), len(horizons)))
    order = np.argsort(examples.at, kind="stable")
    next_forecast = 0
    next_label = 0
    window_end = (math.floor(examples.at[order[0]] / window_s) + 1) * window_s if len(x) else 0.0
    while next_forecast < len(order) or next_label < len(closing):
        start = next_forecast
        while next_forecast < len(order) and examples.at[order[next_forecast]] < window_end:
            next_forecast += 1
        if next_forecast > start:
            batch = order[start:next_forecast]
            probabilities[batch] = model.predict(x[batch])
        labels: list[tuple[int, int]] = []
        while next_label < len(closing) and closing[next_label][0] < window_end:
            _, i, k = closing[next_label]
            labels.append((i, k))
            next_label += 1
        if labels:
            _learn(model, scores, x, examples, probabilities, labels, since)
        window_end += window_s
    return scores.report()


def _learn(
    model: ReturnModel,
    scores: PrequentialScores,
    x: np.ndarray,
    examples: IdleExamples,
    probabilities: np.ndarray,
    labels: list[tuple[int, int]],
    since: float,
) -> None:
    rows: dict[int, int] = {}
    for i, _ in labels:
        rows.setdefault(i, len(rows))
    targets = np.zeros((len(rows), len(model.horizons)), dtype=np.float32)
    mask = np.zeros_like(targets, dtype=bool)
    for i, k in labels:
        horizon = model.horizons[k]
        label = int(examples.gap[i] <= horizon)
        targets[rows[i], k] = label
        mask[rows[i], k] = True
        if examples.at[i] >= since:
            last = examples.last_gap[i]
            scores.record(
                horizon, float(probabilities[i, k]), label, None if math.isnan(last) else last
            )
    model.update(x[list(rows)], targets, mask)


def ablation(
    examples: IdleExamples, horizons: Sequence[float], **options: float | int
) -> dict[str, dict[str, float]]:
    """AUC per horizon with every feature, and with each feature blanked in turn:
    ``{"all": {"60": auc, ..}, NAME: {"60": auc, ..}, ...}``."""
    result = {"all": prequential(examples, horizons, **options)["auc"]}  # type: ignore[arg-type]
    for name, _, _ in FEATURES:
        report = prequential(examples, horizons, blank=[name], **options)  # type: ignore[arg-type]
        result[name] = report["auc"]
    return result

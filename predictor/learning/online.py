"""Online learning of return times: forecast at idle, learn when the label is known.

The order of things for one idle period of a session::

    request_finished ─► on_idle: features at this moment, forecast P(return within h)
                         for every horizon; the forecast is now *open*
    time passes      ─► tick(now): each horizon h with now - at > h is labelled 0
    request_started  ─► on_return(gap): every horizon still open is labelled
                         1 if gap <= h else 0; the forecast is closed

Each label is known exactly once, is scored (``PrequentialScores``) against
the probability given at idle, and is then learnt from: every batch of newly
known labels (one return, or all horizons that one ``tick`` saw pass) is one
optimiser step. Scoring before learning is what makes the scores prequential.

A session that goes idle again without having returned (a lost
``request_started``) or is forgotten leaves its open labels unknown: they are
dropped, not guessed, because a wrong label teaches the model a wrong lesson.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.keys import ChunkKey
from kvstore.predictor.learning.counting import (
    HumanGapTable,
    blend,
)
from kvstore.predictor.learning.features import feature_vector
from kvstore.predictor.learning.portable import interpolate, settle
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionState, SessionTracker
from kvstore.wire.events import RequestStarted, SessionEvent

if TYPE_CHECKING:  # a learner is handed its model: it never imports torch itself
    from kvstore.predictor.learning.model import ReturnModel


@dataclass(frozen=True)
class ReturnForecast:
    """P(return within each horizon), made when ``session`` went idle at ``at``."""

    session: str
    at: float
    horizons: tuple[float, ...]
    probabilities: tuple[float, ...]

    def within(self, seconds: float) -> float:
        """P(return within ``seconds`` of going idle), between the horizons.

        Linear in ``log1p(seconds)`` from 0 at 0 s through each horizon, the
        scale on which human waits spread evenly; beyond the last horizon the
        model knows nothing more, so it stays at the last probability.
        """
        xs = [0.0, *(math.log1p(h) for h in self.horizons)]
        return interpolate(math.log1p(max(0.0, seconds)), xs, [0.0, *self.probabilities])


@dataclass(eq=False)  # identity: one entry per idle period, usable as a dict key
class _Open:
    """A forecast with labels still to learn. Owned by ``OnlineLearner``."""

    forecast: ReturnForecast
    features: np.ndarray
    last_gap: float | None  # the session's previous gap at idle, for the last-gap baseline
    unknown: list[bool]  # per horizon: label not known yet
    tool: bool = False  # idle while a tool runs: forecast by ``ToolReturns``, not the model
    gap_bin: int = 0  # its ``HumanGapTable`` bin
    superseded_at: float | None = None  # when its user started another session
    revised: ReturnForecast | None = None  # the forecast made again then (scores keep ``forecast``)


class OnlineLearner:
    """Forecasts for idle sessions, labels as time and returns reveal them, one step per batch.

    Not thread-safe: one caller (the daemon's event handler, the replay loop)
    feeds it events in time order.
    """

    def __init__(
        self,
        model: ReturnModel,
        tracker: SessionTracker,
        scores: PrequentialScores | None = None,
        *,
        learn_at_horizon: bool = True,
    ) -> None:
        """``learn_at_horizon`` (the default): learn (and score) each label when its horizon
        closes, a return's too, rather than as soon as it is known. A return is known early but a
        non-return only at the horizon, so learning returns at once feeds the model
        fresher positives than negatives; with any feature that moves with time (the
        clock, a session's age) it learns that "now" is a time of returns: the
        delayed-feedback bias. Replaying the Mooncake conversation trace, P(back within
        10 min) drifted to 0.999 against a base rate of 0.34 (Brier 0.62) without it,
        and stayed calibrated with it (Brier 0.22). ``False`` learns every label the moment
        it is known: only for tests that check labelling one event at a time."""
        self.model = model
        self.tracker = tracker
        self.scores = scores
        self.learn_at_horizon = learn_at_horizon
        self._open: dict[str, _Open] = {}
        self._returned: dict[_Open, float] = {}  # learn_at_horizon: forecast -> its gap
        # (deadline, sequence, horizon index, forecast): when a horizon of a forecast passes.
        # Entries of sessions that returned early stay until their deadline and are skipped
        # then, so the heap holds at most the forecasts of the last (largest horizon) seconds.
        self._deadlines: list[tuple[float, int, int, _Open]] = []
        self._sequence = 0
        # The counting tables live with the model (saved in its file). Superseded returns
        # are keyed by whether the session was waiting on a tool: a parent whose subagent
        # just started is back when it ends; a session whose user walked away mid-task,
        # or a trace that stops at a tool call, never is.
        counts = model.counts
        self._tools = counts.tools
        self._gap_table = counts.gap_table
        self._superseded = counts.superseded
        # (deadline, sequence, forecast): when a superseded session counts as not back.
        self._superseded_deadlines: list[tuple[float, int, _Open]] = []
        self._revisions: list[tuple[SessionState, ReturnForecast]] = []

    def observe(
        self,
        event: SessionEvent,
        keys: Sequence[ChunkKey] = (),
        namespace: bytes | None = None,
        user: str | None = None,
    ) -> ReturnForecast | None:
        """Feed one event to the tracker and the learner; returns the forecast if it made one.

        The one call a daemon or a replay needs per event: it first labels the
        horizons that passed before ``event.time``, so labels arrive in time order.
        """
        self.tick(event.time)
        if isinstance(event, RequestStarted):
            state, gap = self.tracker.started(event, keys, namespace, user)
            if state.resumed_elsewhere:
                self.forget(state.session)  # its idle period here ended on another host
            elif gap is not None:
                self.on_return(state, gap)
            if state.requests == 1 and state.user is not None:
                self._supersede(state, event.time)
            return None
        state = self.tracker.finished(event, keys, namespace)
        return None if state.active else self.on_idle(state, event.time)

    def on_idle(self, state: SessionState, now: float) -> ReturnForecast:
        """Forecast ``state``'s return; its labels are learnt as they become known. A session
        idle while its tool runs is forecast from how soon tools came back so far; the
        model forecasts, and learns from, the waits a human ends."""
        features = feature_vector(state, now, self.tracker)
        tool = state.tool_running
        gap_bin = HumanGapTable.bin(state.human_gaps)
        if tool:
            probabilities: Sequence[float] = self._tools.predict()
        else:
            model = self.model.predict(features)
            probabilities = blend(model, self._gap_table.predict(gap_bin))
        forecast = ReturnForecast(
            session=state.session,
            at=now,
            horizons=self.model.horizons,
            probabilities=settle(probabilities),
        )
        entry = _Open(
            forecast=forecast,
            features=features,
            last_gap=state.gaps[-1] if state.gaps else None,
            unknown=[True] * len(forecast.horizons),
            tool=tool,
            gap_bin=gap_bin,
        )
        self._open[state.session] = entry
        for k, horizon in enumerate(forecast.horizons):
            self._sequence += 1
            heapq.heappush(self._deadlines, (now + horizon, self._sequence, k, entry))
        return forecast

    def on_return(self, state: SessionState, gap: float) -> None:
        """``state`` returned after ``gap`` seconds idle: label and learn every open horizon."""
        entry = self._open.pop(state.session, None)
        if entry is None:
            return
        since = entry.superseded_at
        counts = self._superseded[entry.tool]
        if since is not None and entry.forecast.at + gap - since <= counts.within_s:
            counts.learn(1)  # back in time (later, ``tick`` has counted it 0)
        if self.learn_at_horizon:  # labelled by ``tick`` as each horizon closes
            self._returned[entry] = gap
            return
        labels = [
            (entry, k, int(gap <= horizon))
            for k, horizon in enumerate(entry.forecast.horizons)
            if entry.unknown[k]
        ]
        self._learn(labels)

    def tick(self, now: float) -> None:
        """Label 0 every open horizon that has passed by ``now`` (strictly), in one step
        (with ``learn_at_horizon``, returns' labels too, 1 where the gap was within)."""
        labels: list[tuple[_Open, int, int]] = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, k, entry = heapq.heappop(self._deadlines)
            gap = self._returned.get(entry)
            if gap is not None:
                labels.append((entry, k, int(gap <= entry.forecast.horizons[k])))
                if k == len(entry.forecast.horizons) - 1:
                    del self._returned[entry]
            elif self._open.get(entry.forecast.session) is entry and entry.unknown[k]:
                labels.append((entry, k, 0))
        self._learn(labels)
        deadlines = self._superseded_deadlines
        while deadlines and deadlines[0][0] < now:
            _, _, entry = heapq.heappop(deadlines)
            if self._open.get(entry.forecast.session) is entry:  # still idle: not back
                self._superseded[entry.tool].learn(0)

    def take_revisions(self) -> list[tuple[SessionState, ReturnForecast]]:
        """Forecasts made again since the last call, for sessions still idle: those whose
        user started another session (``SupersededReturns``). The driver hands each to
        the policy."""
        revisions, self._revisions = self._revisions, []
        return revisions

    def _supersede(self, started: SessionState, now: float) -> None:
        """``started`` is a new session of its user: every other idle session of that user
        is forecast again from now, its forecast read from its idle time so far and scaled
        by how often superseded sessions came back at all, counted apart for those that
        were waiting on a tool (a parent whose subagent this may be) and the rest."""
        for entry in self._open.values():
            state = self.tracker.get(entry.forecast.session)
            if (
                entry.superseded_at is not None
                or state is None
                or state.session == started.session
                or state.user != started.user
            ):
                continue
            entry.superseded_at = now
            self._sequence += 1
            counts = self._superseded[entry.tool]
            deadline = (now + counts.within_s, self._sequence, entry)
            heapq.heappush(self._superseded_deadlines, deadline)
            old = entry.forecast
            elapsed = now - old.at
            before = old.within(elapsed)
            rest = max(1.0 - before, 1e-9)
            conditional = [(old.within(elapsed + h) - before) / rest for h in old.horizons]
            probabilities = settle(counts.scaled(conditional))
            revised = ReturnForecast(old.session, now, old.horizons, probabilities)
            entry.revised = revised
            self._revisions.append((state, revised))

    def forecast(self, session: str) -> ReturnForecast | None:
        """The forecast made when ``session`` last went idle, while it stays idle."""
        entry = self._open.get(session)
        return entry.forecast if entry is not None else None

    def current_forecast(self, session: str) -> ReturnForecast | None:
        """The forecast the policy acts on for idle ``session``: the one made again when
        its user started another session, else the one made at idle."""
        entry = self._open.get(session)
        if entry is None:
            return None
        return entry.revised if entry.revised is not None else entry.forecast

    def forget(self, session: str) -> None:
        """Drop ``session``'s forecast; its unknown labels are never learnt."""
        self._open.pop(session, None)

    def _learn(self, labels: list[tuple[_Open, int, int]]) -> None:
        """Score, then learn from, a batch of newly known labels: one optimiser step."""
        if not labels:
            return
        rows: dict[_Open, int] = {}  # entry -> its row in the batch (model entries only)
        for entry, _, _ in labels:
            if not entry.tool:
                rows.setdefault(entry, len(rows))
        shape = (len(rows), len(self.model.horizons))
        targets = np.zeros(shape, dtype=np.float32)
        mask = np.zeros(shape, dtype=bool)
        for entry, k, label in labels:
            entry.unknown[k] = False
            if entry.tool:
                self._tools.learn(k, label)
            else:
                self._gap_table.learn(entry.gap_bin, k, label)
                row = rows[entry]
                targets[row, k] = label
                mask[row, k] = True
            if self.scores is not None:
                forecast = entry.forecast
                self.scores.record(
                    forecast.horizons[k], forecast.probabilities[k], label, entry.last_gap
                )
        if rows:
            self.model.update(np.stack([entry.features for entry in rows]), targets, mask)

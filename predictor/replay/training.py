"""Offline training of the return model from traces: ``kvstore train-predictor``'s core.

The model learns exactly as it would online: the trace's session events go
through a ``SessionTracker`` and an ``OnlineLearner`` (no store, no policy),
so a pre-trained file is what a daemon would have learnt had it served those
traces, and its scores are prequential. Forecasts still open when a trace
ends are censored, not labelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.keys import Namespace
from kvstore.predictor.learning.model import ReturnModel
from kvstore.predictor.learning.online import OnlineLearner
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.replay.costs import DECODE_TOKENS_PER_S, stand_in_layout
from kvstore.predictor.replay.timeline import BlockKeys, Step, finished_event, session_events
from kvstore.predictor.replay.traces import Trace
from kvstore.wire.events import RequestStarted


def train(
    traces: Sequence[Trace],
    model: ReturnModel,
    decode_tokens_per_s: float = DECODE_TOKENS_PER_S,
) -> PrequentialScores:
    """Replay the session events of ``traces`` through an ``OnlineLearner``, in order;
    returns its prequential scores over all of them."""
    scores = PrequentialScores()
    for trace in traces:
        learner = OnlineLearner(model, SessionTracker(), scores)
        chains = BlockKeys(Namespace("replay", stand_in_layout(trace.block_tokens)))
        digest = chains.namespace.digest
        for event in session_events(trace.requests, decode_tokens_per_s):
            request = trace.requests[event.request]
            keys = chains.of(request)
            if event.step is Step.START:
                started = RequestStarted(
                    request.session, request.trigger, request.prompt_tokens, 0, event.time
                )
                learner.observe(started, keys, digest, request.user)
            else:
                learner.observe(finished_event(request, event, 0, 0), keys, digest)
    return scores

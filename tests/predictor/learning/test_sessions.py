"""SessionTracker: gaps and idleness from events, per-user history, session inference."""

from __future__ import annotations

from kvstore.keys import KVLayout, Namespace, chunk_keys
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger

NS = Namespace("test-model", KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, chunk_tokens=4))


def start(session: str, at: float, trigger: Trigger = Trigger.USER) -> RequestStarted:
    return RequestStarted(session, trigger, prompt_tokens=100, cached_tokens=0, time=at)


def finish(
    session: str, at: float, *, steps: int = 3, output: int = 50, tool: bool = False
) -> RequestFinished:
    return RequestFinished(session, steps, output, 1000, tool, 0, 0, at)


def test_idle_gap_is_measured_from_finish_to_next_start() -> None:
    tracker = SessionTracker()
    state, gap = tracker.started(start("a", 100.0))
    assert gap is None and state.active and state.first_seen == 100.0
    tracker.finished(finish("a", 110.0))
    assert [s.session for s in tracker.idle()] == ["a"]
    assert state.idle_since == 110.0 and not state.active

    state, gap = tracker.started(start("a", 200.0, Trigger.TOOL))
    assert gap == 90.0
    assert state.gaps == [90.0] and state.requests == 2
    assert state.last_trigger is Trigger.TOOL
    assert state.idle_since is None and tracker.idle() == []


def test_overlapping_requests_keep_the_session_active_until_the_last_ends() -> None:
    tracker = SessionTracker()
    tracker.started(start("a", 0.0))
    _, gap = tracker.started(start("a", 1.0))
    assert gap is None
    state = tracker.finished(finish("a", 5.0))
    assert state.active and state.idle_since is None
    state = tracker.finished(finish("a", 8.0))
    assert not state.active and state.idle_since == 8.0
    _, gap = tracker.started(start("a", 20.0))
    assert gap == 12.0


def test_finish_records_what_the_request_looked_like() -> None:
    tracker = SessionTracker()
    tracker.started(start("a", 0.0))
    state = tracker.finished(finish("a", 4.0, steps=7, output=321, tool=True))
    assert (state.last_steps, state.last_output_tokens, state.context_tokens) == (7, 321, 1000)
    assert state.tool_running


def test_finish_without_a_start_still_makes_the_session_idle() -> None:
    tracker = SessionTracker()
    state = tracker.finished(finish("late", 50.0))
    assert state.requests == 0 and state.idle_since == 50.0
    _, gap = tracker.started(start("late", 80.0))
    assert gap == 30.0


def test_user_history_spans_sessions_and_sticks_to_the_session() -> None:
    tracker = SessionTracker()
    for session, offset in (("a", 0.0), ("b", 1000.0)):
        tracker.started(start(session, offset), user="u1")
        tracker.finished(finish(session, offset + 10.0))
        tracker.started(start(session, offset + 40.0 + offset / 100))  # user not repeated
    assert list(tracker.user_gaps("u1")) == [30.0, 40.0]
    b = tracker.get("b")
    assert b is not None and b.user == "u1"
    assert list(tracker.user_gaps("nobody")) == [] and list(tracker.user_gaps(None)) == []


def test_infer_finds_the_session_whose_chain_the_keys_extend() -> None:
    tokens = list(range(40))
    tracker = SessionTracker()
    tracker.started(start("short", 0.0), keys=chunk_keys(NS, tokens[:8]), namespace=NS.digest)
    tracker.started(start("long", 0.0), keys=chunk_keys(NS, tokens[:16]))

    assert tracker.infer(chunk_keys(NS, tokens[:24])) == "long"  # longest match wins
    assert tracker.infer(chunk_keys(NS, tokens[:12])) == "short"  # "long" is not a prefix of it
    assert tracker.infer(chunk_keys(NS, tokens[:16])) == "long"  # equal chains continue too
    assert tracker.infer(chunk_keys(NS, [t + 100 for t in tokens])) is None
    assert tracker.infer(chunk_keys(NS, tokens[:4])) is None  # shorter than every chain
    assert tracker.infer([]) is None
    short = tracker.get("short")
    assert short is not None and short.namespace == NS.digest

    tracker.forget("long")
    assert tracker.infer(chunk_keys(NS, tokens[:24])) == "short"


def test_infer_follows_a_chain_as_the_session_moves_on() -> None:
    tokens = list(range(40))
    tracker = SessionTracker()
    tracker.started(start("a", 0.0), keys=chunk_keys(NS, tokens[:8]))
    tracker.finished(finish("a", 1.0), keys=chunk_keys(NS, tokens[:12]))  # prompt + answer
    assert tracker.infer(chunk_keys(NS, tokens[:8])) is None  # the old chain is not indexed
    assert tracker.infer(chunk_keys(NS, tokens[:20])) == "a"


def test_sessions_sharing_a_chain_resolve_to_the_latest_then_the_other() -> None:
    system = chunk_keys(NS, list(range(8)))
    tracker = SessionTracker()
    tracker.started(start("first", 0.0), keys=system)
    tracker.started(start("second", 1.0), keys=system)
    assert tracker.infer(system) == "second"
    tracker.finished(finish("second", 2.0), keys=chunk_keys(NS, list(range(12))))
    assert tracker.infer(system) == "first"


def moved(session: str, at: float, idle_since: float) -> RequestStarted:
    """A start on this host of a session whose last request finished on another."""
    return RequestStarted(session, Trigger.USER, 100, 0, at, idle_since=idle_since)


def test_a_session_moved_here_keeps_the_gap_it_waited_elsewhere() -> None:
    tracker = SessionTracker()
    state, gap = tracker.started(moved("m", 500.0, idle_since=380.0), user="u")
    assert gap == 120.0 and state.resumed_elsewhere
    assert state.gaps == state.human_gaps == [120.0]
    assert list(tracker.user_human_gaps("u")) == [120.0]
    # Its next gap is its own: seen to begin here.
    tracker.finished(finish("m", 510.0))
    state, gap = tracker.started(moved("m", 530.0, idle_since=510.0))
    assert gap == 20.0 and not state.resumed_elsewhere


def test_a_session_that_ran_elsewhere_meanwhile_measures_from_the_last_finish() -> None:
    tracker = SessionTracker()
    tracker.started(start("m", 0.0))
    tracker.finished(finish("m", 10.0))  # idle here since 10 s; then it ran on another host
    state, gap = tracker.started(moved("m", 300.0, idle_since=250.0))
    assert gap == 50.0 and state.resumed_elsewhere and state.gaps == [50.0]

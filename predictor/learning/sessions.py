"""Per-session state built from session events: who is running, who is idle, and for how long.

The tracker is the predictor's only memory of the past. It turns the stream of
``RequestStarted`` / ``RequestFinished`` events into one ``SessionState`` per
session: request counts, the idle gaps so far, what the request that just
ended looked like, and the chain of chunk keys of the session's latest prompt.
Features read these states; they never see raw events.

Sessions that move between hosts. An engine that sends a session's requests to
another daemon can say when the session last finished (``idle_since`` of
``request_started``). A session new here then starts with that gap in its
history; one this tracker saw go idle earlier, but that ran elsewhere since,
measures its gap from the other host's finish and is marked
``resumed_elsewhere``, so the learner drops the forecast it made here rather than
label an idle period whose end it never saw (the other host did not see it end
either: nobody counts it twice).

A session is *idle* when none of its requests is running. Requests of one
session may overlap (an agent that fans out to sub-agents), so the state
counts running requests rather than keeping a flag: the session goes idle
when the last one finishes, and an idle gap ends when the next one starts.

Session inference. Engines that do not name sessions (the Mooncake traces)
still reveal them: a follow-up turn's prompt extends the previous turn's
prompt, and chunk keys are chained, so ``keys[i]`` names the whole prefix up
to chunk ``i``. The tracker indexes every session's latest chain by its last
key; ``infer(keys)`` walks ``keys`` from the tail and takes the first (hence
longest) indexed prefix, in ``O(len(keys))`` dict probes. When several
sessions end their chains on the same key (two chats over one system prompt),
the one that wrote it last wins; the others stay indexed behind it.

Nothing here reads the clock: times come from the events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.keys import ChunkKey
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger

USER_HISTORY = 512
"""Gaps kept per user: enough for a stable mean, bounded for a daemon that runs for months."""


@dataclass
class SessionState:
    """What the tracker knows about one session. Owned and mutated by ``SessionTracker`` only.

    ``gaps`` holds every completed idle gap of the session (oldest first), and
    ``human_gaps`` those a human ended (a tool's result comes back in seconds, a
    human in minutes to hours: mixed, the two say little about either); a
    session rarely has more than a few hundred requests (TraceLab p99: 137),
    and the tracker's owner calls ``forget`` when a session ends.
    """

    session: str
    user: str | None
    first_seen: float
    requests: int = 0
    running: int = 0
    idle_since: float | None = None
    gaps: list[float] = field(default_factory=list)
    human_gaps: list[float] = field(default_factory=list)
    last_trigger: Trigger | None = None
    # The idle gap the latest start ended began on another host (its ``idle_since``
    # said so): this tracker did not see it begin.
    resumed_elsewhere: bool = False
    new_tokens: int = 0  # prompt tokens of the latest request beyond the previous context
    last_steps: int = 0
    last_output_tokens: int = 0
    context_tokens: int = 0
    tool_running: bool = False
    namespace: bytes | None = None
    chain: tuple[ChunkKey, ...] = ()

    @property
    def active(self) -> bool:
        """A request of this session is running."""
        return self.running > 0


class SessionTracker:
    """Session states from events, per-user gap history, and the chain index for ``infer``."""

    def __init__(self) -> None:
        self._sessions: dict[str, SessionState] = {}
        self._user_gaps: dict[str, deque[float]] = {}
        self._user_human_gaps: dict[str, deque[float]] = {}
        # last key of a chain -> sessions whose chain ends there, most recent last
        self._by_tail: dict[ChunkKey, dict[str, None]] = {}

    def started(
        self,
        event: RequestStarted,
        keys: Sequence[ChunkKey] = (),
        namespace: bytes | None = None,
        user: str | None = None,
    ) -> tuple[SessionState, float | None]:
        """Record a request start; returns the state and the idle gap it ended (None if none).

        ``user`` is optional until events carry it; once given it sticks to the
        session, so later events need not repeat it.
        """
        state = self._state(event.session, event.time)
        if user is not None:
            state.user = user
        state.resumed_elsewhere = False
        if (
            event.idle_since is not None
            and state.running == 0
            and (state.idle_since is None or event.idle_since > state.idle_since)
        ):
            # It ran on another host after it was last idle here (or was never here):
            # its gap is from that host's finish.
            state.idle_since = event.idle_since
            state.resumed_elsewhere = True
        gap = None
        if state.running == 0 and state.idle_since is not None:
            gap = max(0.0, event.time - state.idle_since)
            state.gaps.append(gap)
            if event.trigger is Trigger.USER:
                state.human_gaps.append(gap)
                if state.user is not None:
                    humans = self._user_human_gaps.setdefault(
                        state.user, deque(maxlen=USER_HISTORY)
                    )
                    humans.append(gap)
            if state.user is not None:
                history = self._user_gaps.setdefault(state.user, deque(maxlen=USER_HISTORY))
                history.append(gap)
        state.idle_since = None
        # What the human (or the tool) added: the prompt beyond the context the previous
        # request ended with; the whole prompt for a session's first request.
        state.new_tokens = max(0, event.prompt_tokens - state.context_tokens)
        state.running += 1
        state.requests += 1
        state.last_trigger = event.trigger
        self._set_chain(state, keys, namespace)
        return state, gap

    def finished(
        self,
        event: RequestFinished,
        keys: Sequence[ChunkKey] = (),
        namespace: bytes | None = None,
    ) -> SessionState:
        """Record a request end; the session goes idle when no other request of it runs.

        A finish without a start (the tracker restarted mid-request) still
        makes the session idle, so its next return is measured.
        """
        state = self._state(event.session, event.time)
        state.running = max(0, state.running - 1)
        if state.running == 0:
            state.idle_since = event.time
        state.last_steps = event.steps
        state.last_output_tokens = event.output_tokens
        state.context_tokens = event.context_tokens
        state.tool_running = event.tool_running
        self._set_chain(state, keys, namespace)
        return state

    def infer(self, keys: Sequence[ChunkKey]) -> str | None:
        """The session whose latest chain is a prefix of ``keys`` (longest match), if any."""
        for end in range(len(keys) - 1, -1, -1):
            for session in reversed(self._by_tail.get(keys[end], {})):
                if self._sessions[session].chain == tuple(keys[: end + 1]):
                    return session
        return None

    def get(self, session: str) -> SessionState | None:
        return self._sessions.get(session)

    def all(self) -> list[SessionState]:
        """Every session tracked, as a snapshot."""
        return list(self._sessions.values())

    def idle(self) -> list[SessionState]:
        """Sessions with no running request that have finished at least one."""
        return [s for s in self._sessions.values() if s.running == 0 and s.idle_since is not None]

    def user_human_gaps(self, user: str | None) -> Sequence[float]:
        """The last ``USER_HISTORY`` gaps of ``user`` that a human ended, oldest first."""
        if user is None:
            return ()
        return self._user_human_gaps.get(user, ())

    def user_gaps(self, user: str | None) -> Sequence[float]:
        """The last ``USER_HISTORY`` idle gaps of ``user`` over all its sessions, oldest first."""
        if user is None:
            return ()
        return self._user_gaps.get(user, ())

    def forget(self, session: str) -> None:
        """Drop a session and its chain; its user's gap history stays."""
        state = self._sessions.pop(session, None)
        if state is not None and state.chain:
            self._unindex(state)

    def _state(self, session: str, now: float) -> SessionState:
        state = self._sessions.get(session)
        if state is None:
            state = self._sessions[session] = SessionState(
                session=session, user=None, first_seen=now
            )
        return state

    def _set_chain(
        self, state: SessionState, keys: Sequence[ChunkKey], namespace: bytes | None
    ) -> None:
        """Make ``keys`` the session's latest chain; no keys leaves the chain as it was."""
        if not keys:
            return
        if state.chain:
            self._unindex(state)
        state.chain = tuple(keys)
        state.namespace = namespace
        self._by_tail.setdefault(state.chain[-1], {})[state.session] = None

    def _unindex(self, state: SessionState) -> None:
        sessions = self._by_tail[state.chain[-1]]
        del sessions[state.session]
        if not sessions:
            del self._by_tail[state.chain[-1]]

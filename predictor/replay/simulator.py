"""The replay: a workload's calls through the real ``TieredStore`` and a real policy, on a
simulated clock, in a modeled engine (``replay.engine``).

One call, as events::

    arrive   (open loop: its trace time; closed loop: think_s after the last response)
             [started] ─► the admission queue
    admit    (a batch slot and HBM free) [started] ─► lookup ─► get the chunks worth
             loading ─► put the rest ─► pin the prompt in HBM ─► the GPU queue ─► first token
    finish   (first token + api_s) unpin ─► tracker/learner (forecast) ─► policy.on_idle
             ─► the session's next step: a call think_s away, subagents, or its end
    tick     (every tick_s) learner.tick, policy.tick, HBM held by idle sessions

``started`` (tracker/learner ─► policy.on_resume, which prefetches) comes where the
engine reports a request's start (``EngineModel.started``): at arrival by default,
at admission as vLLM's connector reports it. The tracker, learner and policy calls
go through ``driver.SessionDriver``, the same wiring the daemon uses (``service``).
Events run in time order; at equal times ticks first, then finishes, then
arrivals, so a session that returns the instant it went idle is seen idle first.
A group of subagents starts as
its step comes; they run as sessions of their own and the parent's next call
waits until the last of them has finished.

What is real: the store (``replay_store``: an HBM tier on ``device="cpu"``, a
shared-memory DRAM arena, LMDB in a temporary directory with ``sync=False``, a
private redis-server with ``--redis-gb``), its placement mechanics, the policy code,
the tracker, the features, the model and its online learning. What is
modeled: payload bytes (tiny stand-ins, ``costs.stand_in_layout``), time, and
every cost (``engine``, ``costs``). Trace block ids are grouped into chunks of
``chunk_blocks`` blocks, each keyed by its whole prefix.

Copies take time and share their tier's link (``replay.links``): a policy's
prefetches and promotions and every request's demand load queue on the link of
the tier they read, in the order issued. A request waits for a chunk whose
prefetch has not landed, and behind the copies ahead of its own, so only a
prefetch made ahead of the return hides a load, and every prefetch, used or
wasted, holds up the demand loads behind it.

``oracle`` is ``PlacementPolicy`` fed ``policy.perfect_forecast`` with the
session's true next arrival instead of the model's forecast; ``oracle:AUC``
blurs that truth to the given AUC (``replay.oracle``). Each run is on a fresh
store; ``replay.parallel`` runs several policies at once, in worker processes.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.block import HEADER_BYTES
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.driver import SessionDriver
from kvstore.predictor.learning.features import feature_names
from kvstore.predictor.learning.model import DEFAULT_HORIZONS, ReturnModel
from kvstore.predictor.learning.online import OnlineLearner, ReturnForecast
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.placement.policy import (
    PlacementPolicy,
    SessionPolicy,
    perfect_forecast,
)
from kvstore.predictor.replay.config import Progress, ReplayConfig
from kvstore.predictor.replay.conversations import Call, Stop, Subagents
from kvstore.predictor.replay.costs import (
    CostMeter,
    stand_in_capacity,
    stand_in_layout,
)
from kvstore.predictor.replay.engine import Admission, PrefillQueue, RequestCost, StartReported
from kvstore.predictor.replay.links import Links, Load
from kvstore.predictor.replay.oracle import BlurredOracle, base_rates
from kvstore.predictor.replay.policies import (
    PolicyKind,
    PolicySpec,
    lognormal_forecaster,
    make_policy,
)
from kvstore.predictor.replay.replay_store import ChunkChains, store_config
from kvstore.predictor.replay.results import CallRecord, PolicyResult
from kvstore.predictor.replay.scoring import IdlePeriod, score_periods
from kvstore.predictor.replay.workload import Lane, Step, Workload, gap_after, nominal_idle
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger

# -- the nominal timeline -------------------------------------------------------------


def horizons_for(workload: Workload, config: ReplayConfig) -> tuple[float, ...]:
    """The model's horizons for a replay of ``workload``.

    A horizon is labelled 0 only once it has passed without a return, so within
    a workload shorter than twice a horizon most of that horizon's labels are
    censored and the ones that are known are nearly all returns: the model would
    learn P(back within an hour) from returns alone. So by default only the
    horizons that fit twice into the nominal timeline are modeled; a forecast
    stays flat beyond its last horizon.
    """
    if config.horizons is not None:
        return config.horizons
    periods = nominal_idle(workload, config.max_requests)
    duration = periods[-1][0] - periods[0][0] if periods else 0.0
    fitting = tuple(h for h in DEFAULT_HORIZONS if 2 * h <= duration)
    return fitting or DEFAULT_HORIZONS[:1]


def idle_gaps(workload: Workload, config: ReplayConfig) -> list[float]:
    """Every nominal idle gap that ended in a return (for the plots)."""
    return [gap for _, gap in nominal_idle(workload, config.max_requests) if gap < math.inf]


def _learner(config: ReplayConfig, horizons: tuple[float, ...]) -> OnlineLearner:
    tracker = SessionTracker()
    if config.model_path is not None:
        model = ReturnModel.load(config.model_path)
    else:
        model = ReturnModel(
            len(feature_names()),
            horizons,
            config.model_hidden,
            rehearsal=config.rehearsal,
            seed=config.seed,
        )
    return OnlineLearner(model, tracker, PrequentialScores())


# -- the replay ------------------------------------------------------------------


def replay_policy(
    workload: Workload, spec: PolicySpec, config: ReplayConfig, progress: Progress | None = None
) -> PolicyResult:
    """Replay ``workload`` under one policy on a fresh store; see the module docstring.
    Torch runs on one thread, here as in a worker process: a sum split over more
    threads rounds differently, a forecast on a threshold flips, and the same seed
    would give other numbers in and out of ``--jobs``."""
    chunk_tokens = workload.block_tokens * config.chunk_blocks
    with _one_torch_thread(), tempfile.TemporaryDirectory(prefix="kvstore-replay-") as directory:
        stand_ins = store_config(config, chunk_tokens, Path(directory))
        policy = make_policy(spec, config.placement)
        with TieredStore(stand_ins, policy=policy) as store:
            return _Run(workload, spec, config, store, policy).run(progress)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Session:
    """A session being played: its steps, where it is, who waits for it."""

    name: str
    user: str | None
    steps: tuple[Step, ...]
    arrivals: tuple[float, ...] | None
    lane: _LaneRun | None = None
    parent: _Session | None = None
    index: int = -1  # the step under way
    children_left: int = 0
    last_human_gap: float | None = None
    idle_since: float | None = None


@dataclass
class _LaneRun:
    lane: Lane
    next_script: int = 0


@dataclass
class _Request:
    """One call between its arrival and its finish."""

    session: _Session
    call: Call
    index: int  # of the call among its session's steps
    keys: list[ChunkKey]
    arrival: float = 0.0
    hit_tokens: int = 0
    recomputed_tokens: int = 0


class _Order:
    """At equal times: ticks, then finishes, then arrivals."""

    TICK = 0
    FINISH = 1
    ARRIVE = 2


class _Run:
    """One policy over one workload. Owns the event loop and the counters."""

    def __init__(
        self,
        workload: Workload,
        spec: PolicySpec,
        config: ReplayConfig,
        store: TieredStore,
        policy: SessionPolicy,
    ) -> None:
        self.workload = workload
        self.spec = spec
        self.config = config
        self.store = store
        self.policy = policy
        chunk_tokens = workload.block_tokens * config.chunk_blocks
        self.namespace = Namespace("replay", stand_in_layout(chunk_tokens))
        store.register(self.namespace)
        self.chains = ChunkChains(self.namespace, config.chunk_blocks)
        self.meter = CostMeter(config.costs, chunk_tokens, config.kv_bytes_per_token)
        self.links = Links(
            {kind: self.meter.chunk_load_seconds(kind) for kind in TierKind},
            {TierKind.DRAM: config.engine.gpus},
        )
        policy.prefetches.listener = self.links.prefetch
        self.horizons = horizons_for(workload, config)
        self.learner = (
            _learner(config, self.horizons) if spec.kind is PolicyKind.PREDICTOR else None
        )
        self.blurred = self._blurred() if spec.auc is not None else None
        self.lognormal = lognormal_forecaster(spec.kind)
        self.driver = SessionDriver(store, policy, self.learner)
        self.payload = bytes(self.namespace.layout.chunk_nbytes)
        self.block_bytes = HEADER_BYTES + self.namespace.layout.chunk_nbytes
        hbm_slots = config.sizing.slots(TierKind.HBM, chunk_tokens, config.kv_bytes_per_token)
        engine = config.engine
        self.admission = Admission(hbm_slots, engine.max_running * engine.gpus)
        self.arena_slot = stand_in_capacity(TierKind.HBM, 1, self.namespace.layout)
        self.gpu = PrefillQueue(engine.gpus)
        self.waiting: list[_Request] = []  # arrival order
        self.result = PolicyResult(spec.name, spec.baseline)
        self.periods: list[IdlePeriod] = []
        self._events: list[tuple[float, int, int, Callable[[float], None]]] = []
        self._sequence = itertools.count()
        self._pending = 0  # events other than ticks
        self._issued = 0
        self._total = min(workload.calls(), config.max_requests or math.inf)
        self._done = 0
        self._end = 0.0

    # -- the event loop --------------------------------------------------------

    def _at(self, time: float, order: int, handler: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (time, order, next(self._sequence), handler))
        if order != _Order.TICK:
            self._pending += 1

    def run(self, progress: Progress | None) -> PolicyResult:
        for lane in self.workload.lanes:
            self._next_script(_LaneRun(lane), lane.start)
        if self._events:
            tick = self.config.tick_s
            self._at((math.floor(self._events[0][0] / tick) + 1) * tick, _Order.TICK, self._tick)
        every = max(1, int(self._total) // 100)
        while self._events:
            time, order, _, handler = heapq.heappop(self._events)
            if order != _Order.TICK:
                self._pending -= 1
            self._end = max(self._end, time)
            handler(time)
            if progress is not None and order == _Order.FINISH and self._done % every == 0:
                progress(self.spec.name, self._done, int(self._total))
        if progress is not None and self._done % every:  # the last report, if not made
            progress(self.spec.name, self._done, int(self._total))
        self._close()
        return self.result

    def _tick(self, now: float) -> None:
        self.driver.tick(now)
        held = self.store.tier(TierKind.HBM).used_bytes() // self.arena_slot
        idle = max(0, held - self.admission.pinned)
        if now >= self.config.score_from:
            self.result.hbm_byte_seconds_idle += idle * self.meter.chunk_bytes * self.config.tick_s
        if self._pending:
            self._at(now + self.config.tick_s, _Order.TICK, self._tick)

    # -- sessions ---------------------------------------------------------------

    def _next_script(self, lane: _LaneRun, now: float) -> None:
        """Start ``lane``'s next session at ``now`` (nothing when it has none left)."""
        if lane.next_script >= len(lane.lane.scripts):
            return
        script = lane.lane.scripts[lane.next_script]
        lane.next_script += 1
        session = _Session(script.session, script.user, script.steps, script.arrivals, lane)
        if script.arrivals is not None:  # open loop: every call at its time
            for index, arrival in enumerate(script.arrivals):
                self._issue(session, index, arrival)
            return
        self._advance(session, now)

    def _advance(self, session: _Session, now: float) -> None:
        """Begin ``session``'s next step at ``now``: a call ``think_s`` away, subagents, or
        its end (which its parent, or its user's next session, waits for)."""
        session.index += 1
        if session.index >= len(session.steps):
            self._ended(session, now)
            return
        step = session.steps[session.index]
        if isinstance(step, Call):
            self._issue(session, session.index, now + step.think_s)
            return
        session.children_left = len(step.conversations)
        for conversation in step.conversations:
            child = _Session(conversation.name, session.user, conversation.steps, None)
            child.parent = session
            self._advance(child, now + step.think_s)

    def _ended(self, session: _Session, now: float) -> None:
        if session.parent is not None:
            parent = session.parent
            parent.children_left -= 1
            if parent.children_left == 0:
                self._advance(parent, now)
        elif session.lane is not None and session.arrivals is None:
            self._next_script(session.lane, now)

    def _issue(self, session: _Session, index: int, arrival: float) -> None:
        if self._issued >= self._total:
            return
        self._issued += 1
        step = session.steps[index]
        assert isinstance(step, Call)
        request = _Request(session, step, index, self.chains.of(step))
        self._at(arrival, _Order.ARRIVE, lambda now: self._arrive(request, now))

    # -- one call ------------------------------------------------------------------

    def _arrive(self, request: _Request, now: float) -> None:
        request.arrival = now
        if self.config.engine.started is StartReported.ARRIVAL:
            self._started(request, now)
        self.waiting.append(request)
        self._admit_waiting(now)

    def _started(self, request: _Request, now: float) -> None:
        """The engine reports ``request`` started (``EngineModel.started``): the trackers,
        the learner and the policy hear of it."""
        session, call = request.session, request.call
        if call.trigger is Trigger.USER and session.idle_since is not None:
            session.last_human_gap = now - session.idle_since
            if self.lognormal is not None:
                self.lognormal.observe(session.last_human_gap)
        tools = self.lognormal.tools if self.lognormal is not None else None
        if tools is not None:
            tools.returned(session.name, now)
        started = RequestStarted(session.name, call.trigger, call.prompt_tokens, 0, now)
        state = self.driver.started(started, request.keys, self.namespace.digest, session.user)
        self.driver.resumed(state, now)

    def _admit_waiting(self, now: float) -> None:
        while self.waiting and self.admission.fits(len(self.waiting[0].keys)):
            self._admit(self.waiting.pop(0), now)

    def _admit(self, request: _Request, now: float) -> None:
        if self.config.engine.started is StartReported.ADMISSION:
            self._started(request, now)
        keys, call = request.keys, request.call
        self.admission.take(len(keys))
        written = self._written_below()
        prefix = self.store.lookup(self.namespace, keys)
        wanted = prefix.load_chunks if prefix.load_chunks is not None else prefix.num_chunks
        loaded = self._load(prefix.keys[:wanted], prefix.tiers[:wanted])
        self.store.put(
            self.namespace,
            keys,
            [None] * loaded + [self.payload] * (len(keys) - loaded),
            session=request.session.name,
        )
        self.store.pin(self.namespace, keys)
        hit = min(loaded * prefix.chunk_tokens, call.prompt_tokens)
        recomputed = call.prompt_tokens - hit
        recompute_s = self.meter.recompute_seconds(recomputed)
        writeback = self._writeback_seconds(written)
        load = self.links.load(prefix.keys[:loaded], prefix.tiers[:loaded], now + writeback)
        ready = now + writeback + load.seconds
        cost = RequestCost(
            arrival=request.arrival,
            admitted=now,
            prefill_start=self.gpu.start(ready, recompute_s),
            writeback_s=writeback,
            load_s=load.seconds,
            recompute_s=recompute_s,
        )
        request.hit_tokens, request.recomputed_tokens = hit, recomputed
        end = cost.first_token + call.api_s
        self._count(request, cost, load, end)
        self._at(end, _Order.FINISH, lambda later: self._finish(request, later))

    def _load(self, keys: Sequence[ChunkKey], tiers: Sequence[TierKind]) -> int:
        """Bring the cached run into HBM (a get promotes what it reads); how many of its
        leading chunks arrived. Chunks in HBM already are not read: their bytes would
        only be checked, and the put that follows marks them used."""
        below = [i for i, kind in enumerate(tiers) if kind is not TierKind.HBM]
        if not below:
            return len(keys)
        chunks = self.store.get(self.namespace, [keys[i] for i in below])
        missing = next((i for i, chunk in zip(below, chunks, strict=True) if chunk is None), None)
        return len(keys) if missing is None else missing

    def _written_below(self) -> dict[TierKind, int]:
        return {kind: self.store.counters(kind).bytes_written for kind in self.store.tier_kinds[1:]}

    def _writeback_seconds(self, before: dict[TierKind, int]) -> float:
        """The copies into the tiers below HBM that making room took, at their rates."""
        seconds = 0.0
        for kind, then in before.items():
            chunks = (self.store.counters(kind).bytes_written - then) / self.block_bytes
            seconds += chunks * self.meter.chunk_bytes / self.config.costs.bytes_per_s(kind)
        return seconds

    def _count(
        self, request: _Request, cost: RequestCost, load: Load, end: float
    ) -> None:
        if request.arrival < self.config.score_from:
            return
        result, chunk_tokens = self.result, self.meter.chunk_tokens
        result.calls.append(
            CallRecord(
                request.session.name, cost, end, request.hit_tokens, request.recomputed_tokens
            )
        )
        result.requests += 1
        result.prompt_tokens += request.call.prompt_tokens
        result.hit_tokens += request.hit_tokens
        result.recomputed_tokens += request.recomputed_tokens
        human = request.call.trigger is Trigger.USER
        by_tier = result.load_seconds_by_turn.setdefault("human" if human else "tool", {})
        # The load's time, waits on the links included, shared by its chunks' own copy times.
        share = load.seconds / load.nominal_s if load.nominal_s else 0.0
        for kind in load.tiers:
            result.hit_tokens_by_tier[kind] = result.hit_tokens_by_tier.get(kind, 0) + chunk_tokens
            by_tier[kind] = by_tier.get(kind, 0.0) + share * self.meter.chunk_load_seconds(kind)
        result.gpu_seconds += cost.gpu_s
        result.load_seconds += cost.load_s
        result.link_wait_seconds += load.waited_s
        result.writeback_seconds += cost.writeback_s
        result.queue_seconds += cost.queue_s
        result.admission_wait_seconds += cost.admission_wait_s
        result.ttft_s.append(cost.ttft_s)
        (result.ttft_human_s if human else result.ttft_tool_s).append(cost.ttft_s)
        if human:
            result.service_human_s.append(cost.gpu_s)

    def _finish(self, request: _Request, now: float) -> None:
        session, call = request.session, request.call
        self.store.unpin(self.namespace, request.keys)
        self.admission.give_back(len(request.keys))
        self._done += 1
        finished = RequestFinished(
            session=session.name,
            steps=1,
            output_tokens=call.output_tokens,
            context_tokens=call.prompt_tokens + call.output_tokens,
            tool_running=call.stop is Stop.TOOL_USE,
            loaded_tokens=request.hit_tokens,
            recomputed_tokens=request.recomputed_tokens,
            time=now,
        )
        gap, human = self._next_arrival(request, now)
        oracle: ReturnForecast | None = None
        if self.blurred is not None:
            oracle = self.blurred.forecast(session.name, now, gap, self.horizons)
        elif self.spec.kind is PolicyKind.ORACLE:
            oracle = perfect_forecast(session.name, now, gap, self.horizons)
        elif self.lognormal is not None:
            tool = call.stop is Stop.TOOL_USE
            if tool and self.lognormal.tools is not None:
                self.lognormal.tools.waiting(session.name, now)
            oracle = self.lognormal.forecast(session.name, now, self.horizons, tool)
        idle = self.driver.finished(finished, request.keys, self.namespace.digest, oracle)
        session.idle_since = now
        given = oracle if oracle is not None else idle.forecast if idle is not None else None
        if idle is not None and given is not None:
            self.periods.append(IdlePeriod(now, gap, human, given, session.last_human_gap))
        if session.arrivals is None:
            self._advance(session, now)
        self._admit_waiting(now)

    def _next_arrival(self, request: _Request, now: float) -> tuple[float, bool]:
        """How long until ``request``'s session is back (``math.inf``: never), and whether a
        human brings it back (or would: an agent that handed back to its human)."""
        session, index = request.session, request.index
        if session.arrivals is not None:
            if index + 1 >= len(session.arrivals):
                return math.inf, request.call.stop is not Stop.TOOL_USE
            after = session.steps[index + 1]
            assert isinstance(after, Call)
            gap = max(0.0, session.arrivals[index + 1] - now)
            return gap, after.trigger is Trigger.USER
        gap = gap_after(session.steps, index)
        rest = session.steps[index + 1 :]
        following = next((s for s in rest if isinstance(s, Call)), None)
        if following is None:
            return gap, request.call.stop is not Stop.TOOL_USE
        subagents = any(isinstance(s, Subagents) for s in rest)
        return gap, following.trigger is Trigger.USER and not subagents

    def _blurred(self) -> BlurredOracle:
        """``oracle:AUC``: the true gaps blurred to its AUC, around the nominal base rates."""
        assert self.spec.auc is not None
        periods = nominal_idle(self.workload, self.config.max_requests)
        end = periods[-1][0] if periods else 0.0
        rates = base_rates([p[0] for p in periods], [p[1] for p in periods], self.horizons, end)
        return BlurredOracle(self.spec.auc, rates, self.config.seed)

    def _close(self) -> None:
        result = self.result
        result.prefetches = self.policy.prefetches
        result.prefetches.listener = None  # the run's links are not part of its result
        chunk = self.meter.chunk_bytes
        routes = sorted(result.prefetches.routes.items())
        result.prefetch_bytes = {f"{a.label}->{b.label}": n * chunk for (a, b), n in routes}
        result.prefetch_bytes["wasted"] = result.prefetches.wasted * chunk
        if isinstance(self.policy, PlacementPolicy):
            result.demoted_at_idle = self.policy.demoted
            result.overload = self.policy.watch.to_dict()
        if self.learner is not None and self.learner.scores is not None:
            result.quality = self.learner.scores.report()
        if self.learner is not None and self.config.model_out is not None:
            self.config.model_out.parent.mkdir(parents=True, exist_ok=True)
            self.learner.model.save(self.config.model_out)
        if self.periods:
            result.human, result.calibration = score_periods(
                self.periods, self.horizons, self._end
            )
        stats = self.store.stats()
        chunk_bytes = self.meter.chunk_bytes / self.block_bytes
        result.tier_counters = {}
        result.bytes_moved = {}
        for kind, counters in stats.tiers.items():
            result.tier_counters[kind.label] = {
                "hits": counters.hits,
                "demotions": counters.demotions,
                "evictions": counters.evictions,
                "promotions": counters.promotions,
                "errors": counters.errors,
            }
            result.bytes_moved[kind.label] = {
                "read": counters.bytes_read * chunk_bytes,
                "written": counters.bytes_written * chunk_bytes,
            }

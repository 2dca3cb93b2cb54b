"""The replay: a trace's requests through the real ``TieredStore`` and a real policy,
on a simulated clock.

Each request becomes two session events, and a timer ticks in between::

    request_started   (trace time)   tracker/learner ─► lookup ─► policy.on_resume
                                     ─► get the chunks worth loading ─► put the prompt
    request_finished  (+ decode)     tracker/learner (forecast) ─► policy.on_idle
    tick              (every tick_s) learner.tick, policy.tick, HBM held by idle sessions

The tracker, learner and policy calls go through ``driver.SessionDriver``, the
same wiring the daemon uses (``service``). Events run in time order (at equal
times a finish before a start), and every tick due by an event's time runs
before it. A request ends after ``output_tokens / decode_tokens_per_s``
seconds, or when its session's next request arrives, if that is sooner.

What is real: the store (an HBM tier on ``device="cpu"``, a shared-memory
DRAM arena, LMDB in a temporary directory with ``sync=False``, a private
redis-server with ``--redis-gb``), its placement mechanics, the policy code,
the tracker, the features, the model and its online learning. What is
modeled: payload bytes (a 1 KiB stand-in per chunk, ``costs.stand_in_layout``),
time (the trace's clock), and every cost (``costs.CostMeter``).

Prefetches take time. The lookup answers before ``on_resume`` prefetches, and
the request is charged from the tiers the lookup saw, except that a chunk
whose prefetch copy has not landed yet (``PrefetchStats.loading``: copies queue
per source tier and each takes its modeled load time) is charged from the tier
it is being copied from. So a prefetch at resume hides no load, and one made at
a tick, ahead of the return, is credited only if its copy finished before the
request arrived.

``oracle`` is ``PlacementPolicy`` fed ``policy.perfect_forecast`` with the
session's true next arrival read from the trace instead of the model;
``oracle:AUC`` blurs that truth to the given AUC (``replay.oracle``).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, Namespace
from kvstore.predictor.driver import SessionDriver
from kvstore.predictor.learning.features import feature_names
from kvstore.predictor.learning.model import DEFAULT_HORIZONS, REHEARSAL, Rehearsal, ReturnModel
from kvstore.predictor.learning.online import OnlineLearner, ReturnForecast
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.placement.policy import (
    PlacementConfig,
    PlacementPolicy,
    PrefetchStats,
    SessionPolicy,
    perfect_forecast,
)
from kvstore.predictor.replay.costs import (
    DECODE_TOKENS_PER_S,
    LLAMA_8B_KV_BYTES_PER_TOKEN,
    CostMeter,
    Sizing,
    stand_in_capacity,
    stand_in_layout,
)
from kvstore.predictor.replay.oracle import BlurredOracle, base_rates
from kvstore.predictor.replay.policies import PolicyKind, PolicySpec, make_policy, parse_policies
from kvstore.predictor.replay.timeline import (
    BlockKeys,
    ReplayEvent,
    Step,
    finished_event,
    requests_of,
    session_events,
)
from kvstore.predictor.replay.traces import Trace, TraceRequest
from kvstore.predictor.replay.training import train
from kvstore.store.config import CostModel, StoreConfig
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.kinds import TierKind
from kvstore.tiers.registry import TierConfig
from kvstore.wire.events import RequestStarted

Progress = Callable[[str, int, int], None]
"""``progress(policy, requests done, requests in all)``."""


@dataclass(frozen=True)
class ReplayConfig:
    """Everything a replay depends on besides the trace and the policy."""

    sizing: Sizing
    kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN
    costs: CostModel = field(default_factory=CostModel)
    tick_s: float = 10.0
    decode_tokens_per_s: float = DECODE_TOKENS_PER_S
    max_requests: int | None = None
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    horizons: tuple[float, ...] | None = None
    """The model's horizons; ``None``: those of ``DEFAULT_HORIZONS`` a trace can label."""
    model_path: Path | None = None
    seed: int = 0
    redis_url: str | None = None
    rehearsal: Rehearsal | None = REHEARSAL
    """The predictor's rehearsal of recent labels (``model.Rehearsal``); None: off."""
    score_from: float = -math.inf
    """Charge only requests that arrive at or after this trace time; earlier ones still
    run (they warm the store and the learner). For scoring the rest of a trace after
    pre-training a model on its first part: the charged part must be unseen."""


@dataclass
class PolicyResult:
    """What one policy did over one trace."""

    name: str
    baseline: bool
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[TierKind, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    gpu_seconds: float = 0.0
    load_seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    hbm_byte_seconds_idle: float = 0.0
    prefetches: PrefetchStats = field(default_factory=PrefetchStats)
    demoted_at_idle: int = 0
    tier_counters: dict[str, dict[str, int]] = field(default_factory=dict)
    quality: dict[str, dict[str, float]] | None = None
    calibration: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else math.nan

    @property
    def hbm_gb_hours_idle(self) -> float:
        return self.hbm_byte_seconds_idle / 1e9 / 3600.0


def idle_gaps(trace: Trace, config: ReplayConfig) -> list[float]:
    """Every idle gap that ended in a return: next arrival minus the modeled finish."""
    requests = requests_of(trace, config.max_requests)
    return [
        event.next_start - event.time
        for event in session_events(requests, config.decode_tokens_per_s)
        if event.step is Step.FINISH and event.next_start is not None
    ]


def _blurred(
    requests: Sequence[TraceRequest], config: ReplayConfig, horizons: Sequence[float], auc: float
) -> BlurredOracle:
    """``oracle:AUC``: the true gaps blurred to ``auc``, around the trace's base rates."""
    finishes = [
        event
        for event in session_events(requests, config.decode_tokens_per_s)
        if event.step is Step.FINISH
    ]
    gaps = [math.inf if e.next_start is None else e.next_start - e.time for e in finishes]
    end = requests[-1].time
    rates = base_rates([e.time for e in finishes], gaps, horizons, end)
    return BlurredOracle(auc, rates, config.seed)


# -- the store under replay ---------------------------------------------------------


class _IdleWatch:
    """The store's policy, seen through a proxy that counts, per session, the blocks HBM
    holds for it (the last session to touch a block owns it): for HBM GB-hours idle."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.held: Counter[str | None] = Counter()
        self._owner: dict[ChunkKey, str | None] = {}  # HBM block -> owner
        self._last: dict[ChunkKey, str] = {}  # any block -> last session to touch it

    def on_access(
        self, tier: TierKind, keys: Sequence[ChunkKey], session: str | None = None
    ) -> None:
        self.inner.on_access(tier, keys, session)
        for key in keys:
            if session is not None:
                self._last[key] = session
            if tier is TierKind.HBM:
                if key in self._owner:
                    self.held[self._owner[key]] -= 1
                owner = self._owner[key] = self._last.get(key)
                self.held[owner] += 1

    def on_remove(self, tier: TierKind, key: ChunkKey) -> None:
        self.inner.on_remove(tier, key)
        if tier is TierKind.HBM and key in self._owner:
            self.held[self._owner.pop(key)] -= 1

    def victims(self, tier: TierKind) -> Iterator[ChunkKey]:
        return self.inner.victims(tier)

    def destination(self, tier: TierKind, key: ChunkKey) -> TierKind | None:
        return self.inner.destination(tier, key)


def _store_config(config: ReplayConfig, chunk_tokens: int, directory: Path) -> StoreConfig:
    layout = stand_in_layout(chunk_tokens)
    tiers = []
    for kind in TierKind:
        slots = config.sizing.slots(kind, chunk_tokens, config.kv_bytes_per_token)
        if slots <= 0:
            continue
        capacity = stand_in_capacity(kind, slots, layout)
        if kind is TierKind.HBM:
            tiers.append(TierConfig(kind, capacity, device="cpu"))
        elif kind is TierKind.DRAM:
            tiers.append(TierConfig(kind, capacity))
        elif kind is TierKind.SSD:
            tiers.append(TierConfig(kind, capacity, path=directory / "lmdb", sync=False))
        else:
            if config.redis_url is None:
                raise ConfigError("a Redis tier needs a redis_url (tiers.local_redis starts one)")
            prefix = f"kvs-replay-{directory.name}"
            tiers.append(TierConfig(kind, capacity, url=config.redis_url, key_prefix=prefix))
    if not tiers:
        raise ConfigError("every tier has zero capacity")
    costs = dataclasses.replace(config.costs, kv_bytes_per_token=config.kv_bytes_per_token)
    return StoreConfig(
        tiers=tuple(tiers),
        promote_on_hit=True,
        scan_on_open=False,
        data_dir=directory,
        costs=costs,
    )


def horizons_for(trace: Trace, config: ReplayConfig) -> tuple[float, ...]:
    """The model's horizons for a replay of ``trace``.

    A horizon is labelled 0 only once it has passed without a return, so within
    a trace shorter than twice a horizon most of that horizon's labels are
    censored and the ones that are known are nearly all returns: the model would
    learn P(back within an hour) from returns alone. So by default only the
    horizons that fit twice into the trace are modeled (the one-hour Mooncake
    trace: 1 and 10 minutes); a forecast stays flat beyond its last horizon.
    """
    if config.horizons is not None:
        return config.horizons
    duration = requests_of(trace, config.max_requests)[-1].time - trace.requests[0].time
    fitting = tuple(h for h in DEFAULT_HORIZONS if 2 * h <= duration)
    return fitting or DEFAULT_HORIZONS[:1]


def _learner(config: ReplayConfig, horizons: tuple[float, ...]) -> OnlineLearner:
    tracker = SessionTracker()
    if config.model_path is not None:
        model = ReturnModel.load(config.model_path)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            model = ReturnModel(len(feature_names()), horizons, rehearsal=config.rehearsal)
    return OnlineLearner(model, tracker, PrequentialScores())


# -- the replay ------------------------------------------------------------------


def replay_policy(
    trace: Trace, spec: PolicySpec, config: ReplayConfig, progress: Progress | None = None
) -> PolicyResult:
    """Replay ``trace`` under one policy on a fresh store; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="kvstore-replay-") as directory:
        store_config = _store_config(config, trace.block_tokens, Path(directory))
        policy = make_policy(spec, config.placement)
        watch = _IdleWatch(policy)
        with TieredStore(store_config, policy=watch) as store:
            return _Run(trace, spec, config, store, policy, watch).run(progress)


class _Run:
    """One policy over one trace. Owns the event loop and the counters."""

    def __init__(
        self,
        trace: Trace,
        spec: PolicySpec,
        config: ReplayConfig,
        store: TieredStore,
        policy: SessionPolicy,
        watch: _IdleWatch,
    ) -> None:
        self.spec = spec
        self.config = config
        self.store = store
        self.policy = policy
        self.watch = watch
        self.requests = requests_of(trace, config.max_requests)
        self.namespace = Namespace("replay", stand_in_layout(trace.block_tokens))
        store.register(self.namespace)
        self.meter = CostMeter(config.costs, trace.block_tokens, config.kv_bytes_per_token)
        self.horizons = horizons_for(trace, config)
        self.learner = (
            _learner(config, self.horizons) if spec.kind is PolicyKind.PREDICTOR else None
        )
        self.blurred = (
            _blurred(self.requests, config, self.horizons, spec.auc)
            if spec.auc is not None
            else None
        )
        self.driver = SessionDriver(store, policy, self.learner)
        self.tracker = self.driver.tracker
        self.payload = bytes(self.namespace.layout.chunk_nbytes)
        self.result = PolicyResult(spec.name, spec.baseline)
        self.chains = BlockKeys(self.namespace)
        self._served: dict[int, tuple[int, int]] = {}  # request -> (loaded, recomputed) tokens
        self._end = self.requests[-1].time if self.requests else 0.0

    def run(self, progress: Progress | None) -> PolicyResult:
        events = session_events(self.requests, self.config.decode_tokens_per_s)
        tick = self.config.tick_s
        next_tick = (math.floor(events[0].time / tick) + 1) * tick if events else 0.0
        total = len(self.requests)
        every = max(1, total // 100)
        started = 0
        for event in events:
            while next_tick <= event.time:
                self._tick(next_tick)
                next_tick += tick
            if event.step is Step.START:
                self._start(event)
                started += 1
                if progress is not None and (started % every == 0 or started == total):
                    progress(self.spec.name, started, total)
            else:
                self._finish(event)
        self._close()
        return self.result

    # -- events --------------------------------------------------------------

    def _start(self, event: ReplayEvent) -> None:
        request = self.requests[event.request]
        now = request.time
        keys = self.chains.of(request)
        started = RequestStarted(request.session, request.trigger, request.prompt_tokens, 0, now)
        state = self.driver.started(started, keys, self.namespace.digest, request.user)
        prefix = self.store.lookup(self.namespace, keys)
        self.driver.resumed(state, now)
        wanted = prefix.load_chunks if prefix.load_chunks is not None else prefix.num_chunks
        chunks = self.store.get(self.namespace, list(prefix.keys[:wanted])) if wanted else []
        loaded = next((i for i, chunk in enumerate(chunks) if chunk is None), len(chunks))
        hit = min(loaded * prefix.chunk_tokens, request.prompt_tokens)
        recomputed = request.prompt_tokens - hit
        # A prefetched chunk still on its way is charged from the tier it is copied from.
        prefetches = self.policy.prefetches
        tiers = [
            prefetches.loading(key, now) or kind
            for key, kind in zip(prefix.keys[:loaded], prefix.tiers[:loaded], strict=True)
        ]
        cost = self.meter.request(tiers, recomputed)
        self.store.put(
            self.namespace,
            keys,
            [None] * loaded + [self.payload] * (len(keys) - loaded),
            session=request.session,
        )
        self._served[event.request] = (hit, recomputed)
        if now < self.config.score_from:
            return
        result = self.result
        result.requests += 1
        result.prompt_tokens += request.prompt_tokens
        result.hit_tokens += hit
        for kind in tiers:
            result.hit_tokens_by_tier[kind] = (
                result.hit_tokens_by_tier.get(kind, 0) + prefix.chunk_tokens
            )
        result.recomputed_tokens += recomputed
        result.gpu_seconds += cost.ttft_s
        result.load_seconds += cost.load_s
        result.ttft_s.append(cost.ttft_s)

    def _finish(self, event: ReplayEvent) -> None:
        request = self.requests[event.request]
        now = event.time
        keys = self.chains.of(request)
        hit, recomputed = self._served.pop(event.request)
        finished = finished_event(request, event, hit, recomputed)
        gap = event.next_start - now if event.next_start is not None else math.inf
        oracle: ReturnForecast | None = None
        if self.blurred is not None:
            oracle = self.blurred.forecast(request.session, now, gap, self.horizons)
        elif self.spec.kind is PolicyKind.ORACLE:
            oracle = perfect_forecast(request.session, now, gap, self.horizons)
        idle = self.driver.finished(finished, keys, self.namespace.digest, oracle)
        if idle is not None and idle.forecast is not None:  # the learner's, to calibrate
            self._calibrate(idle.forecast.horizons, idle.forecast.probabilities, now, gap)

    def _calibrate(
        self, horizons: Sequence[float], probabilities: Sequence[float], now: float, gap: float
    ) -> None:
        """Keep (horizon, probability, label) where the trace tells the label."""
        for horizon, probability in zip(horizons, probabilities, strict=True):
            if gap <= horizon:
                self.result.calibration.append((horizon, probability, 1))
            elif now + horizon <= self._end:
                self.result.calibration.append((horizon, probability, 0))

    def _tick(self, now: float) -> None:
        self.driver.tick(now)
        idle = sum(
            count
            for owner, count in self.watch.held.items()
            if count and (owner is None or not _active(self.tracker, owner))
        )
        if now >= self.config.score_from:
            self.result.hbm_byte_seconds_idle += idle * self.meter.chunk_bytes * self.config.tick_s

    def _close(self) -> None:
        result = self.result
        result.prefetches = self.policy.prefetches
        if isinstance(self.policy, PlacementPolicy):
            result.demoted_at_idle = self.policy.demoted
        if self.learner is not None and self.learner.scores is not None:
            result.quality = self.learner.scores.report()
        stats = self.store.stats()
        result.tier_counters = {
            kind.label: {
                "hits": counters.hits,
                "demotions": counters.demotions,
                "evictions": counters.evictions,
                "promotions": counters.promotions,
                "errors": counters.errors,
            }
            for kind, counters in stats.tiers.items()
        }


def _active(tracker: SessionTracker, session: str) -> bool:
    state = tracker.get(session)
    return state is not None and state.active


def replay(
    trace: Trace,
    specs: Sequence[PolicySpec],
    config: ReplayConfig,
    progress: Progress | None = None,
) -> list[PolicyResult]:
    """Every policy over the same trace, each on a fresh store."""
    return [replay_policy(trace, spec, config, progress) for spec in specs]


__all__ = [
    "PolicyKind",
    "PolicyResult",
    "PolicySpec",
    "ReplayConfig",
    "ReplayEvent",
    "idle_gaps",
    "parse_policies",
    "replay",
    "replay_policy",
    "session_events",
    "train",
]

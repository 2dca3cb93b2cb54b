"""``PredictorService``: the return-time predictor inside ``kvstore serve``.

The daemon's app owns one (``cleanup_ctx``: ``lifecycle``). Where things run::

    POST /v1/events ─► submit(): bounded queue ─► one task, on a worker thread, in order:
    (event loop; answers      (full: dropped       request_started  ─► driver.started, resumed
     at once, never waits      and counted)                             (prefetch the chain)
     for a placement)                               request_finished ─► driver.finished
                                                                        (forecast, place the chain)
                              every tick_s      ─► driver.tick (label passed horizons,
                                                   re-place), forget long-idle sessions
                              every save_interval_s, and at shutdown ─► save the model
    POST /v1/put ─► saw_put(): a session's latest chain, for events that carry none

An event that carries its chain also says whose blocks those are
(``PlacementPolicy.touch``): vLLM's workers put and load blocks without a session,
and the chain in its scheduler's events is the only word of who used them.

Why a queue: a placement moves KV between tiers (a demotion writes a chain to
LMDB), and an engine that reports a finished request must not wait for that.
Events are advisory, so a full queue drops rather than blocks.

The hooks run under the store's lock; the prefetches they plan run after it
is let go (``PlacementPolicy.defer_prefetches``), so reading a chain back
from LMDB or Redis holds up no request: the store locks only to admit it.
Demotions still write under the lock, as the store's own evictions do.

The clock. Every time the predictor reads is an event's time (Unix seconds,
sent by the client) or the event clock: the latest event time seen, advanced
by the daemon's monotonic clock since. With clients on the daemon's clock the
two agree; a replayed or test stream of events with times of its own keeps
its own clock, and ticks and labels stay consistent with it. (The daemon
refuses event times far from its own clock unless its config widens the
window, ``DaemonConfig.event_time_*``: one event stamped far ahead would
otherwise label every pending forecast at once.)

The model lives in ``<data_dir>/predictor/model.pt`` (``load_model`` says in
which order files are tried). It is loaded by ``load``, which the daemon calls
once it listens: the model is a torch module, and importing torch takes most of
a second that a restart need not wait for. Until then the store evicts by the
policy, which needs no model, and events wait in the queue: ``load`` starts the
task that works it, so every event is handled by the loaded model, in arrival
order, as if the model had been there from the start. Meanwhile ``snapshot``
says ``"source": "loading"`` and ``session`` knows no session. A model that
cannot be loaded for the host's sake (no file descriptor left, no memory: a
daemon flooded with connections as it starts) leaves the daemon serving without
one, ``"source": "unavailable"``, its events dropped once the queue is full:
torch cannot be imported again in a process where its import failed half-way.

The load runs on a daemon thread of its own, not the loop's executor: a daemon
stopped in the seconds it takes to import torch stops at once, where a worker
thread would hold the process until the import finished (``serve`` shuts its
executor down waiting, and the interpreter joins every worker at exit). Nothing
waits for a model it will not use; a load still running when the process ends
has written nothing but, at most, a saved model set aside.

Threads: the queue, the clock and the counters belong to the event loop; the
learner, tracker and scores are used under ``_lock`` on worker threads; the
policy under the store's lock as well (``kvstore.predictor.driver``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.errors import ConfigError, UnknownNamespace
from kvstore.keys import ChunkKey
from kvstore.predictor.driver import SessionDriver
from kvstore.predictor.learning.features import feature_names
from kvstore.predictor.learning.online import OnlineLearner
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.placement.decisions import DecisionLog
from kvstore.predictor.placement.policy import PlacementPolicy
from kvstore.predictor.placement.prefetching import PlannedPrefetch
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import UNNAMED, RequestStarted, SessionEvent

if TYPE_CHECKING:  # kvstore.server imports this module: no import cycle at run time
    from kvstore.predictor.config import PredictorConfig
    from kvstore.predictor.learning.model import ReturnModel  # torch: ``load_model`` imports it

log = logging.getLogger("kvstore.predictor")
_T = TypeVar("_T")

MODEL_FILE = Path("predictor") / "model.pt"
"""The learnt model, relative to the store's data directory."""
_BATCH = 256  # events handled per hop to a worker thread
_PUT_CHAINS = 100_000  # sessions whose latest put chain is remembered
_BASELINES = (("predictor", ""), ("base_rate", "base_rate_"), ("last_gap", "last_gap_"))
SESSION_DECISIONS = 10
"""The latest decisions of a session that ``session`` reports."""


async def _not_waited_for_at_exit(function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)`` on a daemon thread, awaited; cancelling the await leaves the
    thread to finish, or to end with the process."""
    done: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def work() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(function(*args))
        except BaseException as error:  # handed to the awaiting task, which decides
            done.set_exception(error)

    threading.Thread(target=work, name="kvstore-model-load", daemon=True).start()
    return await asyncio.wrap_future(done)


def load_model(config: PredictorConfig, saved: Path) -> tuple[ReturnModel, str]:
    """The model to start from, and where it came from.

    1. ``saved`` (the daemon's own, learnt so far), unless it cannot be read or
       was made for another feature list (a newer version): then it is set
       aside with a warning, as a model that does not fit is worth nothing.
    2. ``config.weights``, a pre-trained file: one that cannot be used is a
       ``ConfigError`` (the operator asked for it by name).
    3. A new model at the published base rates, with ``config.horizons_s``.
    """
    from kvstore.predictor.learning.model import REHEARSAL, ReturnModel

    width = len(feature_names())
    if saved.exists():
        try:
            model = _read_model(saved)
        except ConfigError as error:
            log.warning("setting aside %s and starting over: %s", saved, error)
        else:
            if model.n_features == width:
                return model, "saved"
            log.warning(
                "setting aside %s: it takes %d features, this version computes %d",
                saved,
                model.n_features,
                width,
            )
        os.replace(saved, saved.with_suffix(".stale"))
    if config.weights is not None:
        try:
            model = _read_model(config.weights)
        except ConfigError as error:
            raise ConfigError(f"predictor.weights: {error}") from None
        if model.n_features != width:
            raise ConfigError(
                f"predictor.weights {config.weights} takes {model.n_features} features, "
                f"this version computes {width}: train it again with kvstore train-predictor"
            )
        return model, "weights"
    # The configuration the replay measured (docs/predictor_features.md): rehearsal on.
    return ReturnModel(width, config.horizons_s, rehearsal=REHEARSAL), "prior"


def _read_model(path: Path) -> ReturnModel:
    """``ReturnModel.load``, with every way a file can be unreadable as a ``ConfigError``."""
    from kvstore.predictor.learning.model import ReturnModel

    try:
        return ReturnModel.load(path)
    except ConfigError:
        raise
    except Exception as error:  # torch.load's zoo: OSError, pickle, zip, Runtime, Key errors
        raise ConfigError(f"cannot read model {path}: {error}") from error


class PredictorService:
    """Learner, tracker and placement policy of one daemon; see the module docstring.

    ``policy`` must be the store's eviction policy (``TieredStore(policy=...)``),
    so the service exists before the store and is ``attach``-ed to it after; its
    model is loaded after that (``load``).
    """

    def __init__(
        self,
        config: PredictorConfig,
        data_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.path = data_dir / MODEL_FILE
        self.source = "loading"  # then where the model came from (``load_model``)
        self.scores = PrequentialScores()
        self.tracker = SessionTracker()
        self.learner: OnlineLearner | None = None  # made by ``load``
        # Prefetches run after the store's lock is let go (``_prefetch``).
        self.policy = PlacementPolicy(
            defer_prefetches=True, decisions=DecisionLog(config.decisions_kept)
        )
        self.processed = 0
        self.dropped = 0
        self.failed = 0
        self.saves = 0
        self.placements: Counter[str] = Counter()
        self._store: TieredStore | None = None
        self._driver: SessionDriver | None = None  # made by ``load``
        self._task: asyncio.Task[None] | None = None  # works the queue; ``load`` starts it
        self._clock = clock
        self._offset: float | None = None  # event clock = clock() + offset
        self._queue: asyncio.Queue[SessionEvent] = asyncio.Queue(config.queue_size)
        self._stopping = asyncio.Event()
        self._lock = threading.Lock()
        self._puts: OrderedDict[str, tuple[bytes, tuple[ChunkKey, ...]]] = OrderedDict()

    @property
    def model(self) -> ReturnModel | None:
        """The model once ``load`` has loaded it."""
        return None if self.learner is None else self.learner.model

    def attach(self, store: TieredStore) -> None:
        """Drive ``store``, whose eviction policy is ``self.policy``, once ``load``-ed."""
        self._store = store

    async def load(self) -> None:
        """Load the model (on a worker thread) and start working the queue: the events
        queued meanwhile first. Raises ``ConfigError`` for ``weights`` it cannot use;
        any other failure is logged and leaves the service without a model."""
        store = self._store
        assert store is not None, "attach() the store first"
        try:
            model, source = await _not_waited_for_at_exit(load_model, self.config, self.path)
        except ConfigError:
            raise
        except Exception:  # the host's trouble, not the operator's: serve on without it
            self.source = "unavailable"
            log.exception("predictor: cannot load the model; serving without it")
            return
        learner = OnlineLearner(model, self.tracker, self.scores, learn_at_horizon=True)
        with self._lock:
            self.learner, self.source = learner, source
            self._driver = SessionDriver(store, self.policy, learner)
        self._task = asyncio.create_task(self._run(), name="kvstore-predictor")

    # -- the event loop's side ----------------------------------------------------

    def submit(self, event: SessionEvent) -> bool:
        """Queue an event; False (and counted) if the queue is full."""
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    def saw_put(self, session: str | None, namespace: bytes, keys: tuple[ChunkKey, ...]) -> None:
        """Remember the chain a session just stored: its chain for events without keys."""
        if session is None or not keys:
            return
        self._puts[session] = (namespace, keys)
        self._puts.move_to_end(session)
        if len(self._puts) > _PUT_CHAINS:
            self._puts.popitem(last=False)

    def now(self) -> float | None:
        """The event clock (None before the first event)."""
        return None if self._offset is None else self._clock() + self._offset

    async def lifecycle(self, _app: object) -> AsyncIterator[None]:
        """``cleanup_ctx``: at exit, stop working the queue and save the model (none
        to save if it was never loaded: nothing was learnt)."""
        yield
        self._stopping.set()
        if self._task is not None:
            await self._task
        if self.learner is not None:
            await asyncio.to_thread(self.save)

    async def _run(self) -> None:
        config = self.config
        next_tick = self._clock() + config.tick_s
        next_save = self._clock() + config.save_interval_s
        while not self._stopping.is_set():
            batch = await self._next_batch(max(0.0, next_tick - self._clock()))
            for event in batch:  # the clock follows the events, in arrival order
                self._advance(event.time)
            due = self._clock() >= next_tick
            if due:
                next_tick = self._clock() + config.tick_s
            if batch or due:
                await asyncio.to_thread(self._work, batch, self.now() if due else None)
            if self._clock() >= next_save:
                next_save = self._clock() + config.save_interval_s
                await asyncio.to_thread(self.save)

    async def _next_batch(self, timeout: float) -> list[SessionEvent]:
        """Up to ``_BATCH`` queued events; waits up to ``timeout`` for the first."""
        queue = self._queue
        if queue.empty():
            getter = asyncio.ensure_future(queue.get())
            stopper = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait(
                {getter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            stopper.cancel()
            if not getter.done():
                getter.cancel()
                return []
            batch = [getter.result()]
        else:
            batch = []
        while len(batch) < _BATCH and not queue.empty():
            batch.append(queue.get_nowait())
        return batch

    def _advance(self, when: float) -> None:
        offset = when - self._clock()
        if self._offset is None or offset > self._offset:
            self._offset = offset

    # -- worker threads -----------------------------------------------------------

    def _work(self, batch: list[SessionEvent], tick: float | None) -> None:
        """Apply events in order, then the tick; a failure costs one event, not the daemon."""
        driver = self._driver
        assert driver is not None, "load() starts the task that calls this"
        with self._lock:
            for event in batch:
                try:
                    with driver.store.locked():
                        self._apply(driver, event)
                        planned = self.policy.take_prefetches()
                    self._prefetch(driver, planned)
                    self.processed += 1
                except Exception:  # a background task: log, count, carry on serving
                    self.failed += 1
                    log.exception("predictor: %s of %r failed", event.kind.value, event.session)
            if tick is not None:
                try:
                    with driver.store.locked():
                        driver.tick(tick)
                        planned = self.policy.take_prefetches()
                    self._prefetch(driver, planned)
                    self._forget_idle(driver, tick)
                except Exception:  # as above: the next tick tries again
                    self.failed += 1
                    log.exception("predictor: the tick at %.3f failed", tick)

    def _prefetch(self, driver: SessionDriver, planned: list[PlannedPrefetch]) -> None:
        """Run the prefetches the hooks planned, in order, without the store's lock."""
        for plan in planned:
            self.policy.prefetch(driver.store, plan)

    def _apply(self, driver: SessionDriver, event: SessionEvent) -> None:
        keys, namespace = event.keys, event.namespace
        session = event.session
        if session == UNNAMED:
            session = driver.tracker.infer(keys) or f"inferred-{keys[-1].hex()}"
            event = dataclasses.replace(event, session=session)
        if keys:  # the engine's data path may name no session: the event says whose they are
            self.policy.touch(session, keys)
        elif session in self._puts:
            namespace, keys = self._puts[session]
        if isinstance(event, RequestStarted):
            state = driver.started(event, keys, namespace, event.user)
            driver.resumed(state, event.time)
            return
        placement = driver.finished(event, keys, namespace)
        if placement is not None:
            label = placement.placed.label if placement.placed is not None else "none"
            self.placements[label] += 1

    def _forget_idle(self, driver: SessionDriver, now: float) -> None:
        for state in driver.tracker.idle():
            assert state.idle_since is not None
            if now - state.idle_since > self.config.forget_after_s:
                driver.forget(state.session)
                self._puts.pop(state.session, None)

    def save(self) -> None:
        """Write the model atomically (a crash mid-save leaves the previous file); a
        failure is logged, and the next save tries again."""
        model = self.model
        assert model is not None, "load() the model first"
        with self._lock:
            partial = self.path.with_suffix(".partial")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                model.save(partial)
                os.replace(partial, self.path)
            except OSError as error:
                log.error("predictor: cannot save the model to %s: %s", self.path, error)
                return
            self.saves += 1

    # -- reading ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Counters, quality per horizon and model facts, for ``/v1/stats`` and ``/metrics``.

        ``quality[horizon][predictor|base_rate|last_gap]`` holds ``auc``,
        ``brier`` and ``log_loss`` (None until defined); ``n`` labels so far.
        """
        with self._lock:
            report = self.scores.report()
            idle = len(self.tracker.idle())
            placements = dict(self.placements)
            model, source = self.model, self.source
        quality: dict[str, dict[str, Any]] = {}
        for horizon, n in report.get("n", {}).items():
            entry: dict[str, Any] = {
                "n": int(n),
                "positive_rate": _finite(report["positive_rate"][horizon]),
            }
            for name, prefix in _BASELINES:
                entry[name] = {
                    metric: _finite(report[prefix + metric][horizon])
                    for metric in ("auc", "brier", "log_loss")
                }
            quality[horizon] = entry
        return {
            "enabled": True,
            "events_processed": self.processed,
            "events_dropped": self.dropped,
            "events_failed": self.failed,
            "events_queued": self._queue.qsize(),
            "idle_sessions": idle,
            "horizons_s": None if model is None else list(model.horizons),
            "quality": quality,
            "placements": placements,
            "demoted_chunks": self.policy.demoted,
            "prefetches": self.policy.prefetches.to_dict(),
            "model": {
                "source": source,
                "path": str(self.path),
                "saves": self.saves,
                "features": None if model is None else model.n_features,
                "hidden": None if model is None else model.hidden,
            },
        }

    def sessions(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` sessions seen last (running ones first), each as ``session``
        describes it: what an operator's listing shows."""
        with self._lock:
            states = self.tracker.all()
        running = [s for s in states if s.active]
        idle = sorted((s for s in states if not s.active), key=lambda s: -(s.idle_since or 0.0))
        described = (self.session(state.session) for state in (running + idle)[:limit])
        return [body for body in described if body is not None]

    def session(self, name: str) -> dict[str, Any] | None:
        """What the predictor knows of one session, with where its chain lies now, the
        blocks it owns per tier (what its placement moves), and the latest
        ``SESSION_DECISIONS`` decisions on it (None: nothing; so before ``load``,
        as every event still waits in the queue)."""
        with self._lock:
            driver, learner = self._driver, self.learner
            state = self.tracker.get(name)
            if driver is None or learner is None or state is None:
                return None
            forecast = learner.current_forecast(name)
            chain, digest = state.chain, state.namespace
            body: dict[str, Any] = {
                "session": name,
                "user": state.user,
                "active": state.active,
                "requests": state.requests,
                "idle_since": state.idle_since,
                "gaps": len(state.gaps),
                "forecast": None
                if forecast is None
                else {
                    "at": forecast.at,
                    "horizons_s": list(forecast.horizons),
                    "p_return": list(forecast.probabilities),
                },
            }
        body["chain"] = None if digest is None else _where(driver.store, digest, chain)
        with driver.store.locked():  # the policy's books change under the store's lock
            owned = self.policy.owned(name)
        body["owned"] = {kind.label: blocks for kind, blocks in owned.items()}
        body["decisions"] = self.decisions(name, SESSION_DECISIONS)["decisions"]
        return body

    def decisions(self, session: str | None, limit: int) -> dict[str, Any]:
        """The policy's latest ``limit`` decisions, newest first, of ``session`` only if
        given; ``recorded`` counts all it ever logged (the log keeps the latest
        ``decisions_kept``). Copied under the store's lock, the log's writers' lock."""
        log = self.policy.decisions
        store = self._store
        assert store is not None, "attach() the store first"
        with store.locked():
            latest = log.latest(session, limit)
            recorded = log.recorded
        return {
            "decisions": [decision.to_dict() for decision in latest],
            "recorded": recorded,
            "kept": log.kept,
        }


def _where(store: TieredStore, digest: bytes, chain: tuple[ChunkKey, ...]) -> dict[str, Any]:
    """How many chunks of ``chain`` each tier holds as the fastest copy."""
    chain = chain[: store.config.max_batch_chunks]
    try:
        located = store.locate(store.namespace(digest), chain)
    except UnknownNamespace:
        located = [None] * len(chain)
    tiers = Counter(kind.label if kind is not None else "missing" for kind in located)
    return {"namespace": digest.hex(), "chunks": len(chain), "tiers": dict(tiers)}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None

"""The daemon's predictor service in-process: a real ``TieredStore`` (DRAM arena + LMDB)
whose eviction policy is the service's ``PlacementPolicy``, events through the real
queue and task (``lifecycle``), the real learner and tracker. The daemon subprocess
tests (test_server_predictor.py) cover the same paths over HTTP."""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from support import kv

from kvstore.cli.daemon_stats import format_predictor
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.kinds import TierKind
from kvstore.predictor import service as service_module
from kvstore.predictor.config import PredictorConfig
from kvstore.predictor.learning.counting import HumanGapTable, blend
from kvstore.predictor.learning.features import feature_names
from kvstore.predictor.learning.model import DEFAULT_HORIZONS, ReturnModel, default_prior
from kvstore.predictor.service import MODEL_FILE, PredictorService, load_model
from kvstore.store.config import StoreConfig
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import UNNAMED, RequestFinished, RequestStarted, SessionEvent, Trigger

T0 = 1_800_000_000.0
DRAM_SLOTS = 20


def pessimist(path: Path) -> Path:
    """A model that expects nobody back: P(return) of 1%, 2%, 3% at 1 min, 10 min, 1 h."""
    ReturnModel(len(feature_names()), prior=(0.01, 0.02, 0.03)).save(path)
    return path


def started(session: str, at: float, **chain: object) -> RequestStarted:
    return RequestStarted(session, Trigger.USER, 1000, 0, at, **chain)  # type: ignore[arg-type]


def finished(session: str, at: float, **chain: object) -> RequestFinished:
    return RequestFinished(session, 1, 50, 1050, False, 0, 1000, at, **chain)  # type: ignore[arg-type]


@pytest.fixture
def ns() -> Namespace:
    return kv.namespace(salt="predictor-service")


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., TieredStore]]:
    """``make(service, root=tmp_path)``: a DRAM (20 slots) + LMDB store in ``root`` whose
    policy is the service's, attached to it."""
    stores: list[TieredStore] = []

    def make(service: PredictorService, root: Path = tmp_path) -> TieredStore:
        config = StoreConfig(tiers=(kv.dram(DRAM_SLOTS), kv.ssd(root / "lmdb")), data_dir=root)
        store = TieredStore(config, policy=service.policy)
        service.attach(store)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@asynccontextmanager
async def running(service: PredictorService) -> AsyncIterator[PredictorService]:
    """The service's ``cleanup_ctx`` lifecycle, as the app runs it, and its model loaded,
    as the daemon loads it once it listens."""
    lifecycle = service.lifecycle(None)
    await anext(lifecycle)
    await service.load()
    try:
        yield service
    finally:
        with pytest.raises(StopAsyncIteration):
            await anext(lifecycle)


async def feed(service: PredictorService, events: list[SessionEvent]) -> None:
    """Submit ``events`` and wait until the service has handled all of them."""
    target = service.processed + len(events)
    for event in events:
        assert service.submit(event)
    await handled(service, target)


async def handled(service: PredictorService, count: int) -> None:
    """Wait until the service has handled ``count`` events in all."""
    for _ in range(500):
        if service.processed >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"processed {service.processed} of {count} events")


def busy_and_idle(
    tmp_path: Path, make_store: Callable[..., TieredStore], ns: Namespace
) -> tuple[PredictorService, TieredStore, list[ChunkKey], list[ChunkKey]]:
    """A pessimist's service and its store, DRAM full with the chains of sessions "busy"
    (12 chunks) and "idle" (8, the latest put of "idle", as the put route records)."""
    config = PredictorConfig(weights=pessimist(tmp_path / "pessimist.pt"), tick_s=0.05)
    service = PredictorService(config, tmp_path)
    store = make_store(service)
    busy = chunk_keys(ns, kv.tokens(12, 0))
    idle = chunk_keys(ns, kv.tokens(8, 50_000))
    store.put(ns, busy, kv.chunks(12), session="busy")
    store.put(ns, idle, kv.chunks(8, seed=1), session="idle")
    service.saw_put("idle", ns.digest, tuple(idle))
    return service, store, busy, idle


def test_an_idle_session_nobody_expects_is_demoted_and_a_resume_prefetches_it(
    tmp_path: Path, make_store: Callable[..., TieredStore], ns: Namespace
) -> None:
    service, store, busy, idle = busy_and_idle(tmp_path, make_store, ns)

    async def scenario() -> None:
        async with running(service):
            await feed(
                service, [started("busy", T0), started("idle", T0), finished("idle", T0 + 5)]
            )
            # Under pressure, below a running session: out of DRAM at once, to the last tier.
            assert store.locate(ns, idle) == [TierKind.SSD] * 8
            assert store.locate(ns, busy) == [TierKind.DRAM] * 12
            info = service.session("idle")
            assert info is not None and info["chain"]["tiers"] == {"ssd": 8}
            # The model's 1-3%, blended with the previous-gap table's prior (no gap yet).
            table = HumanGapTable(DEFAULT_HORIZONS).predict(HumanGapTable.bin(()))
            expected = blend(np.array([0.01, 0.02, 0.03]), table)
            assert info["forecast"]["p_return"] == pytest.approx(expected, abs=1e-6)
            assert max(expected) < 0.5  # nobody expected back
            # The human is back: the chain goes up before the engine looks it up.
            await feed(service, [started("idle", T0 + 100)])
            assert store.locate(ns, idle) == [TierKind.DRAM] * 8
            assert all(chunk is not None for chunk in store.get(ns, idle))

    asyncio.run(scenario())
    snapshot = service.snapshot()
    assert snapshot["placements"] == {"ssd": 1} and snapshot["demoted_chunks"] == 8
    assert snapshot["prefetches"] == {"issued": 8, "used": 8, "wasted": 0, "pending": 0}
    assert snapshot["events_processed"] == 4 and snapshot["events_failed"] == 0
    assert (tmp_path / MODEL_FILE).exists()  # saved at shutdown


def test_a_prefetch_reads_its_chain_without_holding_the_store_lock(
    tmp_path: Path,
    make_store: Callable[..., TieredStore],
    ns: Namespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a chain back from LMDB takes milliseconds per MiB: while a resume's
    prefetch does it, another thread can still take the store's lock (a get, a put)."""
    service, store, _, idle = busy_and_idle(tmp_path, make_store, ns)
    others_got_the_lock: list[bool] = []
    others: list[threading.Thread] = []
    promote = store.promote

    def observed(namespace: Namespace, keys: list[ChunkKey], to: TierKind | None = None) -> int:
        taken = threading.Event()

        def other_request() -> None:
            with store.locked():
                taken.set()

        other = threading.Thread(target=other_request)
        other.start()
        others.append(other)  # joined at the end: it waits while the lock is held here
        others_got_the_lock.append(taken.wait(2))
        return promote(namespace, keys, to=to)

    monkeypatch.setattr(store, "promote", observed)

    async def scenario() -> None:
        async with running(service):
            await feed(
                service, [started("busy", T0), started("idle", T0), finished("idle", T0 + 5)]
            )
            assert store.locate(ns, idle) == [TierKind.SSD] * 8
            await feed(service, [started("idle", T0 + 100)])
            assert store.locate(ns, idle) == [TierKind.DRAM] * 8

    asyncio.run(scenario())
    for other in others:
        other.join()
    assert others_got_the_lock == [True]
    assert service.snapshot()["prefetches"]["issued"] == 8


def test_labels_are_learnt_when_returns_and_horizons_reveal_them(
    tmp_path: Path, make_store: Callable[..., TieredStore]
) -> None:
    """Ten sessions come back after 30 s, ten never do: once every horizon has passed
    (the event clock follows the events' times), each horizon has 20 labels, half 1."""
    service = PredictorService(PredictorConfig(tick_s=0.05), tmp_path)
    make_store(service)
    events: list[SessionEvent] = []
    for i in range(20):
        at = T0 + 10 * i
        events += [started(f"s{i}", at), finished(f"s{i}", at + 5)]
        if i % 2 == 0:
            events.append(started(f"s{i}", at + 35))  # back within a minute, still running
    events.sort(key=lambda event: event.time)
    priors: list[np.ndarray] = []

    async def scenario() -> None:
        async with running(service):
            assert service.model is not None
            priors.append(service.model.predict(service.model.feature_mean.numpy()))
            await feed(service, events)
            # The stream spans 235 s: only 60-s horizons can have closed yet.
            assert set(service.snapshot()["quality"]) == {"60"}
            await feed(service, [started("late", T0 + 4000)])  # every horizon has passed

    asyncio.run(scenario())
    quality = service.snapshot()["quality"]
    assert set(quality) == {"60", "600", "3600"}
    for entry in quality.values():
        assert entry["n"] == 20 and entry["positive_rate"] == 0.5
        assert set(entry) == {"n", "positive_rate", "predictor", "base_rate", "last_gap"}
        assert entry["predictor"]["brier"] is not None and entry["base_rate"]["auc"] is not None
    assert service.model is not None
    assert service.model.predict(service.model.feature_mean.numpy()) != pytest.approx(priors[0])


def test_unnamed_events_are_tied_to_sessions_by_their_chains(
    tmp_path: Path, make_store: Callable[..., TieredStore], ns: Namespace
) -> None:
    service = PredictorService(PredictorConfig(tick_s=0.05), tmp_path)
    make_store(service)
    turn = chunk_keys(ns, kv.tokens(8, 0))
    other = chunk_keys(ns, kv.tokens(3, 90_000))

    def chain(keys: list[ChunkKey]) -> dict[str, object]:
        return {"namespace": ns.digest, "keys": tuple(keys)}

    async def scenario() -> None:
        async with running(service):
            await feed(
                service,
                [
                    started(UNNAMED, T0, **chain(turn[:3])),
                    finished(UNNAMED, T0 + 5, **chain(turn[:5])),  # prompt + answer
                    started(UNNAMED, T0 + 60, **chain(turn[:8])),  # the follow-up extends it
                    started(UNNAMED, T0 + 61, **chain(other)),  # a new conversation
                ],
            )

    asyncio.run(scenario())
    first = service.session(f"inferred-{turn[2].hex()}")
    assert first is not None and first["requests"] == 2 and first["gaps"] == 1
    assert first["chain"]["chunks"] == 8
    second = service.session(f"inferred-{other[-1].hex()}")
    assert second is not None and second["requests"] == 1


def test_events_before_the_model_is_loaded_wait_and_are_forecast_as_from_the_start(
    tmp_path: Path, make_store: Callable[..., TieredStore]
) -> None:
    """The daemon takes events before it has loaded its model: they wait in the queue,
    unhandled however many ticks pass, and once it is loaded they are handled in order,
    forecast, learnt from and scored as by a service that had its model from the start."""
    events: list[SessionEvent] = [
        started("a", T0),
        finished("a", T0 + 5),
        started("b", T0 + 6),
        finished("b", T0 + 9),
        started("a", T0 + 40),  # back: a's forecast is labelled, and learnt from
        finished("a", T0 + 45),  # forecast again, by the model that learnt
    ]

    def service_in(root: Path) -> PredictorService:
        service = PredictorService(PredictorConfig(tick_s=0.05), root)
        make_store(service, root)
        return service

    from_the_start = service_in(tmp_path / "from-the-start")
    waiting = service_in(tmp_path / "waiting")

    async def scenario() -> None:
        async with running(from_the_start):
            await feed(from_the_start, events)
        lifecycle = waiting.lifecycle(None)
        await anext(lifecycle)
        for event in events:
            assert waiting.submit(event)
        await asyncio.sleep(0.2)  # four ticks' worth
        before = waiting.snapshot()
        assert (before["events_processed"], before["events_queued"]) == (0, len(events))
        assert before["model"]["source"] == "loading" and before["horizons_s"] is None
        assert "predictor  model loading  events 0" in format_predictor(before)[0]
        assert waiting.session("a") is None
        await waiting.load()
        await handled(waiting, len(events))
        with pytest.raises(StopAsyncIteration):
            await anext(lifecycle)

    asyncio.run(scenario())
    for name in ("a", "b"):
        expected = from_the_start.session(name)
        got = waiting.session(name)
        assert expected is not None and got is not None
        assert got["forecast"]["at"] == expected["forecast"]["at"]
        assert got["forecast"]["p_return"] == pytest.approx(expected["forecast"]["p_return"])
    assert waiting.snapshot()["quality"] == from_the_start.snapshot()["quality"]
    assert waiting.snapshot()["model"]["source"] == "prior"


def test_a_model_the_host_cannot_load_leaves_the_service_serving_without_one(
    tmp_path: Path, make_store: Callable[..., TieredStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No file descriptor left as the daemon starts: torch cannot even be imported.
    The service says so and goes on without a model (its queue fills, then drops);
    nothing is saved over the model file at shutdown."""

    def out_of_descriptors(*_: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(service_module, "load_model", out_of_descriptors)
    service = PredictorService(PredictorConfig(queue_size=2, tick_s=0.05), tmp_path)
    make_store(service)

    async def scenario() -> None:
        async with running(service):
            assert [service.submit(started("a", T0 + i)) for i in range(3)] == [True, True, False]
            await asyncio.sleep(0.1)

    asyncio.run(scenario())
    snapshot = service.snapshot()
    assert snapshot["model"]["source"] == "unavailable" and service.model is None
    assert (snapshot["events_processed"], snapshot["events_dropped"]) == (0, 1)
    assert service.session("a") is None and not (tmp_path / MODEL_FILE).exists()


def test_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    service = PredictorService(PredictorConfig(queue_size=2), tmp_path)
    assert [service.submit(started("a", T0 + i)) for i in range(3)] == [True, True, False]
    assert service.snapshot()["events_dropped"] == 1


def test_the_model_comes_from_the_saved_file_then_weights_then_the_prior(tmp_path: Path) -> None:
    saved = tmp_path / MODEL_FILE
    weights = pessimist(tmp_path / "pessimist.pt")
    width = len(feature_names())
    model, source = load_model(PredictorConfig(horizons_s=(30.0, 300.0)), saved)
    assert source == "prior" and model.horizons == (30.0, 300.0)
    assert model.predict(model.feature_mean.numpy()) == pytest.approx(default_prior((30, 300)))
    model, source = load_model(PredictorConfig(weights=weights), saved)
    assert source == "weights"
    saved.parent.mkdir()
    kept = ReturnModel(width, hidden=4)
    kept.counts.tools.learn(0, 0)  # a tool that was not back within a minute
    kept.save(saved)
    model, source = load_model(PredictorConfig(weights=weights), saved)
    assert source == "saved" and model.hidden == 4
    assert model.counts.to_state() == kept.counts.to_state()  # what it counted, too
    # A saved model for another feature list is set aside, not trusted.
    ReturnModel(width + 1).save(saved)
    model, source = load_model(PredictorConfig(weights=weights), saved)
    assert source == "weights" and saved.with_suffix(".stale").exists() and not saved.exists()
    saved.write_bytes(b"not a model")
    assert load_model(PredictorConfig(), saved)[1] == "prior"


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"garbage", "cannot read model"), (None, "takes \\d+ features")],
)
def test_unusable_weights_are_config_errors(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    weights = tmp_path / "weights.pt"
    if content is None:
        ReturnModel(len(feature_names()) + 1).save(weights)
    else:
        weights.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_model(PredictorConfig(weights=weights), tmp_path / MODEL_FILE)
    with pytest.raises(ConfigError, match="cannot read model"):
        load_model(PredictorConfig(weights=tmp_path / "missing.pt"), tmp_path / MODEL_FILE)

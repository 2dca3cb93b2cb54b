"""The predictor inside a real ``kvstore serve`` subprocess: events posted over the Unix
socket are learnt from and acted on in the real store; quality shows in ``/v1/stats``,
``kvstore stats`` and ``/metrics``; the model survives SIGTERM and a restart; a model
from ``kvstore train-predictor`` starts a daemon.

The event streams keep a clock of their own (``support.predictor_events``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import kv
from support.daemon import Daemon, DaemonStartError
from support.http_kv import frames_body, get_bytes, lookup, make_chain, put_raw, register
from support.predictor_events import (
    OWN_CLOCK,
    RETURNING_SESSIONS,
    T0,
    finished,
    post,
    processed,
    returning_sessions,
    started,
    stats,
)

import kvstore
from kvstore.cli import main
from kvstore.cli.daemon_stats import format_stats
from kvstore.errors import BadRequest
from kvstore.keys import keys_of
from kvstore.predictor.learning.counting import HumanGapTable, blend
from kvstore.predictor.learning.features import feature_names, feature_vector
from kvstore.predictor.learning.model import ReturnModel, default_prior
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.service import MODEL_FILE
from kvstore.wire.events import UNNAMED, RequestStarted, Trigger

STORE_TOML = """\
data_dir = "{{data_dir}}"

[tiers.dram]
capacity = {dram_bytes}

[tiers.ssd]
capacity = "64MiB"

[predictor]
{predictor}
"""


def config(dram_slots: int = 64, tick_s: float = 0.1, **predictor: Any) -> str:
    settings = {"tick_s": tick_s, **predictor}
    lines = "\n".join(f"{name} = {json.dumps(value)}" for name, value in settings.items())
    return STORE_TOML.format(dram_bytes=dram_slots * kv.ARENA_SLOT, predictor=lines)


def session(client: httpx.Client, name: str) -> dict[str, Any]:
    response = client.get(f"/v1/sessions/{name}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, dict)
    return body


def test_the_daemon_learns_reports_and_keeps_its_model_across_a_restart(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(config(), daemon=OWN_CLOCK)
    events = returning_sessions()
    with daemon.client() as client:
        post(client, *events)
        body = stats(client, processed(len(events)))
        predictor = body["predictor"]
        assert predictor["model"]["source"] == "prior" and predictor["events_failed"] == 0
        for horizon in ("60", "600", "3600"):
            entry = predictor["quality"][horizon]
            assert entry["n"] == RETURNING_SESSIONS and entry["positive_rate"] == 0.5
        table = format_stats(body)
        assert "quality: predictor / base rate / last gap short" in table
        assert "3600 s" in table and "model from prior" in table

        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        scores = {
            (s.labels["horizon"], s.labels["model"]): s.value
            for s in families["kvstore_predictor_brier"].samples
        }
        assert set(scores) == {
            (h, m) for h in ("60", "600", "3600") for m in ("predictor", "base_rate", "last_gap")
        }
        auc = families["kvstore_predictor_auc"].samples
        assert {s.labels["model"] for s in auc} == {"predictor", "base_rate", "last_gap"}
        labels = {
            s.labels["horizon"]: s.value for s in families["kvstore_predictor_labels"].samples
        }
        assert labels == {h: RETURNING_SESSIONS for h in ("60", "600", "3600")}
        prefetches = families["kvstore_predictor_prefetches"].samples
        assert {s.labels["outcome"] for s in prefetches} == {"issued", "used", "wasted"}
        before = session(client, "probe")["forecast"]
    assert before["at"] == T0 + 4010
    assert before["p_return"] != pytest.approx(default_prior(before["horizons_s"]), abs=1e-4)

    assert daemon.stop(signal.SIGTERM) == 0
    assert (daemon.data_dir / MODEL_FILE).exists()
    daemon.start()
    with daemon.client() as client:
        post(client, started("probe-again", T0 + 4000), finished("probe-again", T0 + 4010))
        assert stats(client, processed(2))["predictor"]["model"]["source"] == "saved"
        after = session(client, "probe-again")["forecast"]
    assert after["p_return"] == pytest.approx(before["p_return"], abs=1e-6)


def test_an_idle_chain_is_demoted_and_a_resume_brings_it_back(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """DRAM holds 20 chunks and is full; the model expects nobody back. The idle
    session's chain leaves DRAM for LMDB at once; its next request brings it back up
    before the engine looks it up, and the engine's get reads it there (used)."""
    weights = tmp_path / "pessimist.pt"
    ReturnModel(len(feature_names()), prior=(0.01, 0.02, 0.03)).save(weights)
    daemon = daemon_factory(config(dram_slots=20, weights=str(weights)), daemon=OWN_CLOCK)
    ns = kv.namespace(salt="demote")
    busy, idle = make_chain(ns, 12), make_chain(ns, 8, start=50_000, seed=1)
    with daemon.client() as client:
        register(client, ns)
        for name, chain in (("busy", busy), ("idle", idle)):
            response = put_raw(client, frames_body(ns, chain.keys, chain.blocks, session=name))
            assert response.status_code == 200 and response.json() == {"stored": len(chain.keys)}
        post(client, started("busy", T0), started("idle", T0), finished("idle", T0 + 5))
        stats(client, processed(3))
        assert session(client, "idle")["chain"]["tiers"] == {"ssd": 8}  # from the put's chain
        assert lookup(client, ns, idle.keys)["tiers"] == ["ssd"] * 8
        assert lookup(client, ns, busy.keys)["tiers"] == ["dram"] * 12
        predictor = stats(client, processed(3))["predictor"]
        assert predictor["placements"] == {"ssd": 1} and predictor["demoted_chunks"] == 8

        post(client, started("idle", T0 + 600))
        stats(client, processed(4))
        assert lookup(client, ns, idle.keys)["tiers"] == ["dram"] * 8
        _, blocks = get_bytes(client, ns, idle.keys)
        assert blocks == idle.blocks
        predictor = stats(client, lambda p: p["prefetches"]["used"] == 8)["predictor"]
        assert predictor["prefetches"] == {"issued": 8, "used": 8, "wasted": 0, "pending": 0}
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    used = [s for s in families["kvstore_predictor_prefetches"].samples if s.name.endswith("total")]
    assert {s.labels["outcome"]: s.value for s in used} == {"issued": 8, "used": 8, "wasted": 0}
    placed = families["kvstore_predictor_placements"].samples
    assert [(s.labels["tier"], s.value) for s in placed if s.name.endswith("total")] == [("ssd", 1)]


def test_the_daemon_says_why_it_moved_each_sessions_kv(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """DRAM holds 20 chunks; the model expects nobody back. An idle chain stays in DRAM
    while there is room, copied to LMDB first; a busy session's put pushes four of its
    blocks out (one record, though the put evicts block by block); its next request
    brings them back, pushing out the busy session's tail. No tick in between: each
    decision is at the time of the event before it."""
    weights = tmp_path / "pessimist.pt"
    ReturnModel(len(feature_names()), prior=(0.01, 0.02, 0.03)).save(weights)
    daemon = daemon_factory(
        config(dram_slots=20, tick_s=3600.0, weights=str(weights)), daemon=OWN_CLOCK
    )
    ns = kv.namespace(salt="decisions")
    idle, busy = make_chain(ns, 8), make_chain(ns, 16, start=50_000, seed=1)
    with daemon.client() as client:
        register(client, ns)
        assert put_raw(client, frames_body(ns, idle.keys, idle.blocks, session="idle")).json() == {
            "stored": 8
        }
        post(client, started("idle", T0), finished("idle", T0 + 5), started("busy", T0 + 10))
        stats(client, processed(3))
        assert put_raw(client, frames_body(ns, busy.keys, busy.blocks, session="busy")).json() == {
            "stored": 16
        }
        post(client, started("idle", T0 + 600))
        stats(client, processed(4))
        everyone = client.get("/v1/decisions").json()
        only_idle = client.get("/v1/decisions", params={"session": "idle", "limit": 3}).json()
        in_session = session(client, "idle")
        refused = [client.get("/v1/decisions", params={"limit": n}) for n in ("0", "1001", "x")]
    rows = [
        (d["session"], d["at"] - T0, d["action"], d["from"], d["to"], d["chunks"])
        for d in everyone["decisions"]
    ]
    assert rows == [  # newest first
        ("idle", 600, "prefetch", "ssd", "dram", 4),
        ("busy", 600, "evict", "dram", "ssd", 4),
        ("idle", 600, "prefetch_planned", "ssd", "dram", 4),
        ("idle", 10, "evict", "dram", "ssd", 4),
        ("idle", 5, "write_down", "dram", "ssd", 8),
        ("idle", 5, "place", "dram", None, 8),
    ]
    assert (everyone["recorded"], everyone["kept"]) == (6, 1000)
    forecast = everyone["decisions"][-1]["forecast"]
    assert forecast["at"] == T0 + 5 and forecast["horizons_s"] == [60.0, 600.0, 3600.0]
    reasons = [d["reason"] for d in everyone["decisions"]]
    resumed = "request started: its lookup is next"
    assert reasons[:3] == [resumed, "pressure: dram full; session running", resumed]
    assert reasons[3].startswith("pressure: dram full; P(back within 600 s)=0.0")
    assert reasons[4:] == [
        "copied ahead of eviction: ssd has room",
        f"P(back within 3600 s)={forecast['p_return'][2]:.2f} < keep 0.5",
    ]
    assert only_idle["decisions"] == [everyone["decisions"][i] for i in (0, 2, 3)]
    assert in_session["decisions"] == [d for d in everyone["decisions"] if d["session"] == "idle"]
    assert in_session["chain"]["tiers"] == {"dram": 8}
    for response in refused:
        assert response.status_code == 400 and response.json()["error"]["code"] == "bad_request"


def test_a_session_moved_to_another_daemon_keeps_its_gap_and_is_labelled_once(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """An engine moves session "m" from daemon A to daemon B after A saw it go idle, and
    says when it last finished: B counts the gap, A's forecast is never labelled by B,
    and when "m" comes back to A later A drops the forecast it made, whose end it
    never saw, instead of labelling the whole time in between as one long gap."""
    host_a = daemon_factory(config(), daemon=OWN_CLOCK)
    host_b = daemon_factory(config(), daemon=OWN_CLOCK)
    with host_a.client() as on_a, host_b.client() as on_b:
        post(on_a, started("m", T0), finished("m", T0 + 10))
        moved = RequestStarted("m", Trigger.USER, 1000, 0, T0 + 130, idle_since=T0 + 10)
        post(on_b, moved, finished("m", T0 + 140))
        stats(on_b, processed(2))
        assert session(on_b, "m")["gaps"] == 1  # the 120 s it waited, though not on B
        back = RequestStarted("m", Trigger.USER, 1000, 0, T0 + 200, idle_since=T0 + 140)
        post(on_a, back)
        labelled = stats(on_a, processed(3))["predictor"]["quality"]
        # A's forecast from T0 + 10 ended on B (at T0 + 130). Its 1-minute horizon had
        # passed, and was labelled "not back", before A could know; the others are
        # dropped, not labelled as if A had seen a 190 s gap.
        assert {horizon: entry["n"] for horizon, entry in labelled.items()} == {"60": 1}
        assert session(on_a, "m")["gaps"] == 1 and session(on_a, "m")["active"]


def test_a_users_new_session_forecasts_their_idle_one_again_in_the_daemon(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """``user`` on request_started ties sessions to a person: when that person starts a
    new session, the daemon's predictor forecasts their other idle session again (a
    revision from the start's time, scaled by how often such sessions came back); a
    session of another user is left as it was forecast."""
    daemon = daemon_factory(config(), daemon=OWN_CLOCK)

    def start(name: str, at: float, user: str) -> RequestStarted:
        return RequestStarted(name, Trigger.USER, 1000, 0, at, user=user)

    with daemon.client() as client:
        post(client, start("old", T0, "alice"), finished("old", T0 + 10))
        post(client, start("other", T0, "bob"), finished("other", T0 + 10))
        stats(client, processed(4))
        assert session(client, "old")["forecast"]["at"] == T0 + 10
        post(client, start("new", T0 + 100, "alice"))
        stats(client, processed(5))
        revised = session(client, "old")["forecast"]
        assert revised["at"] == T0 + 100  # forecast again when alice started "new"
        assert session(client, "other")["forecast"]["at"] == T0 + 10


def test_events_that_carry_chains_find_their_session_by_the_chain(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A client that knows no session ids (the vLLM connector) sends each request's
    chain and leaves the session ``UNNAMED``: the daemon names it after the first
    prompt's chain, a call that extends the last one's chain continues it, and the
    chain tells the daemon where the session's KV lies, and that the blocks, put with
    no session, are its own to place."""
    daemon = daemon_factory(config(), daemon=OWN_CLOCK)
    ns = kv.namespace(salt="unnamed")
    keys = keys_of(ns, kv.tokens(6))
    chunk = ns.layout.chunk_tokens

    def call(store: kvstore.KVClient, prompt: int, output: int, at: float) -> None:
        store.request_started(
            UNNAMED, prompt_tokens=prompt * chunk, cached_tokens=0, time=at,
            namespace=ns, keys=keys[:prompt],
        )  # fmt: skip
        store.request_finished(
            UNNAMED, steps=1, output_tokens=output * chunk,
            context_tokens=(prompt + output) * chunk, loaded_tokens=0,
            recomputed_tokens=prompt * chunk, time=at + 5, namespace=ns,
            keys=keys[: prompt + output],
        )  # fmt: skip

    with kvstore.connect(daemon.url) as store:
        assert store.put(ns, keys, kv.chunks(6)) == 6
        call(store, 3, 1, T0)
        call(store, 5, 1, T0 + 65)  # the first call's prompt and output, and more
        with pytest.raises(BadRequest, match="namespace"):
            store.request_started(UNNAMED, prompt_tokens=1, cached_tokens=0, keys=keys[:1])
        assert store.client_stats().events_rejected == 0
    with daemon.client() as client:
        stats(client, processed(4))
        body = session(client, f"inferred-{keys[2].hex()}")
    assert (body["requests"], body["gaps"], body["active"]) == (2, 1, False)
    assert body["chain"]["chunks"] == 6 and "missing" not in body["chain"]["tiers"]
    assert body["owned"] == {"dram": 6, "ssd": 6}  # all of it its own, and copied down
    placed = [d for d in body["decisions"] if d["action"] == "place"]
    assert len(placed) == 2 and placed[0]["chunks"] == 6  # each time it went idle


def test_a_model_from_train_predictor_starts_a_daemon(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = []
    for i in range(30):  # one-block prompts that grow by a block each turn, 40 s apart
        base = 100 * i
        for turn in range(3):
            rows.append(
                {
                    "timestamp": int((i * 7 + turn * 40) * 1000),
                    "input_length": 512 * (turn + 1),
                    "output_length": 50,
                    "hash_ids": [base + j for j in range(turn + 1)],
                }
            )
    rows.sort(key=lambda row: row["timestamp"])
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    weights = tmp_path / "trained.pt"
    assert main(["train-predictor", str(trace), "--out", str(weights), "--format", "mooncake"]) == 0
    trained = ReturnModel.load(weights)

    daemon = daemon_factory(config(weights=str(weights)), daemon=OWN_CLOCK)
    with daemon.client() as client:
        post(client, started("probe", T0), finished("probe", T0 + 10))
        assert stats(client, processed(2))["predictor"]["model"]["source"] == "weights"
        forecast = session(client, "probe")["forecast"]
    # The same session seen in-process gives the trained model's answer, blended with
    # the previous-gap table the training counted (saved with the weights, not the prior).
    tracker = SessionTracker()
    tracker.started(started("probe", T0))
    state = tracker.finished(finished("probe", T0 + 10))
    model = trained.predict(feature_vector(state, T0 + 10, tracker))
    gap_bin = HumanGapTable.bin(state.human_gaps)
    table = trained.counts.gap_table.predict(gap_bin)
    prior = HumanGapTable(trained.horizons).predict(gap_bin)
    assert table.tolist() != prior.tolist()
    assert forecast["p_return"] == pytest.approx(blend(model, table), abs=1e-6)


def test_unusable_weights_stop_the_daemon_with_a_clear_error(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The daemon listens before it loads its model, so it may answer ``/healthz`` first;
    then it stops, with exit status 1 and the reason."""
    weights = tmp_path / "garbage.pt"
    weights.write_bytes(b"not a model")
    daemon = daemon_factory(config(weights=str(weights)), start=False)
    try:
        daemon.start()
    except DaemonStartError as failure:  # it had stopped already
        code, output = failure.returncode, failure.output
    else:
        assert daemon.proc is not None
        daemon.proc.wait(timeout=20)
        code, output = daemon.stop(), daemon.log()
    assert code == 1
    assert "kvstore serve: predictor: predictor.weights: cannot read model" in output


def test_a_daemon_stopped_while_its_model_loads_exits_without_waiting_for_the_load(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The model loads after the daemon listens, and a SIGTERM meanwhile must not wait
    for it: an operator's restart in the first seconds would otherwise wait out the
    torch import. Here the load never ends (its weights are a FIFO nobody writes), so
    a daemon that waited would be killed at ``stop``'s deadline, not exit 0."""
    weights = tmp_path / "weights.fifo"
    os.mkfifo(weights)
    daemon = daemon_factory(config(weights=str(weights)), daemon=OWN_CLOCK)
    with daemon.client() as client:
        assert client.get("/v1/stats").json()["predictor"]["model"]["source"] == "loading"
    assert daemon.stop(timeout_s=15) == 0
    assert "stopped in" in daemon.log()


def test_a_disabled_predictor_keeps_lru_and_only_records_events(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(config(enabled=False), daemon=OWN_CLOCK)
    with daemon.client() as client:
        post(client, started("quiet", T0), finished("quiet", T0 + 1))
        body = client.get("/v1/stats").json()
        assert body["predictor"] == {"enabled": False}
        assert body["daemon"]["events_received"] == 2
        missing = client.get("/v1/sessions/quiet")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert "predictor disabled" in format_stats(body)
        assert client.get("/v1/decisions").status_code == 404
        metrics = client.get("/metrics").text
    assert "kvstore_predictor_" not in metrics


def test_unknown_sessions_are_404(daemon: Daemon) -> None:
    with daemon.client() as client:
        response = client.get("/v1/sessions/nobody-ever")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_events_off_the_daemons_clock_are_refused_and_leave_the_predictor_as_it_was(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """One event stamped far ahead would move the event clock past every horizon and
    label each pending forecast "not returned"; it is refused (400, counted) instead,
    as are times no double holds, and the forecast stays pending."""
    daemon = daemon_factory(config())  # the default window: 300 s ahead, 6 h behind
    now = time.time()
    with daemon.client() as client:
        post(client, started("victim", now), finished("victim", now + 1))
        stats(client, processed(2))
        pending = session(client, "victim")["forecast"]
        assert pending is not None
        refused = {
            "clock_skew": [str(1e300), str(now + 3600), str(now - 7 * 3600), "-1"],
            "invalid": ["1e400", "9" * 400, "NaN"],
        }
        for times in refused.values():
            for when in times:
                body = json.dumps(started("intruder", now).to_json())
                body = body.replace(f'"time": {json.dumps(now)}', f'"time": {when}')
                assert when in body
                response = client.post(
                    "/v1/events", content=body, headers={"Content-Type": "application/json"}
                )
                assert response.status_code == 400, (when, response.text)
                assert response.json()["error"]["code"] == "bad_request"
        time.sleep(1.0)  # ten ticks: any jump of the event clock would label by now
        body = client.get("/v1/stats").json()
        predictor = body["predictor"]
        assert predictor["events_processed"] == 2 and body["daemon"]["events_received"] == 2
        assert all(entry["n"] == 0 for entry in predictor["quality"].values())
        assert session(client, "victim")["forecast"] == pending
        assert client.get("/v1/sessions/intruder").status_code == 404
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        rejected = {
            s.labels["reason"]: s.value
            for s in families["kvstore_client_events_rejected"].samples
            if s.name.endswith("_total")
        }
    assert rejected == {reason: len(times) for reason, times in refused.items()}

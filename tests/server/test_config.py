"""The daemon's pieces without a daemon: its config (file and environment), the lease
table (pins given back exactly once) and session-event parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import kv

from kvstore import TieredStore
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.predictor.config import PredictorConfig
from kvstore.server.config import DaemonConfig, ServiceConfig
from kvstore.server.event_log import EventLog
from kvstore.server.leases import LeaseTable
from kvstore.store.config import StoreConfig
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.events import (
    MAX_IDLE_S,
    MAX_SESSION_CHARS,
    UNNAMED,
    RequestFinished,
    Trigger,
    event_to_bytes,
    parse_event,
    parse_event_bytes,
)

# -- config ------------------------------------------------------------------------------


def _write(tmp_path: Path, daemon_table: str = "") -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(
        f'data_dir = "{tmp_path}"\n\n[tiers.dram]\ncapacity = "1MiB"\n\n[daemon]\n{daemon_table}'
    )
    return path


def test_defaults_come_from_the_store_data_dir(tmp_path: Path) -> None:
    config = ServiceConfig.load(_write(tmp_path), environ={})
    assert config.daemon.socket_path == tmp_path / "kvstore.sock"
    assert config.daemon.tcp_port is None and config.daemon.auth_token is None
    assert config.daemon.lease_ttl_s == 10.0
    assert config.store.tier(kv.dram(1).kind) is not None


def test_file_then_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, 'lease_ttl_s = 2\nmax_body_bytes = "8MiB"\nauth_token = "file"\n')
    env = {
        "KVSTORE_DAEMON_TCP_PORT": "7480",
        "KVSTORE_DAEMON_ACCESS_LOG": "yes",
        "KVSTORE_AUTH_TOKEN": "0123456789",  # digits stay a string
        "KVSTORE_PROMOTE_ON_HIT": "false",  # still the store's
    }
    config = ServiceConfig.load(path, environ=env)
    assert config.daemon.lease_ttl_s == 2.0 and config.daemon.max_body_bytes == 8 << 20
    assert config.daemon.tcp_port == 7480 and config.daemon.access_log is True
    assert config.daemon.auth_token == "0123456789"
    assert config.store.promote_on_hit is False
    assert "0123456789" not in repr(config.daemon)  # the token never reaches a log line
    # The store's own loader is not confused by the daemon's variables either.
    assert StoreConfig.from_env(env).promote_on_hit is False


def test_time_bounds_default_and_the_body_deadline_grows_with_the_length(
    tmp_path: Path,
) -> None:
    defaults = ServiceConfig.load(_write(tmp_path), environ={}).daemon
    assert (defaults.header_timeout_s, defaults.body_deadline_base_s) == (10.0, 10.0)
    assert defaults.min_body_bytes_per_s == 1 << 20
    assert (defaults.event_time_ahead_s, defaults.event_time_behind_s) == (300.0, 21600.0)
    assert defaults.body_deadline_s(0) == 10.0
    assert defaults.body_deadline_s(512 << 20) == 10.0 + 512
    path = _write(tmp_path, 'min_body_bytes_per_s = "64MiB"\nbody_deadline_base_s = 2\n')
    env = {"KVSTORE_DAEMON_MIN_BODY_BYTES_PER_S": "128MiB"}
    config = ServiceConfig.load(path, environ=env).daemon
    assert config.min_body_bytes_per_s == 128 << 20
    assert config.body_deadline_s(256 << 20) == 2.0 + 2


@pytest.mark.parametrize(
    ("table", "env", "message"),
    [
        ("tcp_port = 7480\n", {}, "refusing to listen on TCP without an auth token"),
        ("surprise = 1\n", {}, "unknown daemon setting"),
        ('lease_ttl_s = "soon"\n', {}, "lease_ttl_s must be of type float"),
        ("lease_ttl_s = 0\n", {}, "must be a positive number"),
        ("header_timeout_s = 0\n", {}, "header_timeout_s must be a positive number"),
        ("event_time_ahead_s = -1\n", {}, "event_time_ahead_s must be a positive number"),
        ("min_body_bytes_per_s = 0\n", {}, "min_body_bytes_per_s must be positive"),
        ("tcp_port = 70000\nauth_token = 'x'\n", {}, "not a port number"),
        ("", {"KVSTORE_DAEMON_WORKERS": "many"}, "is not of type int"),
        ('log_level = "chatty"\n', {}, "log_level must be one of"),
        (f'socket_path = "/tmp/{"x" * 120}"\n', {}, "longer than 107 bytes"),
    ],
)
def test_bad_settings_are_config_errors(
    tmp_path: Path, table: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ServiceConfig.load(_write(tmp_path, table), environ=env)


def test_daemon_config_needs_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a table"):
        DaemonConfig.from_mapping(["x"], data_dir=tmp_path, environ={})  # type: ignore[arg-type]


# -- leases ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_leases_pin_until_released_or_expired_exactly_once() -> None:
    ns = kv.namespace()
    clock = Clock()
    with TieredStore(kv.config(kv.dram(8))) as store:
        store.put(ns, kv.tokens(4), kv.chunks(4))
        keys = store.keys_for(ns, kv.tokens(4))
        table = LeaseTable(store.serving(), ttl_s=5.0, max_leases=2, clock=clock)
        first, shared = table.grant(ns, keys)
        assert [block is not None for block in shared] == [True] * 4
        assert first.keys == tuple(keys) and table.pinned_blocks == 4
        assert store.demote(ns, keys) == 0  # pinned: nothing moves
        second, _ = table.grant(ns, keys[:1])
        with pytest.raises(WireError) as full:
            table.grant(ns, keys)
        assert full.value.code is ErrorCode.REQUEST_TOO_LARGE
        assert table.next_expiry() == 5.0
        assert table.release(first.id) == 4
        with pytest.raises(WireError) as gone:
            table.release(first.id)
        assert gone.value.code is ErrorCode.UNKNOWN_LEASE
        clock.now += 5.0
        assert table.expire() == 1 and len(table) == 0
        with pytest.raises(WireError):
            table.release(second.id)
        assert store.demote(ns, keys) == 4  # every pin was given back


def test_release_many_unpins_the_leases_still_there_exactly_once() -> None:
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(8))) as store:
        store.put(ns, kv.tokens(4), kv.chunks(4))
        keys = store.keys_for(ns, kv.tokens(4))
        table = LeaseTable(store.serving(), ttl_s=5.0, max_leases=8)
        first, _ = table.grant(ns, keys[:2])
        second, _ = table.grant(ns, keys[2:])
        table.release(second.id)
        # Released already, unknown, named twice: each skipped, nothing unpinned twice.
        assert table.release_many([second.id, "unknown", first.id, first.id]) == 1
        assert len(table) == 0 and table.pinned_blocks == 0
        assert store.demote(ns, keys) == 4


def test_release_all_unpins_everything() -> None:
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(8))) as store:
        store.put(ns, kv.tokens(2), kv.chunks(2))
        keys = store.keys_for(ns, kv.tokens(2))
        table = LeaseTable(store.serving(), ttl_s=5.0, max_leases=8)
        table.grant(ns, keys)
        table.grant(ns, keys)
        assert table.release_all() == 2
        assert store.demote(ns, keys) == 2


# -- events ------------------------------------------------------------------------------


def test_events_parse_into_types_and_the_ring_is_bounded() -> None:
    started = parse_event(
        {
            "event": "request_started",
            "session": "s",
            "trigger": "user",
            "prompt_tokens": 10,
            "cached_tokens": 5,
        }
    )
    assert started.kind.value == "request_started" and started.trigger is Trigger.USER
    assert started.time > 0  # the daemon's clock when the client gave none
    finished = parse_event(
        {
            "event": "request_finished",
            "session": "s",
            "steps": 1,
            "output_tokens": 2,
            "context_tokens": 3,
            "tool_running": True,
            "loaded_tokens": 4,
            "recomputed_tokens": 5,
            "time": 12.5,
        }
    )
    assert isinstance(finished, RequestFinished) and finished.time == 12.5
    log = EventLog(2)
    for event in (started, finished, started):
        log.append(event)
    assert log.recent() == [finished, started] and log.received == 3
    with pytest.raises(WireError):
        parse_event({"event": "request_started", "session": "s", "trigger": "user"})
    # Times no double holds: refused as such, not an OverflowError from the checks.
    for when in (10**400, -(10**400), float("inf"), float("nan"), True, "now"):
        with pytest.raises(WireError, match="time must be a finite number"):
            parse_event(
                {
                    "event": "request_started",
                    "session": "s",
                    "trigger": "user",
                    "prompt_tokens": 1,
                    "cached_tokens": 0,
                    "time": when,
                }
            )


def test_an_event_with_raw_keys_parses_as_its_json_form_does() -> None:
    keys = tuple(ChunkKey(bytes([i]) * 16) for i in range(3))
    counts = {"steps": 1, "output_tokens": 2, "context_tokens": 3, "loaded_tokens": 0}
    chained = RequestFinished(
        UNNAMED, **counts, tool_running=False, recomputed_tokens=3, time=12.5,
        namespace=bytes(16), keys=keys,
    )  # fmt: skip
    plain = RequestFinished("s", **counts, tool_running=True, recomputed_tokens=3, time=1.0)
    for event in (chained, plain):
        assert parse_event_bytes(event_to_bytes(event)) == event == parse_event(event.to_json())
    head, _, tail = event_to_bytes(chained).partition(b"\n")
    assert "keys" not in json.loads(head) and tail == b"".join(keys)
    for bad in (
        head,  # no newline, no keys
        head + b"\n" + tail[:-1],  # not a whole number of keys
        b"[]\n" + tail,
        b"{not json\n" + tail,
        json.dumps({**json.loads(head), "keys": []}).encode() + b"\n" + tail,
    ):
        with pytest.raises(WireError):
            parse_event_bytes(bad)


A_START = {
    "event": "request_started",
    "session": "s",
    "trigger": "user",
    "prompt_tokens": 1,
    "cached_tokens": 0,
    "time": 1000.0,
}


def test_a_start_may_say_when_the_session_last_finished_elsewhere() -> None:
    body = {**A_START, "idle_since": 880.0}
    event = parse_event(body)
    assert event.idle_since == 880.0
    assert parse_event(event.to_json()) == event and event.to_json() == body
    assert "idle_since" not in parse_event({**body, "idle_since": None}).to_json()
    too_old = 1000.0 - MAX_IDLE_S - 1
    for bad in (1000.5, too_old, float("nan"), 10**400, True, "yesterday"):
        with pytest.raises(WireError, match="idle_since must"):
            parse_event({**body, "idle_since": bad})


def test_a_start_may_name_the_user_who_drives_the_session() -> None:
    body = {**A_START, "user": "alice"}
    event = parse_event(body)
    assert event.user == "alice"
    assert parse_event(event.to_json()) == event and event.to_json() == body
    assert "user" not in parse_event({**body, "user": None}).to_json()
    for bad in ("", "x" * (MAX_SESSION_CHARS + 1), 7, ["alice"]):
        with pytest.raises(WireError, match="user must be a string of 1 to"):
            parse_event({**body, "user": bad})
    with pytest.raises(WireError, match="unknown field"):  # a start's field, not a finish's
        parse_event(
            {
                "event": "request_finished",
                "session": "s",
                "steps": 1,
                "output_tokens": 1,
                "context_tokens": 2,
                "loaded_tokens": 0,
                "recomputed_tokens": 1,
                "tool_running": False,
                "user": "alice",
            }
        )


def test_events_carry_an_optional_chain_and_may_leave_the_session_to_it() -> None:
    ns = kv.namespace()
    keys = chunk_keys(ns, kv.tokens(3))
    body = {
        "event": "request_started",
        "trigger": "tool",
        "prompt_tokens": 48,
        "cached_tokens": 0,
        "time": 7.0,
        "namespace": ns.digest.hex(),
        "keys": [key.hex() for key in keys],
    }
    event = parse_event(body)
    assert event.session == UNNAMED and event.keys == tuple(keys)
    assert event.namespace == ns.digest
    assert parse_event(event.to_json()) == event and event.to_json() == body
    named = parse_event({**body, "session": "s"})
    assert named.session == "s" and named.to_json()["keys"] == body["keys"]
    for bad, message in (
        ({k: v for k, v in body.items() if k != "keys"}, "namespace and keys come together"),
        ({**body, "keys": []}, "keys must not be empty"),
        ({k: v for k, v in body.items() if k not in ("keys", "namespace")}, "session must be"),
        ({**body, "keys": ["zz"]}, "key must be"),
        ({**body, "session": 5}, "session must be"),
    ):
        with pytest.raises(WireError, match=message):
            parse_event(bad)


# -- predictor ---------------------------------------------------------------------------


def test_the_predictor_is_on_by_default_and_configured_by_file_then_environment(
    tmp_path: Path,
) -> None:
    assert ServiceConfig.load(_write(tmp_path), environ={}).predictor == PredictorConfig()
    path = tmp_path / "kvstore.toml"
    path.write_text(
        f'data_dir = "{tmp_path}"\n[tiers.dram]\ncapacity = "1MiB"\n\n'
        '[predictor]\nhorizons_s = [30, 300]\nweights = "~/model.pt"\ntick_s = 1\n'
    )
    env = {"KVSTORE_PREDICTOR_TICK_S": "2.5", "KVSTORE_PREDICTOR_ENABLED": "off"}
    config = ServiceConfig.load(path, environ=env).predictor
    assert config.horizons_s == (30.0, 300.0) and config.tick_s == 2.5
    assert config.weights == Path("~/model.pt").expanduser() and config.enabled is False


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("horizons_s = [600, 60]", "must be increasing"),
        ("horizons_s = []", "positive numbers"),
        ("horizons_s = 60", "list of seconds"),
        ("tick_s = 0", "positive number"),
        ("enabled = 1", "true or false"),
        ("queue_size = 0", "must be positive"),
        ("decisions_kept = 0", "must be positive"),
        ("decisions_kept = 1.5", "must be an integer"),
        ("guess = 1", "unknown predictor setting"),
        ("weights = 3", "must be a path"),
    ],
)
def test_bad_predictor_settings_are_config_errors(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(f'data_dir = "{tmp_path}"\n[predictor]\n{table}\n')
    with pytest.raises(ConfigError, match=message):
        ServiceConfig.load(path, environ={})

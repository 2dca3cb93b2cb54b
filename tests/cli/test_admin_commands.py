"""The operator's commands against a real daemon, run as an operator runs them: a
``kvstore`` process whose output goes to a pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
from support import kv
from support.daemon import Daemon
from support.http_kv import lookup, make_chain, put, register
from support.predictor_events import OWN_CLOCK, T0, finished, post, processed, started, stats

from kvstore.keys import Namespace
from kvstore.local.redis_server import RedisServer


def kvstore(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )


def answer(daemon: Daemon, *args: str) -> Any:
    """The ``--json`` answer of a command that succeeded."""
    done = kvstore(*args, "--url", daemon.url, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def failed(daemon: Daemon, *args: str, code: int = 1) -> str:
    """The one line a command that failed printed."""
    done = kvstore(*args, "--url", daemon.url)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def put_chain(
    client: httpx.Client, ns: Namespace, n_chunks: int, start: int = 0, session: str | None = None
) -> list[Any]:
    register(client, ns)
    chain = make_chain(ns, n_chunks, start=start)
    assert put(client, chain, session=session) == n_chunks
    return list(chain.keys)


def test_namespaces_evict_and_delete(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory()
    mine, tenant = kv.namespace(salt="ops-mine"), kv.namespace(salt="ops-tenant")
    with daemon.client() as client:
        keys = put_chain(client, mine, 3)
        other = put_chain(client, tenant, 2, start=10_000)

        listed = {row["namespace"]: row for row in answer(daemon, "namespaces")["namespaces"]}
        row = listed[mine.digest.hex()]
        assert row["model"] == mine.model and row["layout"]["chunk_tokens"] == mine.chunk_tokens
        assert row["tiers"]["dram"]["blocks"] == 3 and row["tiers"]["dram"]["bytes"] > 0
        assert listed[tenant.digest.hex()]["tiers"]["dram"]["blocks"] == 2
        assert row["tenant_salt_sha256"] != listed[tenant.digest.hex()]["tenant_salt_sha256"]
        text = kvstore("namespaces", "--url", daemon.url).stdout
        assert mine.digest.hex() in text and "ops-mine" not in text  # the salt is not shown

        evicted = answer(daemon, "evict", "--namespace", mine.digest.hex(), "--tier", "dram")
        assert evicted == {
            "namespace": mine.digest.hex(),
            "tier": "dram",
            "evicted": 3,
            "pinned": 0,
        }
        assert lookup(client, mine, keys)["tiers"] == ["ssd"] * 3  # written back, not lost
        assert lookup(client, tenant, other)["tiers"] == ["dram"] * 2

        done = kvstore("delete", "--namespace", mine.digest.hex(), "--url", daemon.url)
        assert done.returncode == 0 and done.stdout.strip() == "deleted 3 block(s)"
        assert lookup(client, mine, keys)["num_chunks"] == 0
        assert lookup(client, tenant, other)["tiers"] == ["dram"] * 2


def test_mistakes_are_one_line_and_exit_non_zero(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory()
    nobody = "ab" * 16
    assert "holds nothing here" in failed(daemon, "delete", "--namespace", nobody)
    assert "namespace" in failed(daemon, "evict", "--namespace", "not-hex")
    assert "no redis tier is configured" in failed(
        daemon, "evict", "--namespace", nobody, "--tier", "redis"
    )
    done = kvstore("stats", "--url", "localhost:7480")
    assert done.returncode == 2 and "not a daemon URL" in done.stderr
    assert "Traceback" not in done.stderr
    done = kvstore("stats", "--url", f"unix://{daemon.data_dir}/nobody.sock")
    assert done.returncode == 1 and "cannot connect" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_ready_says_which_tier_does_not_answer(
    daemon_factory: Callable[..., Daemon], redis_server_factory: Callable[..., RedisServer]
) -> None:
    server = redis_server_factory()
    daemon = daemon_factory(
        '[tiers.dram]\ncapacity = "16MiB"\n\n'
        f'[tiers.redis]\ncapacity = "16MiB"\nurl = "{server.url}"\n'
        "socket_timeout_s = 0.5\nconnect_timeout_s = 0.5\n"
    )
    done = kvstore("ready", "--url", daemon.url)
    assert (done.returncode, done.stdout.strip()) == (0, "ready")
    server.stop()
    done = kvstore("ready", "--url", daemon.url)
    assert done.returncode == 1
    assert done.stdout.strip() == "not ready (tiers not answering: redis)"
    # A container's health check asks only that the daemon answers: a tier that is
    # down is for readiness, and restarting the daemon would not bring Redis back.
    done = kvstore("ready", "--live", "--url", daemon.url)
    assert (done.returncode, done.stdout.strip()) == (0, "live")


def test_sessions_lists_the_predictors_sessions_and_shows_one(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(daemon=OWN_CLOCK)
    with daemon.client() as client:
        put_chain(client, kv.namespace(salt="ops-sessions"), 2, session="alice")
        post(client, started("alice", T0), finished("alice", T0 + 5), started("bob", T0 + 6))
        stats(client, processed(3))
    listed = answer(daemon, "sessions")
    assert [(s["session"], s["active"]) for s in listed["sessions"]] == [
        ("bob", True),
        ("alice", False),
    ]
    alice = listed["sessions"][1]
    assert len(alice["forecast"]["p_return"]) == len(alice["forecast"]["horizons_s"]) == 3
    text = kvstore("sessions", "--url", daemon.url).stdout
    assert "alice" in text and "idle" in text and "running" in text
    one = kvstore("sessions", "alice", "--url", daemon.url)
    assert one.returncode == 0 and one.stdout.startswith("session alice  idle  requests 1")
    assert "decisions, newest first:" in one.stdout and "place" in one.stdout
    assert "owned, what its placement moves: dram:2 ssd:2" in one.stdout  # copied down too
    assert "no session 'nobody'" in failed(daemon, "sessions", "nobody")


def test_output_cut_short_by_a_closed_pipe_ends_quietly(daemon: Daemon) -> None:
    """``kvstore stats | head -1``: the reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = kvstore("stats", "--url", daemon.url, stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == ""


def test_version_and_help() -> None:
    done = kvstore("--version")
    assert done.returncode == 0 and done.stdout.startswith("kvstore ")
    helped = kvstore("--help")
    assert helped.returncode == 0 and "``" not in helped.stdout
    commands = ("serve", "stats", "ready", "namespaces", "sessions", "evict", "delete", "replay")
    for command in commands:
        assert command in helped.stdout
        own = kvstore(command, "--help")
        assert own.returncode == 0 and "``" not in own.stdout and command in own.stdout


def imported_by(*args: str) -> set[str]:
    """The modules ``kvstore ARGS`` imports (``python -X importtime``)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return {
        line.split("|")[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_the_light_commands_import_neither_torch_nor_the_daemon_nor_the_store(
    tmp_path: Any,
) -> None:
    heavy = {"torch", "aiohttp", "kvstore.store.tiered_store", "kvstore.server.app"}
    config = tmp_path / "kvstore.toml"
    config.write_text(f'data_dir = "{tmp_path}"\n')
    for args in (
        ("--help",),
        ("--version",),
        ("stats", "--url", f"unix://{tmp_path}/none.sock"),
        ("ready", "--config", str(config)),
        ("namespaces", "--url", f"unix://{tmp_path}/none.sock"),
    ):
        modules = imported_by(*args)
        assert "kvstore.cli" in modules, args
        assert not heavy & modules, (args, heavy & modules)

"""The commands that ask a running daemon: ``stats``, ``ready``, ``namespaces``,
``sessions``, ``evict`` and ``delete``, each as text or, with ``--json``, as the
daemon's answer.

They import neither torch nor the store: an operator's ``kvstore stats`` or a
readiness probe in a script must answer in well under a second, and the daemon
does the work (``kvstore.server.admin``).

Exit codes: 0 done (``ready``: ready), 1 the daemon refused or could not be
reached (``ready``: not ready), 2 the command line was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from kvstore.cli.daemon_client import CommandFailed, DaemonClient
from kvstore.cli.tables import duration, human_bytes, score, table
from kvstore.config import TOKEN_VARIABLE
from kvstore.errors import ConfigError

DAEMON_COMMANDS = {
    "stats": "print a running daemon's statistics",
    "ready": "exit 0 if the daemon and every tier answer, 1 if not",
    "namespaces": "list namespaces with their blocks and bytes per tier",
    "sessions": "list the sessions the predictor knows, or show one",
    "evict": "move a namespace's blocks out of one tier, as pressure would",
    "delete": "delete every block of a namespace, from every tier",
}


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of daemon command ``name``."""
    parser.add_argument("--url", help="unix:///path/to/kvstore.sock or http://host:port")
    parser.add_argument("--token", help=f"bearer token for TCP (default: ${TOKEN_VARIABLE})")
    parser.add_argument("--config", help="find the socket from this config file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
    if name == "ready":
        parser.add_argument(
            "--live",
            action="store_true",
            help="only that the daemon answers (/healthz), whatever its tiers: a "
            "container's health check, where a tier that is down is not a reason to restart",
        )
    if name == "sessions":
        parser.add_argument("session", nargs="?", help="one session's id")
        parser.add_argument("--limit", type=int, default=100, help="sessions listed (default 100)")
    if name in ("evict", "delete"):
        parser.add_argument("--namespace", required=True, help="the namespace's hex digest")
    if name == "evict":
        parser.add_argument("--tier", help="hbm, dram, ssd or redis (default: the fastest)")


def run(args: argparse.Namespace) -> int:
    with DaemonClient(_url(args), token=_token(args), timeout_s=args.timeout) as client:
        answer, text = _COMMANDS[args.command](client, args)
    print(json.dumps(answer, indent=2) if args.json else text)
    return 0 if args.command != "ready" or answer.get("ready") else 1


def _url(args: argparse.Namespace) -> str:
    if args.url is not None:
        return str(args.url)
    # Only here: finding the socket means reading the config, which imports the store's.
    from kvstore.server.config import ServiceConfig

    try:
        return f"unix://{ServiceConfig.load(args.config).daemon.socket_path}"
    except ConfigError as error:
        raise CommandFailed(str(error), exit_code=2) from None


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get(TOKEN_VARIABLE)


Answer = tuple[dict[str, Any], str]


def _stats(client: DaemonClient, args: argparse.Namespace) -> Answer:
    from kvstore.cli.daemon_stats import format_stats

    answer = client.get("/v1/stats")
    return answer, format_stats(answer)


def _ready(client: DaemonClient, args: argparse.Namespace) -> Answer:
    if args.live:
        return {"ready": True, **client.get("/healthz")}, "live"
    answer = client.request("GET", "/readyz", ok=(200, 503))
    if answer.get("ready"):
        return answer, "ready"
    degraded = ", ".join(answer.get("degraded", [])) or "none"
    return answer, f"not ready (tiers not answering: {degraded})"


def _namespaces(client: DaemonClient, args: argparse.Namespace) -> Answer:
    answer = client.get("/v1/namespaces")
    rows = [["namespace", "model", "layout", "tenant", "blocks", "bytes", "by tier"]]
    for entry in answer.get("namespaces", []):
        tiers = entry.get("tiers", {})
        layout = entry.get("layout") or {}
        rows.append(
            [
                entry["namespace"],
                entry.get("model") or "(not registered)",
                _layout(layout),
                entry.get("tenant_salt_sha256") or "-",
                str(sum(t["blocks"] for t in tiers.values())),
                human_bytes(sum(t["bytes"] for t in tiers.values())),
                " ".join(f"{tier}:{t['blocks']}" for tier, t in tiers.items()) or "-",
            ]
        )
    text = "\n".join(table(rows)) if len(rows) > 1 else "no namespaces"
    return answer, text


def _layout(layout: dict[str, Any]) -> str:
    if not layout:
        return "-"
    return (
        f"{layout.get('name')} {layout.get('num_layers')}x{layout.get('num_kv_heads')}"
        f"x{layout.get('head_dim')} {layout.get('dtype')} /{layout.get('chunk_tokens')}"
    )


def _sessions(client: DaemonClient, args: argparse.Namespace) -> Answer:
    if args.session is not None:
        answer = client.get(f"/v1/sessions/{quote(args.session, safe='')}")
        return answer, "\n".join(_session_lines(answer))
    answer = client.get("/v1/sessions", params={"limit": str(args.limit)})
    if not answer.get("enabled", True):
        return answer, "the predictor is disabled"
    rows = [["session", "state", "requests", "idle", "P(back) per horizon", "chain"]]
    for entry in answer.get("sessions", []):
        rows.append(
            [
                entry["session"],
                "running" if entry.get("active") else "idle",
                str(entry.get("requests", 0)),
                "-" if entry.get("active") else _idle_for(entry, answer),
                _forecast(entry.get("forecast")),
                _chain(entry.get("chain")),
            ]
        )
    text = "\n".join(table(rows)) if len(rows) > 1 else "no sessions"
    return answer, text


def _session_lines(entry: dict[str, Any]) -> list[str]:
    lines = [
        f"session {entry['session']}  {'running' if entry.get('active') else 'idle'}"
        f"  requests {entry.get('requests', 0)}  gaps {entry.get('gaps', 0)}",
        f"forecast: {_forecast(entry.get('forecast'))}",
        f"chain: {_chain(entry.get('chain'))}",
        f"owned, what its placement moves: {_per_tier(entry.get('owned'))}",
    ]
    decisions = entry.get("decisions") or []
    if decisions:
        rows = [["at", "action", "from", "to", "chunks", "reason"]]
        rows += [
            [
                f"{d['at']:.1f}",
                d["action"],
                d.get("from") or "-",
                d.get("to") or "-",
                str(d.get("chunks", 0)),
                d.get("reason", ""),
            ]
            for d in decisions
        ]
        lines += ["decisions, newest first:", *table(rows)]
    return lines


def _idle_for(entry: dict[str, Any], answer: dict[str, Any]) -> str:
    since, now = entry.get("idle_since"), answer.get("now")
    return "-" if since is None or now is None else duration(max(0.0, now - since))


def _forecast(forecast: dict[str, Any] | None) -> str:
    if not forecast:
        return "-"
    pairs = zip(forecast.get("horizons_s", []), forecast.get("p_return", []), strict=False)
    return " ".join(f"{duration(h)}:{score(p)}" for h, p in pairs)


def _chain(chain: dict[str, Any] | None) -> str:
    if not chain:
        return "-"
    return f"{chain.get('chunks', 0)} chunks ({_per_tier(chain.get('tiers'))})"


def _per_tier(blocks: dict[str, int] | None) -> str:
    return " ".join(f"{tier}:{n}" for tier, n in (blocks or {}).items()) or "none"


def _evict(client: DaemonClient, args: argparse.Namespace) -> Answer:
    body = {} if args.tier is None else {"tier": args.tier}
    answer = client.request("POST", f"/v1/namespaces/{args.namespace}/evict", body=body)
    text = f"evicted {answer['evicted']} block(s) from {answer['tier']}"
    if answer.get("pinned"):
        text += f"; {answer['pinned']} pinned by reads in progress stayed"
    return answer, text


def _delete(client: DaemonClient, args: argparse.Namespace) -> Answer:
    answer = client.request("DELETE", f"/v1/namespaces/{args.namespace}")
    return answer, f"deleted {answer['deleted']} block(s)"


_COMMANDS: dict[str, Callable[[DaemonClient, argparse.Namespace], Answer]] = {
    "stats": _stats,
    "ready": _ready,
    "namespaces": _namespaces,
    "sessions": _sessions,
    "evict": _evict,
    "delete": _delete,
}

"""``kvstore serve``: the tiered store behind HTTP on a Unix socket (and optionally TCP).

The whole daemon, one module per job::

    config.py          DaemonConfig ([daemon] table), ServiceConfig (the whole file)
    run.py             Server: sockets, signals, drain, flush, close
    collector.py       garbage collection: full passes on a timer, startup's heap frozen
    app.py             create_app: middlewares (errors, auth, drain), health, stats, metrics
    state.py           typed app keys and the daemon's mutable state
    routes.py          the /v1 KV routes: namespaces, lookup, get, leases, delete, events
    get_frames.py      a bytes get's frames, sent from where each block lies
    put.py             POST /v1/put: a frames body received, verified whole, stored
    borrowed_body.py   a put's body read off the connection, past aiohttp
    landing.py         a put's blocks received and verified in one place, straight into
                       the store's reservations (or a buffer of their own)
    leases.py          shared-memory leases: pins given back exactly once
    event_log.py       the ring of recent session events
    metrics.py         a Prometheus registry per app; store counters read at scrape time
    admin.py           the operator's routes: namespaces, sessions, evict, delete
    status_page.py     /ui: the status page's three files (ui/), served as they are
    request_log.py     a refused request costs one debug line, never a traceback
    connection.py      which socket a request came in on

The contract is docs/http_api.md; the bytes on the wire are ``kvstore.wire``.
May import: the format, the tiers, the store, the wire and the predictor
(this is the one place that wires the predictor to a store); never the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.server.app import create_app
    from kvstore.server.config import DaemonConfig, ServiceConfig
    from kvstore.server.run import Server

__all__ = ["DaemonConfig", "Server", "ServiceConfig", "create_app"]

# Resolved on first use: ``kvstore stats`` reads the daemon's config to find its
# socket, and must not import aiohttp and the whole daemon to do so.
_HOMES = {
    "create_app": "kvstore.server.app",
    "DaemonConfig": "kvstore.server.config",
    "ServiceConfig": "kvstore.server.config",
    "Server": "kvstore.server.run",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)

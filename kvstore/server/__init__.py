"""``kvstore serve``: the tiered store behind HTTP on a Unix socket (and optionally TCP).

One module per job::

    config.py   DaemonConfig ([daemon] table, KVSTORE_DAEMON_*), ServiceConfig loader
    state.py    typed app keys and the daemon's mutable state
    app.py      create_app: middlewares (errors, auth, drain), health, stats, metrics
    routes.py   the /v1 KV routes: namespaces, lookup, put, get, leases, delete, events
    leases.py   shared-memory leases: pins given back exactly once
    events.py   session events clients report, and the ring that keeps them
    metrics.py  a Prometheus registry per app; store counters read at scrape time
    run.py      Server: sockets, signals, drain, flush, close

The contract is docs/http_api.md; the bytes on the wire are ``kvstore.wire``.
"""

from kvstore.server.app import create_app
from kvstore.server.config import DaemonConfig, ServiceConfig
from kvstore.server.run import Server

__all__ = ["DaemonConfig", "Server", "ServiceConfig", "create_app"]

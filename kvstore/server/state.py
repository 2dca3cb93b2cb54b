"""What a running daemon's application holds, under typed ``web.AppKey`` keys.

::

    app[STORE]    TieredStore     the store; opened and closed by the Server, not the app
    app[SERVING]  SharedServing   what other processes may do with its blocks (shm, landed puts)
    app[LEASES]   LeaseTable      shared-memory leases; its expiry task lives in cleanup_ctx
    app[EVENTS]   EventLog        recent session events, a record for operators and tests
    app[METRICS]  DaemonMetrics   this app's own Prometheus registry
    app[STATE]    DaemonState     config in force, draining flag, counters, addresses
    app[PREDICTOR] PredictorService  the return-time predictor and its placement policy;
                                  absent when ``[predictor] enabled = false``

Handlers and the ``Server`` touch ``DaemonState`` and ``EventLog`` from the
event loop thread only; the store and the lease table are thread safe and
are called from worker threads.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvstore.predictor.service import PredictorService
from kvstore.server.config import DaemonConfig
from kvstore.server.event_log import EventLog
from kvstore.server.leases import LeaseTable
from kvstore.server.metrics import DaemonMetrics
from kvstore.store.shared import SharedServing
from kvstore.store.tiered_store import TieredStore


@dataclass
class DaemonState:
    """Mutable state of one daemon.

    ``config`` is replaced whole when SIGHUP reloads it (only the fields in
    ``config.RELOADABLE`` may differ), so a request sees one consistent
    config. ``draining`` turns every new request but ``/healthz`` into
    ``503 unavailable`` while the ``in_flight`` ones finish. ``put_slots``
    bounds the put bodies buffered at once.
    """

    config: DaemonConfig
    put_slots: asyncio.Semaphore
    started_at: float = field(default_factory=time.monotonic)
    listening: list[str] = field(default_factory=list)
    draining: bool = False
    in_flight: int = 0
    requests_served: int = 0


STORE = web.AppKey("store", TieredStore)
SERVING = web.AppKey("serving", SharedServing)
LEASES = web.AppKey("leases", LeaseTable)
EVENTS = web.AppKey("events", EventLog)
METRICS = web.AppKey("metrics", DaemonMetrics)
STATE = web.AppKey("state", DaemonState)
PREDICTOR = web.AppKey("predictor", PredictorService)

"""The daemon's aiohttp application: state, middlewares, and the operational routes.

``create_app(store, config, predictor)`` builds one ``web.Application``
serving docs/http_api.md. The caller owns the store (the ``Server`` opens it
before and closes it after the app) and makes the predictor before the store,
whose eviction policy it provides; the app owns what lives and dies with it:
the lease table and its expiry task, the predictor's event queue, timer (once
the ``Server`` has loaded its model) and final save (``cleanup_ctx``), the event
ring, the metrics registry.

Every request passes the middlewares outermost first::

    observe ─► errors ─► authenticate ─► drain gate ─► route
    (metrics,   (every     (TCP only:      (503 while
     counted     failure    bearer token,   shutting
     last)       to JSON)   constant time)  down)

so a failure at any stage is a JSON ``{"error": {code, message}}`` with the
status of ``wire.ERRORS``, and is counted by route and status. A bug is a
``500 internal`` whose traceback goes to the daemon's log, never to the
client; a refusal (the client's mistake) is one debug line
(``kvstore.server.request_log``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.predictor.service import PredictorService
from kvstore.server.admin import add_admin_routes
from kvstore.server.borrowed_body import close_borrowed
from kvstore.server.config import DaemonConfig
from kvstore.server.connection import is_local
from kvstore.server.event_log import EventLog
from kvstore.server.leases import LeaseTable
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.request_log import AIOHTTP_LOG, refused
from kvstore.server.routes import add_routes
from kvstore.server.state import (
    EVENTS,
    LEASES,
    METRICS,
    PREDICTOR,
    SERVING,
    STATE,
    STORE,
    DaemonState,
)
from kvstore.server.status_page import PAGE_PATHS, add_status_page
from kvstore.store.shared import SharedServing
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.codes import ERRORS, ErrorCode, WireError, error_body, error_code_of
from kvstore.wire.events import MAX_SESSION_CHARS

log = logging.getLogger("kvstore.server")

# Routes open to anyone who can connect, token or not.
_OPEN_PATHS = frozenset({"/healthz"}) | PAGE_PATHS
# How long /readyz waits for one tier before calling it degraded.
_PROBE_TIMEOUT_S = 5.0
_PROBE_NAMESPACE = bytes(16)
_PROBE_KEY = ChunkKey(bytes(16))
# How many decisions GET /v1/decisions returns by default, and at most.
DECISIONS_DEFAULT = 100
DECISIONS_LIMIT = 1000
# An error response to a body it did not read waits this long for the client
# to stop sending (aiohttp reads and discards the rest meanwhile).
_LINGERING_TIME_S = 2.0


def create_app(
    store: TieredStore, config: DaemonConfig, predictor: PredictorService | None = None
) -> web.Application:
    app = web.Application(
        middlewares=[observe, errors, authenticate, drain_gate],
        client_max_size=config.max_json_bytes,
        handler_args={
            "max_line_size": config.max_line_size,
            "max_field_size": config.max_field_size,
            "max_headers": config.max_headers,
            "lingering_time": _LINGERING_TIME_S,
            # aiohttp's keep-alive timer runs from a connection's start, and from the
            # end of each response, until the next request's headers are complete
            # (trickled bytes do not restart it): exactly a header deadline.
            "keepalive_timeout": config.header_timeout_s,
            "logger": AIOHTTP_LOG,
        },
    )
    serving = store.serving()
    leases = LeaseTable(serving, ttl_s=config.lease_ttl_s, max_leases=config.max_leases)
    app[STORE] = store
    app[SERVING] = serving
    app[LEASES] = leases
    app[EVENTS] = EventLog(config.events_kept)
    app[METRICS] = DaemonMetrics(store, leases, predictor)
    app[STATE] = DaemonState(config, asyncio.Semaphore(config.max_concurrent_puts))
    app.cleanup_ctx.append(expire_leases)
    app.on_response_prepare.append(close_borrowed)
    if predictor is not None:
        app[PREDICTOR] = predictor
        app.cleanup_ctx.append(predictor.lifecycle)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/sessions/{session}", session_info)
    app.router.add_get("/v1/decisions", decisions)
    add_routes(app)
    add_admin_routes(app)
    add_status_page(app)
    return app


def error_response(
    code: ErrorCode,
    message: str,
    *,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(
        error_body(code, message), status=status or ERRORS[code][0], headers=headers
    )


# -- middlewares ---------------------------------------------------------------------


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count the request by route and status, and time it (streaming included)."""
    state = request.app[STATE]
    start = time.perf_counter()
    status = 500
    state.in_flight += 1
    try:
        response = await handler(request)
        status = response.status
        return response
    except (asyncio.CancelledError, ConnectionError):
        status = 499  # the client went away, or the drain deadline passed
        raise
    finally:
        state.in_flight -= 1
        state.requests_served += 1
        resource = request.match_info.route.resource
        # Unmatched paths share one label: a scanner must not grow the registry.
        route = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].observe_request(
            route, request.method, status, time.perf_counter() - start
        )


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into the JSON error of docs/http_api.md."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {
            401: ErrorCode.UNAUTHORIZED,
            404: ErrorCode.NOT_FOUND,
            413: ErrorCode.REQUEST_TOO_LARGE,
        }.get(exc.status, ErrorCode.BAD_REQUEST if exc.status < 500 else ErrorCode.INTERNAL)
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path[:200]}"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _refusal(request, code, message, status=exc.status, headers=headers)
    except KVStoreError as exc:
        code = error_code_of(exc)
        if code is ErrorCode.INTERNAL:
            log.exception("store error serving %s %s", request.method, request.path)
            return error_response(code, "internal error; see the daemon's log")
        return _refusal(request, code, str(exc))
    except web.RequestPayloadError as exc:  # a body aiohttp could not decode (gzip, ...)
        return _refusal(request, ErrorCode.MALFORMED_BODY, f"body could not be read: {exc}")
    except ConnectionError:
        raise  # the client hung up mid-response: nobody to answer
    except Exception:
        log.exception("bug serving %s %s", request.method, request.path)
        return error_response(ErrorCode.INTERNAL, "internal error; see the daemon's log")


def _refusal(
    request: web.Request,
    code: ErrorCode,
    message: str,
    *,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """The error answer to a request refused for what it is (not a bug), and its one
    debug line (``kvstore.server.request_log``)."""
    response = error_response(code, message, status=status, headers=headers)
    refused(f"{request.method} {request.path[:200]}", response.status, message)
    return response


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """TCP requests need ``Authorization: Bearer <token>``; the Unix socket is
    guarded by its file mode instead."""
    if request.path in _OPEN_PATHS or is_local(request):
        return await handler(request)
    token = request.app[STATE].config.auth_token
    scheme, _, supplied = request.headers.get("Authorization", "").partition(" ")
    if (
        not token
        or scheme.lower() != "bearer"
        or not hmac.compare_digest(supplied.strip().encode(), token.encode())
    ):
        return error_response(
            ErrorCode.UNAUTHORIZED,
            "missing or wrong bearer token",
            headers={"WWW-Authenticate": 'Bearer realm="kvstore"'},
        )
    return await handler(request)


@web.middleware
async def drain_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.app[STATE].draining and request.path not in _OPEN_PATHS:
        return error_response(ErrorCode.UNAVAILABLE, "the daemon is shutting down")
    return await handler(request)


# -- background work -----------------------------------------------------------------


async def expire_leases(app: web.Application) -> AsyncIterator[None]:
    """Expire leases while the app runs; give back every pin when it stops."""
    leases = app[LEASES]

    async def run() -> None:
        while True:
            poll = min(1.0, leases.ttl_s / 4)
            due = leases.next_expiry()
            await asyncio.sleep(poll if due is None else min(poll, due))
            if len(leases):
                try:
                    expired = await asyncio.to_thread(leases.expire)
                except KVStoreError:
                    log.exception("expiring leases failed")
                    continue
                if expired:
                    log.debug("%d lease(s) expired", expired)

    task = asyncio.create_task(run(), name="kvstore-lease-expiry")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    released = await asyncio.to_thread(leases.release_all)
    if released:
        log.info("released %d outstanding lease(s)", released)


# -- operational routes --------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    """Ask every tier a cheap question (does it hold a key nobody stores?)."""
    store = request.app[STORE]
    probes = [_probe(store, kind) for kind in store.tier_kinds]
    results = await asyncio.gather(*probes)
    degraded = [kind.label for kind, ok in zip(store.tier_kinds, results, strict=True) if not ok]
    ready = not degraded and not request.app[STATE].draining
    return web.json_response({"ready": ready, "degraded": degraded}, status=200 if ready else 503)


async def _probe(store: TieredStore, kind: TierKind) -> bool:
    tier = store.tier(kind)
    try:
        await asyncio.wait_for(
            asyncio.to_thread(tier.contains_many, _PROBE_NAMESPACE, [_PROBE_KEY]),
            _PROBE_TIMEOUT_S,
        )
    except (KVStoreError, TimeoutError) as error:
        log.warning("tier %s is not ready: %s", kind.label, error)
        return False
    return True


async def stats(request: web.Request) -> web.Response:
    store = request.app[STORE]
    state = request.app[STATE]
    leases = request.app[LEASES]
    snapshot = await asyncio.to_thread(store.stats)
    predictor = request.app.get(PREDICTOR)
    learnt = (
        {"enabled": False} if predictor is None else await asyncio.to_thread(predictor.snapshot)
    )
    return web.json_response(
        {
            "store": snapshot.to_dict(),
            "predictor": learnt,
            "daemon": {
                "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - state.started_at, 3),
                "requests_served": state.requests_served,
                "leases_outstanding": len(leases),
                "leased_blocks": leases.pinned_blocks,
                "events_received": request.app[EVENTS].received,
                "listening": state.listening,
                "shared_memory": request.app[SERVING].shared_memory_name,
                "draining": state.draining,
                **_prefault_stats(request.app[SERVING]),
            },
        }
    )


def _prefault_stats(serving: SharedServing) -> dict[str, Any]:
    """How far the DRAM arena's pages are populated, if they are being populated at
    all: an operator sees why the daemon's memory grows at start."""
    prefault = serving.dram_prefault()
    if prefault is None:
        return {}
    populated, done = prefault
    return {"dram_prefault": {"populated_bytes": populated, "done": done}}


async def session_info(request: web.Request) -> web.Response:
    """What the predictor knows of one session: its forecast, where its chain lies."""
    predictor = request.app.get(PREDICTOR)
    name = request.match_info["session"]
    if predictor is None:
        return error_response(ErrorCode.NOT_FOUND, "the predictor is disabled")
    body = await asyncio.to_thread(predictor.session, name)
    if body is None:
        return error_response(ErrorCode.NOT_FOUND, f"no session {name[:MAX_SESSION_CHARS]!r}")
    return web.json_response(body)


async def decisions(request: web.Request) -> web.Response:
    """The predictor's latest placement decisions, newest first: ``?session=`` only that
    session's; ``?limit=`` how many (``DECISIONS_DEFAULT``; at most ``DECISIONS_LIMIT``)."""
    predictor = request.app.get(PREDICTOR)
    if predictor is None:
        return error_response(ErrorCode.NOT_FOUND, "the predictor is disabled")
    try:
        limit = int(request.query.get("limit", DECISIONS_DEFAULT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= DECISIONS_LIMIT:
        raise WireError(
            ErrorCode.BAD_REQUEST, f"limit must be an integer from 1 to {DECISIONS_LIMIT}"
        )
    body = await asyncio.to_thread(predictor.decisions, request.query.get("session"), limit)
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(generate_latest, request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

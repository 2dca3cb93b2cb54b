"""The operator's routes (docs/http_api.md, "Operating"): what the store holds per
namespace, which sessions it knows, and removing a namespace's blocks.

::

    GET    /v1/namespaces                    every namespace with blocks per tier
    POST   /v1/namespaces/{digest}/evict     {"tier": "dram"}: out of that tier, as
                                             pressure would move them (written back)
    DELETE /v1/namespaces/{digest}           every block of it, from every tier
    GET    /v1/sessions?limit=N              the sessions seen last, with forecasts

``kvstore namespaces``, ``kvstore evict``, ``kvstore delete`` and ``kvstore
sessions`` are their command-line faces (``kvstore.cli``). Each walks the whole
index once under the store's lock, on a worker thread: an operator's question,
not a request path.
"""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web

from kvstore.kinds import TierKind
from kvstore.server.routes import read_json
from kvstore.server.state import PREDICTOR, STORE
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.messages import API_PREFIX, digest_from_hex

MAX_SESSIONS_LISTED = 1000
DEFAULT_SESSIONS_LISTED = 100


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get(f"{API_PREFIX}/namespaces", namespaces)
    app.router.add_post(f"{API_PREFIX}/namespaces/{{digest}}/evict", evict_namespace)
    app.router.add_delete(f"{API_PREFIX}/namespaces/{{digest}}", delete_namespace)
    app.router.add_get(f"{API_PREFIX}/sessions", sessions)


async def namespaces(request: web.Request) -> web.Response:
    usage = await asyncio.to_thread(request.app[STORE].namespace_usage)
    return web.json_response({"namespaces": [row.to_dict() for row in usage]})


async def evict_namespace(request: web.Request) -> web.Response:
    store = request.app[STORE]
    digest = digest_from_hex(request.match_info["digest"])
    body = await read_json(request) if request.can_read_body else {}
    label = body.get("tier")
    if label is None:
        tier = store.tier_kinds[0]
    elif not isinstance(label, str) or (named := TierKind.named(label)) is None:
        raise WireError(ErrorCode.BAD_REQUEST, f"tier must be one of {_labels(store)}")
    else:
        tier = named
    done = await asyncio.to_thread(functools.partial(store.evict_namespace, digest, tier))
    return web.json_response(
        {
            "namespace": digest.hex(),
            "tier": tier.label,
            "evicted": done.evicted,
            "pinned": done.pinned,
        }
    )


async def delete_namespace(request: web.Request) -> web.Response:
    digest = digest_from_hex(request.match_info["digest"])
    deleted = await asyncio.to_thread(request.app[STORE].delete_namespace, digest)
    return web.json_response({"namespace": digest.hex(), "deleted": deleted})


async def sessions(request: web.Request) -> web.Response:
    predictor = request.app.get(PREDICTOR)
    text = request.query.get("limit", str(DEFAULT_SESSIONS_LISTED))
    if not text.isdigit() or not 0 < int(text) <= MAX_SESSIONS_LISTED:
        raise WireError(ErrorCode.BAD_REQUEST, f"limit must be 1 to {MAX_SESSIONS_LISTED}")
    if predictor is None:
        return web.json_response({"enabled": False, "sessions": []})
    listed = await asyncio.to_thread(predictor.sessions, int(text))
    # The predictor's clock (the engines' event times), against which ``idle_since`` reads.
    return web.json_response({"enabled": True, "now": predictor.now(), "sessions": listed})


def _labels(store: TieredStore) -> str:
    return ", ".join(kind.label for kind in store.tier_kinds)

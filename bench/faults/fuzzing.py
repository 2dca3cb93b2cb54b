"""Scenario ``fuzzing``: hostile inputs on every route, header and decoder, and the
canary data still there afterwards (the reliability plan, section 4 item 10).

::

    DaemonSpec (DRAM + LMDB, Unix socket + TCP with a token)
      │
      ├─ canary: three namespaces' chains put with kvstore.connect, bytes recorded
      │
      ├─ HTTP targets, one hypothesis run each (fuzz_inputs: random JSON, edited
      │  valid messages, mutated valid put bodies, garbage), over either
      │  transport, with the right token, a wrong one or none:
      │    namespaces lookup put get leases delete events operational headers(raw)
      │  every answer: a status under 500, an error body as docs/http_api.md
      │  says, a frames body that decodes, no success without the token, an
      │  answer (or a close) within HANG_S; the daemon still running after each
      │
      ├─ in-process targets: FrameDecoder and parse_meta (frame_decoder), and
      │  parse_header / verify_* / stored_block / seal_block / decode_payload
      │  (block_header) fed mutated valid bodies and blocks: only kvstore's own
      │  errors (KVStoreError), each call within fuzz_decoders.CALL_S
      │
      └─ canary read back over both transports, byte for byte

Every failing input is saved under ``workdir/failures/`` (the request as raw
bytes to replay with ``nc -U``, or the decoder's input) beside a JSON note of
what went wrong; the first few are in the report.

Hypothesis drives every target (``fuzz_driver.drive``): each runs in batches,
batch ``i`` seeded from ``(seed, target, i)``, generation only (nothing is
raised into hypothesis, so nothing shrinks), and the scale's clock is checked
between examples. The same seed sends the same inputs.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from faults import fuzz_inputs as fi
from faults.campaign import DaemonSpec, Report, Scale, tcp_settings
from faults.fuzz_decoders import in_process_targets
from faults.fuzz_driver import Findings, Target, drive
from faults.fuzz_http import HANG_S, FuzzedDaemon, HttpCase, Sender
from faults.fuzz_seeds import LAYOUT, frames, fuzz_chain, put_parts, put_seed
from kvstore import connect
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.wire.frames import (
    FRAMES_CONTENT_TYPE,
    META_LENGTH,
)
from kvstore.wire.messages import namespace_to_json

SCENARIO = "fuzzing"
SEED = 10
MUST_BE_ZERO = (
    "http_5xx",
    "unexpected_exceptions",
    "hangs",
    "daemon_crashes",
    "canary_changed",
    "malformed_responses",
    "auth_bypasses",
    "daemon_tracebacks",
    "harness_errors",
)
HTTP_TARGETS = (
    "namespaces",
    "lookup",
    "put",
    "get",
    "leases",
    "delete",
    "events",
    "operational",
    "headers",
)
# An in-process case costs far less than a request: this many for each of a request's.
_IN_PROCESS_FACTOR = 5
# What every fuzz namespace and canary shares: small chunks, so cases stay fast.


def run(scale: Scale, workdir: Path, *, seed: int = SEED) -> Report:
    """Fuzz a daemon's routes and the wire decoders at ``scale``; see the module docstring."""
    started = time.monotonic()
    deadline = scale.until()
    findings = Findings(workdir / "failures")
    spec = DaemonSpec(workdir / "daemon", daemon=tcp_settings())
    per_http_target = scale.requests * scale.cycles
    cases: dict[str, int] = {}
    with FuzzedDaemon(spec) as daemon:
        canaries = [_write_canary(daemon, name, index) for index, name in enumerate("abc")]
        changed_before = sum(_canary_changes(daemon, canary) for canary in canaries)
        if changed_before:
            raise RuntimeError(f"canary data did not read back before fuzzing: {changed_before}")
        targets = _http_targets(daemon, findings) + in_process_targets(findings)
        for index, target in enumerate(targets):
            share = (deadline - time.monotonic()) / (len(targets) - index)
            count = per_http_target * (1 if target.over_http else _IN_PROCESS_FACTOR)
            cases[target.name] = drive(target, count, time.monotonic() + share, seed, findings)
            if target.over_http and not daemon.alive():
                findings.record("daemon_crashes", target.name, daemon.log_tail(), b"")
                daemon.restart()
        canary_changed = sum(_canary_changes(daemon, canary) for canary in canaries)
        log_text = daemon.log_text()
        daemon_tracebacks = log_text.count("Traceback")
        first_traceback = _first_traceback(log_text)
    elapsed = time.monotonic() - started
    figures: dict[str, Any] = {
        "seed": seed,
        "cases": cases,
        "http_requests": sum(findings.statuses.values()),
        "statuses_by_target": {
            name: dict(sorted(statuses.items())) for name, statuses in findings.by_target.items()
        },
        **{kind: findings.counts[kind] for kind in MUST_BE_ZERO},
        "canary_changed": canary_changed,
        "daemon_tracebacks": daemon_tracebacks,
        "first_traceback": first_traceback,
        "statuses": dict(sorted(findings.statuses.items())),
        "elapsed_s": round(elapsed, 2),
        "failures_dir": str(findings.directory),
        "first_failures": findings.first,
    }
    return Report(SCENARIO, figures, MUST_BE_ZERO)


# -- canary data -----------------------------------------------------------------------


@dataclass(frozen=True)
class Canary:
    """A chain put before the fuzzing, and its chunks' exact bytes."""

    namespace: Namespace
    keys: list[ChunkKey]
    chunks: list[bytes]


def _write_canary(daemon: FuzzedDaemon, name: str, index: int) -> Canary:
    """Chain ``name`` of 6 chunks, put over the Unix socket (the last over TCP)."""
    namespace = Namespace("fuzz-canary", LAYOUT, tenant_salt=f"canary-{name}")
    tokens = np.arange(index * 10_000, index * 10_000 + 6 * LAYOUT.chunk_tokens, dtype=np.int64)
    rng = np.random.default_rng(index)
    chunks = [rng.bytes(LAYOUT.chunk_nbytes) for _ in range(6)]
    with _client(daemon, tcp=index == 2) as client:
        stored = client.put(namespace, tokens, chunks)
    if stored != len(chunks):
        raise RuntimeError(f"canary {name}: {stored} of {len(chunks)} chunks stored")
    return Canary(namespace, chunk_keys(namespace, tokens), chunks)


def _canary_changes(daemon: FuzzedDaemon, canary: Canary) -> int:
    """Chunks of ``canary`` that do not read back as written, over each transport
    (the Unix socket's gets use shared memory, TCP's bytes)."""
    changed = 0
    for tcp in (False, True):
        with _client(daemon, tcp=tcp) as client:
            got = client.get(canary.namespace, canary.keys)
        for chunk, expected in zip(got, canary.chunks, strict=True):
            changed += chunk is None or bytes(chunk.payload) != expected
    return changed


@contextlib.contextmanager
def _client(daemon: FuzzedDaemon, *, tcp: bool) -> Iterator[Any]:
    url = daemon.tcp_url if tcp else daemon.spec.url
    with connect(url, token=daemon.token if tcp else None, timeout_s=HANG_S) as client:
        yield client


# -- the fuzz namespace: valid messages to start from ------------------------------------


@dataclass(frozen=True)
class Valid:
    """Valid bodies of every route, over a namespace of the fuzzer's own (never a
    canary's: an edited delete must not be able to hit a canary by chance)."""

    json: dict[str, list[Any]]  # route -> its valid JSON bodies
    puts: list[fi.Seed]  # valid put bodies (one per seal), numbers marked
    put_metas: list[tuple[dict[str, Any], bytes]]  # (metadata, the blocks' bytes)


def _valid(daemon: FuzzedDaemon) -> Valid:
    """Valid bodies of every route, the fuzz chain stored and one of its leases granted."""
    namespace, keys, payloads = fuzz_chain()
    digest, hex_keys = namespace.digest.hex(), [key.hex() for key in keys]
    puts: list[fi.Seed] = []
    put_metas: list[tuple[dict[str, Any], bytes]] = []
    for seal in ("header", "trailer", "daemon"):
        meta, blocks = put_parts(namespace, keys, payloads, seal)
        puts.append(put_seed(meta, blocks))
        put_metas.append((meta, b"".join(blocks)))
    registered = daemon.unix.post("/v1/namespaces", json=namespace_to_json(namespace))
    stored = daemon.unix.post(
        "/v1/put", content=puts[0].data, headers={"Content-Type": FRAMES_CONTENT_TYPE}
    )
    leased = daemon.unix.post(
        "/v1/get", json={"namespace": digest, "keys": hex_keys, "transfer": "shm"}
    )
    if not registered.is_success or not stored.is_success or not leased.is_success:
        raise RuntimeError(f"the fuzz namespace could not be set up: {stored.text}")
    lease = leased.json()["lease"]
    now = time.time()
    chain = {"namespace": digest, "keys": hex_keys}
    started = {
        "event": "request_started",
        "session": "fuzz-session",
        "trigger": "user",
        "prompt_tokens": 64,
        "cached_tokens": 32,
        "time": now,
        **chain,
    }
    finished = {
        "event": "request_finished",
        "session": "fuzz-session",
        "steps": 2,
        "output_tokens": 5,
        "context_tokens": 69,
        "tool_running": False,
        "loaded_tokens": 32,
        "recomputed_tokens": 32,
        "time": now,
    }
    routes: dict[str, list[Any]] = {
        "namespaces": [namespace_to_json(namespace)],
        "lookup": [chain],
        "get": [
            {**chain, "transfer": "bytes", "continues": True},
            {**chain, "transfer": "shm", "release": [lease, "no-such-lease"]},
        ],
        "delete": [{"namespace": digest, "keys": hex_keys[-1:]}],
        "events": [started, finished],
    }
    for body in (started, finished):  # the predictor knows the session, for its route
        daemon.unix.post("/v1/events", json=body)
    return Valid(routes, puts, put_metas)


# -- HTTP targets ------------------------------------------------------------------------


# Transport and credential: mostly a client that may be answered, sometimes one
# that must be refused.
_ACCESS = st.sampled_from(
    [(False, "right")] * 6 + [(True, "right")] * 4 + [(True, "none"), (True, "wrong")]
)
_JSON_TYPES = st.sampled_from(
    ("application/json",) * 6
    + (None, "text/plain", FRAMES_CONTENT_TYPE, "application/json; charset=latin-1", "*/*")
)
_FRAMES_TYPES = st.sampled_from(
    (FRAMES_CONTENT_TYPE,) * 8
    + (
        "application/json",
        None,
        f"{FRAMES_CONTENT_TYPE}; charset=utf-8",
        "APPLICATION/X-KVSTORE-FRAMES",
    )
)


def _http_case(
    method: str, path: str, body: bytes, content_type: str | None, access: tuple[bool, str]
) -> HttpCase:
    return HttpCase(method, path, body, content_type, *access)


def _json_bodies(templates: list[Any]) -> st.SearchStrategy[bytes]:
    template = st.sampled_from(templates)
    return st.one_of(
        template.flatmap(fi.edited).map(fi.dumps),
        template.flatmap(fi.edited).map(fi.dumps),
        template.flatmap(fi.edited).map(fi.dumps),
        fi.json_values().map(fi.dumps),
        template.flatmap(fi.odd_json),
        fi.mutated([fi.Seed(fi.dumps(body)) for body in templates]),
        fi.garbage(),
        template.map(fi.dumps),
    )


def _json_route(path: str, templates: list[Any]) -> st.SearchStrategy[HttpCase]:
    method = st.sampled_from(("POST",) * 15 + ("GET", "PUT"))
    return st.builds(
        _http_case, method, st.just(path), _json_bodies(templates), _JSON_TYPES, _ACCESS
    )


def _put_bodies(valid: Valid) -> st.SearchStrategy[bytes]:
    meta_and_blocks = st.sampled_from(valid.put_metas)
    return st.one_of(
        meta_and_blocks.flatmap(lambda mb: fi.edited(mb[0]).map(lambda meta: frames(meta, mb[1]))),
        meta_and_blocks.flatmap(lambda mb: fi.edited(mb[0]).map(lambda meta: frames(meta, mb[1]))),
        fi.mutated(valid.puts),
        fi.mutated(valid.puts),
        fi.mutated(valid.puts),
        st.builds(
            frames, fi.json_values(), st.sampled_from([b""] + [mb[1] for mb in valid.put_metas])
        ),
        meta_and_blocks.flatmap(
            lambda mb: fi.odd_json(mb[0]).map(lambda raw: META_LENGTH.pack(len(raw)) + raw + mb[1])
        ),
        fi.garbage(),
        st.sampled_from([seed.data for seed in valid.puts]),
    )


def _lease_paths() -> st.SearchStrategy[str]:
    ids = st.one_of(
        st.just("{lease}"),
        st.just("{lease}"),
        st.text(max_size=40),
        st.sampled_from(("0", "-1", "..", "%2F", "a%00b", "x" * 8000, "%ff")),
    )
    return ids.map(lambda lease: f"/v1/leases/{_quoted(lease)}/release")


def _quoted(text: str) -> str:
    """``text`` for a URL path (a ``{lease}`` placeholder and %-escapes kept)."""
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="{}%")


_OPERATIONAL = (
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/stats",
    "/v1/shm",
    "/v1/sessions/fuzz-session",
)
_POSTED = (
    "/v1/namespaces",
    "/v1/lookup",
    "/v1/put",
    "/v1/get",
    "/v1/delete",
    "/v1/events",
    "/v1/leases/x/release",
)


def _operational_paths() -> st.SearchStrategy[str]:
    text = st.one_of(
        st.text(st.characters(exclude_categories=()), max_size=30), st.sampled_from(fi.ODD_TEXT)
    )
    query = st.one_of(st.just(""), text.map(lambda q: "?" + _quoted(q)))
    path = st.one_of(
        st.sampled_from(_OPERATIONAL),
        st.sampled_from(_OPERATIONAL),
        st.sampled_from(_POSTED),
        text.map(lambda name: "/v1/sessions/" + _quoted(name).replace("{", "%7B")),
        text.map(lambda name: "/" + _quoted(name).replace("{", "%7B")),
        st.sampled_from(
            ("/v1/sessions/%ED%A0%80", "/v1/sessions/" + "s" * 300, "/v1/", "/v2/stats")
        ),
    )
    return st.builds(lambda p, q: p + q, path, query)


def _http_targets(daemon: FuzzedDaemon, findings: Findings) -> list[Target]:
    valid = _valid(daemon)
    sender = Sender(daemon, findings)

    def check(target: str) -> Callable[[HttpCase], None]:
        return lambda case: sender.send(target, case)

    json_routes = [
        Target(route, _json_route(f"/v1/{route}", valid.json[route]), check(route))
        for route in ("namespaces", "lookup", "get", "delete", "events")
    ]
    put = st.builds(
        _http_case,
        st.sampled_from(("POST",) * 15 + ("PUT",)),
        st.just("/v1/put"),
        _put_bodies(valid),
        _FRAMES_TYPES,
        _ACCESS,
    )
    leases = st.builds(
        _http_case,
        st.sampled_from(("POST",) * 9 + ("GET",)),
        _lease_paths(),
        st.just(b""),
        st.just(None),
        _ACCESS,
    )
    small_bodies = st.one_of(st.just(b""), fi.garbage(), fi.json_values().map(fi.dumps))
    operational = st.builds(
        _http_case,
        st.one_of(st.just("GET"), st.just("GET"), st.just("GET"), fi.methods),
        _operational_paths(),
        small_bodies,
        _JSON_TYPES,
        _ACCESS,
    )
    raw_paths = [
        f"/v1/{route}" for route in ("namespaces", "lookup", "put", "get", "delete", "events")
    ]
    raw_paths += list(_OPERATIONAL)
    raw_bodies = [fi.dumps(valid.json["lookup"][0]), valid.puts[0].data, b"", b"\x00" * 100]
    right = f"Authorization: Bearer {daemon.token}".encode()
    headers = st.one_of(
        st.tuples(st.just((False, "right")), fi.raw_requests(raw_paths, raw_bodies, b"")),
        st.tuples(st.just((True, "right")), fi.raw_requests(raw_paths, raw_bodies, right)),
        st.tuples(st.just((True, "none")), fi.raw_requests(raw_paths, raw_bodies, b"")),
    )
    return [
        json_routes[0],
        json_routes[1],
        Target("put", put, check("put")),
        json_routes[2],
        Target("leases", leases, check("leases")),
        json_routes[3],
        json_routes[4],
        Target("operational", operational, check("operational")),
        Target("headers", headers, lambda case: sender.send_raw("headers", *case)),
    ]


def _first_traceback(log_text: str, limit: int = 4000) -> str:
    """The daemon's first logged traceback with the line before it (what it was doing),
    or ``""``: the daemon's directory goes with the scenario's, so the report keeps it."""
    at = log_text.find("Traceback")
    if at < 0:
        return ""
    start = log_text.rfind("\n", 0, max(0, at - 1)) + 1
    return log_text[start : start + limit]

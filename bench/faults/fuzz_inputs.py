"""What the fuzzing scenario sends: hypothesis strategies for hostile inputs.

Four families, each aimed at a layer of the daemon::

    json_values      random JSON structures: wrong types, huge, negative and
                     non-finite numbers, unicode (lone surrogates included),
                     very long strings                        -> the routes' checks
    odd_json         JSON texts ``json.dumps`` never writes: nesting past the
                     recursion limit, 1e400, 5000-digit integers, NaN, BOMs,
                     duplicate keys, invalid UTF-8            -> strict_json
    edited(t)        a valid message ``t`` with one to three fields replaced,
                     removed or added                         -> deep in a route
    mutated(seeds)   valid bytes (a put body, a block) with bit flips, numbers
                     overwritten at the offsets where lengths live, truncations,
                     insertions and splices of another seed   -> the decoders

and ``raw_requests``, whole HTTP/1.1 requests as bytes (lying Content-Lengths,
chunked bodies, huge and many headers, odd methods and versions, pipelining)
for aiohttp's parser and the put route's borrowed socket.

Byte-level mutations draw one seed from hypothesis and do the rest with a
``random.Random`` of it: reproducible like any hypothesis draw, and cheap for
mutations that would otherwise exhaust hypothesis's per-example budget.
"""

from __future__ import annotations

import copy
import json
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

# Integers at the edges of every width a parser might store them in.
EDGE_INTS = (
    0,
    1,
    -1,
    255,
    256,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53,
    2**53 + 1,
    -(2**53) - 1,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
)
# The field names of kvstore's messages: a random object uses them often, so its
# values reach the checks of a real field rather than an "unknown field" refusal.
FIELD_NAMES = (
    "namespace",
    "keys",
    "blocks",
    "key",
    "length",
    "session",
    "seal",
    "transfer",
    "release",
    "continues",
    "event",
    "time",
    "trigger",
    "prompt_tokens",
    "cached_tokens",
    "steps",
    "output_tokens",
    "context_tokens",
    "loaded_tokens",
    "recomputed_tokens",
    "tool_running",
    "model",
    "layout",
    "tenant_salt",
    "hash_algo",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "chunk_tokens",
    "name",
    "page_tokens",
)
ODD_TEXT = ("", "\x00", "@", "%", "%00", "\ud800", "\udfff", "\ufeff", "..", "/", "\r\n", "0" * 32)
_LONG_SIZES = (256, 257, 8191, 100_000, 1_000_000)
_REPEATED_BYTES = 6 << 20

_text = st.text(st.characters(exclude_categories=()), max_size=40)


def _long_text() -> st.SearchStrategy[str]:
    return st.builds(
        lambda piece, count: piece * count,
        st.sampled_from(("a", "é", "\U0001f600", "\ud800", "0", "%")),
        st.sampled_from(_LONG_SIZES),
    )


def json_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from(EDGE_INTS),
        st.sampled_from(EDGE_INTS).map(lambda n: -n),
        st.floats(),  # NaN and the infinities included: json.dumps writes them
        _text,
        st.sampled_from(ODD_TEXT),
        _long_text(),
    )


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON-shaped value, a few levels deep, keys mostly kvstore's own."""
    keys = st.one_of(st.sampled_from(FIELD_NAMES), _text)
    return st.recursive(
        json_scalars(),
        lambda children: st.one_of(
            st.lists(children, max_size=6),
            st.dictionaries(keys, children, max_size=6),
        ),
        max_leaves=24,
    )


def dumps(value: Any) -> bytes:
    """``value`` as JSON bytes, NaN and infinities written as Python writes them."""
    return json.dumps(value, allow_nan=True).encode()


def odd_json(template: Any) -> st.SearchStrategy[bytes]:
    """JSON texts (or near-JSON) that ``json.dumps`` cannot produce, around ``template``."""
    valid = json.dumps(template)
    depth = st.sampled_from((10, 999, 1000, 5000, 100_000))
    literals = st.sampled_from(
        (
            "1e400",
            "-1e400",
            "1e-400",
            "-0",
            "9" * 5000,
            "-" + "9" * 400,
            "NaN",
            "-Infinity",
            "0x10",
            "01",
            "1.",
            ".5",
            "true1",
            "nul",
            '"\\ud800"',
            '"\\u0000"',
            '"\\x41"',
        )
    )
    field = st.sampled_from(FIELD_NAMES)
    return st.one_of(
        depth.map(lambda n: b"[" * n + b"]" * n),
        depth.map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        depth.map(lambda n: b"[" * n),  # never closed
        st.builds(lambda f, lit: f'{{"{f}": {lit}}}'.encode(), field, literals),
        st.builds(
            lambda f, lit: (
                (valid[:-1] + f', "{f}": {lit}}}').encode()
                if valid.endswith("}")
                else valid.encode()
            ),
            field,
            literals,
        ),
        st.builds(
            lambda f: (valid[:-1] + f', "{f}": 1, "{f}": "x"}}').encode(), field
        ),  # duplicate keys
        st.just(b"\xef\xbb\xbf" + valid.encode()),  # a BOM
        st.just(valid.encode("utf-16")),
        st.just(valid.encode() + b"garbage"),
        st.just(valid.replace('"', "'").encode()),
        st.just(valid.encode()[: max(1, len(valid) // 2)]),
        st.just(b'{"namespace": "\xff\xfe\xfd"}'),  # not UTF-8
        st.just(b""),
    )


@st.composite
def edited(draw: st.DrawFn, template: Any) -> Any:
    """``template`` with one to three of its fields (at any depth) replaced by a random
    value, removed, or joined by a new one; lists may be repeated past their bounds."""
    value = copy.deepcopy(template)
    actions = draw(st.lists(st.sampled_from(("replace", "replace", "remove", "add")), max_size=3))
    # A repetition comes last: its copies share their elements, so an edit after it
    # would be made in every copy at once.
    if not actions or draw(st.booleans()):
        actions.append("repeat")
    for action in actions:
        paths = _paths(value, ())
        if action == "repeat":
            paths = [path for path in paths if path and isinstance(_at(value, path), list)]
            if not paths:
                break
        value = _edit(draw, value, draw(st.sampled_from(paths)), action)
    return value


def _paths(value: Any, path: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value[:8]):
            found += _paths(child, (*path, index))
    return found


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _edit(draw: st.DrawFn, root: Any, path: tuple[Any, ...], action: str) -> Any:
    if not path:
        return draw(json_values()) if action != "add" else root
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    target = parent[last]
    if action == "remove":
        del parent[last]
    elif action == "add" and isinstance(target, dict):
        target[draw(st.one_of(st.sampled_from(FIELD_NAMES), _text))] = draw(json_values())
    elif action == "add" and isinstance(target, list):
        target.append(draw(json_values()))
    elif action == "repeat" and isinstance(target, list) and target:
        times = draw(st.sampled_from((2, 100, 1025, 5000, 70_000)))
        # Past every count limit, and past max_json_bytes (4 MiB), but not without bound:
        # a repeated list of repeated lists would not fit in memory once written out.
        parent[last] = target * min(times, max(1, _REPEATED_BYTES // len(dumps(target))))
    else:
        parent[last] = draw(json_values())
    return root


# -- bytes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    """Valid bytes to mutate, and the offsets where its numbers live (length
    prefixes, header fields) and how wide each is: mutations aim there often."""

    data: bytes
    numbers: tuple[tuple[int, int], ...] = ()  # (offset, width in bytes)


def mutated(seeds: Sequence[Seed]) -> st.SearchStrategy[bytes]:
    """One of ``seeds`` with one to six random mutations."""
    return st.builds(
        _mutate, st.sampled_from(list(seeds)), st.integers(0, 2**64 - 1), st.just(tuple(seeds))
    )


def _mutate(seed: Seed, rng_seed: int, seeds: tuple[Seed, ...]) -> bytes:
    rng = random.Random(rng_seed)
    data = bytearray(seed.data)
    for _ in range(rng.randint(1, 6)):
        rng.choice(_MUTATIONS)(data, rng, seed, seeds)
    return bytes(data)


def _flip_bit(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    if data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _set_byte(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    if data:
        data[rng.randrange(len(data))] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF))


def _overwrite_number(
    data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]
) -> None:
    """An edge integer written over a known number (or anywhere), little-endian."""
    if seed.numbers and rng.random() < 0.8:
        offset, width = rng.choice(seed.numbers)
    else:
        width = rng.choice((1, 2, 4, 8))
        offset = rng.randrange(max(1, len(data)))
    candidates = [*EDGE_INTS, len(data), len(data) + 1, len(data) - 1, rng.getrandbits(width * 8)]
    value = rng.choice(candidates) % (1 << (width * 8))
    if offset + width <= len(data):
        data[offset : offset + width] = value.to_bytes(width, "little")


def _truncate(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    del data[rng.randrange(len(data) + 1) :]


def _insert(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    at = rng.randrange(len(data) + 1)
    data[at:at] = rng.randbytes(rng.choice((1, 2, 4, 8, 128, 4096)))


def _delete(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    if data:
        start = rng.randrange(len(data))
        del data[start : start + rng.choice((1, 4, 16, 128, 1024))]


def _duplicate(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    if data:
        start = rng.randrange(len(data))
        piece = data[start : start + rng.choice((1, 16, 128, 4096))]
        at = rng.randrange(len(data) + 1)
        data[at:at] = piece * rng.choice((1, 2, 8))


def _splice(data: bytearray, rng: random.Random, seed: Seed, seeds: tuple[Seed, ...]) -> None:
    """This seed's head, another's tail."""
    other = rng.choice(seeds).data
    cut, other_cut = rng.randrange(len(data) + 1), rng.randrange(len(other) + 1)
    data[cut:] = other[other_cut:]


_Mutation = Callable[[bytearray, random.Random, Seed, tuple[Seed, ...]], None]
_MUTATIONS: tuple[_Mutation, ...] = (
    _flip_bit,
    _flip_bit,
    _set_byte,
    _overwrite_number,
    _overwrite_number,
    _overwrite_number,
    _truncate,
    _insert,
    _delete,
    _duplicate,
    _splice,
)


def garbage() -> st.SearchStrategy[bytes]:
    """Random bytes, short or up to a megabyte."""
    return st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda size, rng_seed: random.Random(rng_seed).randbytes(size),
            st.sampled_from((1, 4, 5, 1000, 65_536, 1 << 20)),
            st.integers(0, 2**32),
        ),
    )


# -- raw HTTP requests -----------------------------------------------------------------

_TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
METHODS = ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE")
methods = st.one_of(st.sampled_from(METHODS), st.text(_TOKEN_CHARS, min_size=1, max_size=12))


@st.composite
def raw_requests(
    draw: st.DrawFn, paths: Sequence[str], bodies: Sequence[bytes], auth: bytes
) -> bytes:
    """A request whose line, headers and framing are drawn from what breaks parsers
    (``auth``: the ``Authorization`` line to send, or ``b""``)."""
    method = draw(
        st.one_of(
            st.sampled_from((b"POST", b"GET")),  # mostly the route's own: past the router
            st.sampled_from((b"POST", b"GET")),
            st.sampled_from((b"HEAD", b"get", b"PRI", b"CONNECT", b"P\x00ST", b"A" * 9000)),
            st.text(_TOKEN_CHARS, min_size=1, max_size=12).map(str.encode),
        )
    )
    path = draw(
        st.one_of(
            st.sampled_from(list(paths)).map(str.encode),
            st.sampled_from(
                (
                    b"*",
                    b"http://kvstore/v1/stats",
                    b"/v1/../v1/stats",
                    b"/%2e%2e/v1/stats",
                    b"/v1/stats?" + b"x=1&" * 2000,
                    b"/" + b"a" * 10_000,
                    b"/v1/leases/%00/release",
                    b"/v1/sessions/%ff%fe",
                    b"/v1/sessions/" + b"%ED%A0%80",
                    b"",
                    b"/v1/stats#frag",
                    b"/\xff",
                    b"//v1//stats",
                )
            ),
        )
    )
    version = draw(
        st.sampled_from(
            (b"HTTP/1.1",) * 6
            + (b"HTTP/1.0", b"HTTP/0.9", b"HTTP/2.0", b"HTTP/9.9", b"http/1.1", b"HTTP/1.1 x", b"")
        )
    )
    body = draw(st.sampled_from(list(bodies)))
    framing = draw(st.sampled_from(_FRAMINGS))
    headers, sent = _framed(framing, body, draw)
    headers = [b"Host: kvstore", b"Connection: close", *headers]
    if auth:
        headers.insert(1, auth)
    if draw(st.booleans()):  # half the requests are well formed but for their framing
        headers += draw(st.lists(_odd_header(), min_size=1, max_size=3))
    head = b" ".join(part for part in (method, path, version) if part)
    data = b"\r\n".join([head, *headers]) + b"\r\n\r\n" + sent
    if draw(st.integers(0, 9)) == 0:  # a second request on the same connection
        data += b"GET /healthz HTTP/1.1\r\nHost: kvstore\r\nConnection: close\r\n\r\n"
    if draw(st.integers(0, 9)) == 0:
        data = _mutate(Seed(data), draw(st.integers(0, 2**64 - 1)), (Seed(data),))
    return data


_FRAMINGS = (
    "length",
    "length",
    "length",
    "short-length",
    "long-length",
    "negative-length",
    "garbage-length",
    "padded-length",
    "two-lengths",
    "chunked",
    "chunked-bad-size",
    "chunked-unterminated",
    "chunked-and-length",
    "obfuscated-chunked",
    "unframed",
)


def _framed(framing: str, body: bytes, draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """The framing headers, and the bytes actually sent (not always what they say)."""
    n = len(body)
    if framing == "length":
        return [b"Content-Length: %d" % n], body
    if framing == "short-length":
        return [b"Content-Length: %d" % max(0, n - 1 - n // 2)], body
    if framing == "long-length":
        extra = draw(st.sampled_from((1, 1000, 2**31, 2**63, 10**30)))
        return [b"Content-Length: %d" % (n + extra)], body
    if framing == "negative-length":
        return [b"Content-Length: -%d" % max(1, n)], body
    if framing == "garbage-length":
        value = draw(st.sampled_from((b"abc", b"0x10", b"1e3", b"", b"5 5", b"+%d" % n, b"\xff")))
        return [b"Content-Length: " + value], body
    if framing == "padded-length":
        return [b"Content-Length:   %07d  " % n], body
    if framing == "two-lengths":
        return [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 7)], body
    if framing == "chunked":
        return [b"Transfer-Encoding: chunked"], _chunked(body, draw)
    if framing == "chunked-bad-size":
        size = draw(st.sampled_from((b"zz", b"-1", b"ffffffffffffffffff", b"1;ext=\x00", b"")))
        return [b"Transfer-Encoding: chunked"], size + b"\r\n" + body + b"\r\n0\r\n\r\n"
    if framing == "chunked-unterminated":
        return [b"Transfer-Encoding: chunked"], _chunked(body, draw)[:-5]
    if framing == "chunked-and-length":
        chunked = _chunked(body, draw)
        return [b"Content-Length: %d" % n, b"Transfer-Encoding: chunked"], chunked
    if framing == "obfuscated-chunked":
        value = draw(
            st.sampled_from(
                (
                    b"chunked, identity",
                    b"xchunked",
                    b" chunked",
                    b"CHUNKED",
                    b"chunked\x0b",
                    b"gzip, chunked",
                )
            )
        )
        return [b"Transfer-Encoding: " + value], _chunked(body, draw)
    return [], body  # unframed: the body looks like the next request


def _chunked(body: bytes, draw: st.DrawFn) -> bytes:
    step = draw(st.sampled_from((1, 7, 4096, max(1, len(body)))))
    pieces = [body[i : i + step] for i in range(0, len(body), step)]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def _odd_header() -> st.SearchStrategy[bytes]:
    size = st.sampled_from((100, 8190, 8191, 8200, 20_000, 100_000))
    count = st.sampled_from((10, 63, 64, 65, 200))
    return st.one_of(
        size.map(lambda n: b"X-Big: " + b"a" * n),
        count.map(lambda n: b"\r\n".join(b"X-H%d: v" % i for i in range(n))),
        st.sampled_from(
            (
                b"X-Nul: a\x00b",
                b" folded: continuation",
                b"X-Fold: a\r\n b",
                b"no colon",
                b": empty-name",
                b"X Space: v",
                b"Host: second",
                b"Expect: 100-continue",
                b"Connection: keep-alive",
                b"Connection: Upgrade\r\nUpgrade: websocket",
                b"Content-Type: application/x-kvstore-frames",
                b"Content-Type: \xff",
                b"Authorization: Bearer",
                b"Authorization: Basic Zm9vOmJhcg==",
                b"Content-Encoding: gzip",
                b"X-Latin: \xe9\xe8",
            )
        ),
    )

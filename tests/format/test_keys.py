"""Chunk keys and namespaces: chaining, full chunks only, isolation, stability."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from support import REPO

from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.keys import (
    KEY_BYTES,
    ChunkKey,
    HashAlgo,
    KVLayout,
    Namespace,
    chunk_keys,
    external_keys,
)

CHUNK = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=CHUNK)
NS = Namespace("test-model", LAYOUT)
ALGOS = list(HashAlgo)

# Golden values for GOLDEN_TOKENS under GOLDEN_NS. Keys are persisted in LMDB and
# Redis and shared across processes and hosts: changing these values means the
# key format changed, which silently invalidates every cache already stored.
# Only update them together with a deliberate format change (and a version bump).
GOLDEN_TOKENS = list(range(1000, 1048))  # three full chunks of 16
GOLDEN_DIGEST = {
    HashAlgo.XXH3_128: "ee16bb7aa96a9ed72a9f1a6370da9fbb",
    HashAlgo.SHA256: "e434d860a8bd2e4fce211e4197159ad2",
}
GOLDEN_KEYS = {
    HashAlgo.XXH3_128: [
        "5acddaf8d597c0e891da47281aee5384",
        "4f93c76d839f75b31b43029e02bff8f7",
        "2bc9a79d921c3395ec6a26318f568563",
    ],
    HashAlgo.SHA256: [
        "9ddd7ff955eb0b0716141d2cd7bc493e",
        "f3ed8e6e9c32674ca060171fc4bb2e6e",
        "eefed1b3638a4d22c33688feb6aadf51",
    ],
}
GOLDEN_EXTERNAL = {
    HashAlgo.XXH3_128: [
        "2252ac485ba6c8d44b7a9315bd4bae3c",
        "afe8d29e17ad6726c0f3c7270f754cbd",
        "d297c72dbaa86b40d7ff42e6f5a47935",
    ],
    HashAlgo.SHA256: [
        "bff2642e6a7a8afe211b0291312077a8",
        "cb9fad0ed9f66ccb0bc9bcbdb115357e",
        "b0da36db6b823f7ce61b8c5f4c8d62a4",
    ],
}
GOLDEN_EXTERNAL_INPUT: list[bytes | int] = [0, 2**64 - 1, b"abc"]


def golden_ns(algo: HashAlgo) -> Namespace:
    return Namespace("golden-model", LAYOUT, tenant_salt="tenant-a", hash_algo=algo)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# --- chaining and full chunks ---------------------------------------------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_keys_are_16_byte_chunk_keys(algo: HashAlgo) -> None:
    ns = dataclasses.replace(NS, hash_algo=algo)
    keys = chunk_keys(ns, toks(3 * CHUNK))
    assert len(keys) == 3
    assert all(type(key) is ChunkKey and len(key) == KEY_BYTES for key in keys)
    assert len(set(keys)) == 3
    assert repr(keys[0]) == f"ChunkKey({keys[0].hex()})"


@pytest.mark.parametrize("algo", ALGOS)
def test_changing_chunk_zero_changes_every_key(algo: HashAlgo) -> None:
    ns = dataclasses.replace(NS, hash_algo=algo)
    tokens = toks(4 * CHUNK)
    base = chunk_keys(ns, tokens)
    for position in (0, CHUNK // 2, CHUNK - 1):
        changed = list(tokens)
        changed[position] += 1
        other = chunk_keys(ns, changed)
        assert len(other) == 4
        assert all(a != b for a, b in zip(base, other, strict=True))


@pytest.mark.parametrize("algo", ALGOS)
def test_changing_chunk_two_keeps_earlier_keys(algo: HashAlgo) -> None:
    ns = dataclasses.replace(NS, hash_algo=algo)
    tokens = toks(4 * CHUNK)
    base = chunk_keys(ns, tokens)
    changed = list(tokens)
    changed[2 * CHUNK + 5] = 999_999
    other = chunk_keys(ns, changed)
    assert other[:2] == base[:2]
    assert other[2] != base[2]
    assert other[3] != base[3]


def test_same_chunk_after_a_different_prefix_gets_a_different_key() -> None:
    # Chunk 1 holds identical tokens in both sequences; only chunk 0 differs.
    a = toks(CHUNK, 0) + toks(CHUNK, 500)
    b = toks(CHUNK, 100) + toks(CHUNK, 500)
    assert chunk_keys(NS, a)[1] != chunk_keys(NS, b)[1]


def test_reordering_chunks_changes_keys() -> None:
    a = toks(CHUNK, 0) + toks(CHUNK, 100)
    b = toks(CHUNK, 100) + toks(CHUNK, 0)
    assert set(chunk_keys(NS, a)).isdisjoint(chunk_keys(NS, b))


@pytest.mark.parametrize(
    ("n_tokens", "n_keys"),
    [
        (0, 0),
        (1, 0),
        (CHUNK - 1, 0),
        (CHUNK, 1),
        (CHUNK + 1, 1),
        (2 * CHUNK - 1, 1),
        (2 * CHUNK, 2),
        (2 * CHUNK + 1, 2),
        (5 * CHUNK + 3, 5),
    ],
)
def test_only_full_chunks_are_keyed(n_tokens: int, n_keys: int) -> None:
    tokens = toks(n_tokens, 7)
    keys = chunk_keys(NS, tokens)
    assert len(keys) == n_keys
    # The partial tail never influences the keys of the full chunks.
    assert keys == chunk_keys(NS, tokens[: n_keys * CHUNK])


def test_empty_inputs_give_no_keys() -> None:
    assert chunk_keys(NS, []) == []
    assert chunk_keys(NS, np.array([], dtype=np.int64)) == []


# --- namespace isolation ---------------------------------------------------------------

BASE_LAYOUT = KVLayout(
    num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=16, name="LKTHD"
)
BASE_NS = Namespace("org/model@rev1", BASE_LAYOUT, tenant_salt=None)

LAYOUT_VARIANTS = {
    "num_layers": {"num_layers": 5},
    "num_kv_heads": {"num_kv_heads": 4},
    "head_dim": {"head_dim": 16},
    "dtype": {"dtype": "float16"},
    "dtype_fp8": {"dtype": "float8_e4m3fn"},
    "chunk_tokens": {"chunk_tokens": 8},
    "name": {"name": "vllm-page"},
    "page_tokens": {"page_tokens": 8},
    "page_tokens_other": {"page_tokens": 16},
}

NAMESPACE_VARIANTS = {
    "model": Namespace("org/model@rev2", BASE_LAYOUT),
    "model_case": Namespace("Org/model@rev1", BASE_LAYOUT),
    "salt_empty": Namespace("org/model@rev1", BASE_LAYOUT, tenant_salt=""),
    "salt_x": Namespace("org/model@rev1", BASE_LAYOUT, tenant_salt="x"),
    "salt_null_string": Namespace("org/model@rev1", BASE_LAYOUT, tenant_salt="null"),
    "hash_algo": Namespace("org/model@rev1", BASE_LAYOUT, hash_algo=HashAlgo.SHA256),
    **{
        f"layout_{label}": Namespace("org/model@rev1", dataclasses.replace(BASE_LAYOUT, **change))
        for label, change in LAYOUT_VARIANTS.items()
    },
}


def _keys_for(ns: Namespace) -> list[ChunkKey]:
    # 32 tokens: two chunks at chunk_tokens=16, four at chunk_tokens=8.
    return chunk_keys(ns, toks(32, 3))


@pytest.mark.parametrize("label", sorted(NAMESPACE_VARIANTS))
def test_every_namespace_field_separates_digest_and_keys(label: str) -> None:
    other = NAMESPACE_VARIANTS[label]
    assert other != BASE_NS
    assert other.digest != BASE_NS.digest
    assert set(_keys_for(other)).isdisjoint(_keys_for(BASE_NS))
    assert set(external_keys(other, [1, b"x"])).isdisjoint(external_keys(BASE_NS, [1, b"x"]))


def test_namespace_variants_are_pairwise_distinct() -> None:
    digests = [BASE_NS.digest] + [ns.digest for ns in NAMESPACE_VARIANTS.values()]
    assert len(set(digests)) == len(digests)
    all_keys = [key for ns in [BASE_NS, *NAMESPACE_VARIANTS.values()] for key in _keys_for(ns)]
    assert len(set(all_keys)) == len(all_keys)


def test_tenant_salt_none_empty_and_set_are_three_namespaces() -> None:
    digests = {
        Namespace("m", LAYOUT, tenant_salt=salt).digest for salt in (None, "", "x", "None", " ")
    }
    assert len(digests) == 5


def test_equal_namespaces_give_equal_keys() -> None:
    a = Namespace("m", LAYOUT, tenant_salt="t")
    b = Namespace("m", KVLayout(2, 2, 8, "float16", CHUNK), tenant_salt="t")
    assert a == b
    assert a.digest == b.digest
    assert chunk_keys(a, toks(CHUNK)) == chunk_keys(b, toks(CHUNK))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("org_1", "2345"), ("org_12345", "")),
        (("org_1", "2345"), ("org_12345", None)),
        (("org_12345", ""), ("org_1234", "5")),
        (("a", "bc"), ("ab", "c")),
        (("", "abc"), ("abc", "")),
        (("m", 'x","tenant_salt":"y'), ("m", "x")),
        (('m","tenant_salt":"y', None), ("m", "y")),
        (("lora-a", None), ("base", "lora-a")),
    ],
    ids=lambda pair: repr(pair),
)
@pytest.mark.parametrize("algo", ALGOS)
def test_field_bleed_vectors_do_not_collide(
    left: tuple[str, str | None], right: tuple[str, str | None], algo: HashAlgo
) -> None:
    a = Namespace(left[0], LAYOUT, tenant_salt=left[1], hash_algo=algo)
    b = Namespace(right[0], LAYOUT, tenant_salt=right[1], hash_algo=algo)
    assert a.digest != b.digest
    tokens = toks(3 * CHUNK)
    assert set(chunk_keys(a, tokens)).isdisjoint(chunk_keys(b, tokens))


def test_layout_name_cannot_bleed_into_model() -> None:
    a = Namespace("m", dataclasses.replace(LAYOUT, name="LKTHD"))
    b = Namespace("mLKTHD", dataclasses.replace(LAYOUT, name=""))
    assert a.digest != b.digest


def test_both_algorithms_key_the_same_tokens_differently() -> None:
    xxh = dataclasses.replace(NS, hash_algo=HashAlgo.XXH3_128)
    sha = dataclasses.replace(NS, hash_algo=HashAlgo.SHA256)
    assert set(chunk_keys(xxh, toks(4 * CHUNK))).isdisjoint(chunk_keys(sha, toks(4 * CHUNK)))


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 0},
        {"chunk_tokens": 0},
        {"dtype": "float64"},
        {"dtype": "torch.float16"},
    ],
)
def test_invalid_layouts_raise_config_error(change: dict[str, object]) -> None:
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, **change}
    with pytest.raises(ConfigError):
        KVLayout(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("chunk_tokens", "page_tokens"), [(256, 16), (256, 256), (48, 16), (16, 1)]
)
def test_page_tokens_dividing_chunk_tokens_is_accepted(chunk_tokens: int, page_tokens: int) -> None:
    layout = KVLayout(2, 2, 8, chunk_tokens=chunk_tokens, page_tokens=page_tokens)
    assert layout.page_tokens == page_tokens


@pytest.mark.parametrize(("chunk_tokens", "page_tokens"), [(256, 24), (16, 32), (16, 0), (16, -4)])
def test_page_tokens_must_divide_chunk_tokens(chunk_tokens: int, page_tokens: int) -> None:
    with pytest.raises(ConfigError):
        KVLayout(2, 2, 8, chunk_tokens=chunk_tokens, page_tokens=page_tokens)


def test_layout_sizes() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert layout.chunk_shape == (32, 2, 256, 8, 128)
    assert layout.chunk_nbytes == 32 * 2 * 256 * 8 * 128 * 2
    assert layout.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert LAYOUT.chunk_nbytes == 2 * 2 * CHUNK * 2 * 8 * 2


# --- token input types ------------------------------------------------------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_int_lists_and_integer_arrays_give_identical_keys(algo: HashAlgo) -> None:
    ns = dataclasses.replace(NS, hash_algo=algo)
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + toks(2 * CHUNK + 3 - 5, 40_000)
    expected = chunk_keys(ns, values)
    assert len(expected) == 2
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        if dtype is np.int32:
            # int32 cannot hold ids >= 2**31; compare on a range it can hold.
            small = [v % 2**31 for v in values]
            assert chunk_keys(ns, np.array(small, dtype=dtype)) == chunk_keys(ns, small)
        else:
            assert chunk_keys(ns, np.array(values, dtype=dtype)) == expected
    assert chunk_keys(ns, tuple(values)) == expected
    big_endian = np.array(values, dtype=">u4")
    assert chunk_keys(ns, big_endian) == expected
    strided = np.array(values, dtype=np.uint32).repeat(2)[::2]
    assert not strided.flags.c_contiguous
    assert chunk_keys(ns, strided) == expected


def test_small_integer_dtypes_are_accepted() -> None:
    values = toks(CHUNK, 0)
    expected = chunk_keys(NS, values)
    for dtype in (np.int8, np.uint8, np.int16, np.uint16):
        assert chunk_keys(NS, np.array(values, dtype=dtype)) == expected


@pytest.mark.parametrize(
    "tokens",
    [
        [-1] + toks(CHUNK - 1),
        toks(CHUNK - 1) + [2**32],
        toks(CHUNK - 1) + [2**64],
        np.array([-1] + toks(CHUNK - 1), dtype=np.int32),
        np.array(toks(CHUNK - 1) + [2**32], dtype=np.int64),
        np.array(toks(CHUNK - 1) + [2**63], dtype=np.uint64),
        np.arange(CHUNK, dtype=np.float32),
        np.arange(CHUNK, dtype=np.float64),
        [float(i) for i in range(CHUNK)],
        np.ones(CHUNK, dtype=bool),
        np.arange(2 * CHUNK, dtype=np.int64).reshape(2, CHUNK),
        np.arange(CHUNK, dtype=np.int64).reshape(1, CHUNK),
        np.int64(5),
        ["1"] * CHUNK,
    ],
    ids=lambda value: type(value).__name__,
)
def test_bad_token_ids_raise_layout_mismatch(tokens: object) -> None:
    with pytest.raises(LayoutMismatch):
        chunk_keys(NS, tokens)  # type: ignore[arg-type]


def test_out_of_range_id_in_partial_tail_is_still_rejected() -> None:
    with pytest.raises(LayoutMismatch):
        chunk_keys(NS, toks(CHUNK) + [-5])


# --- external keys ---------------------------------------------------------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_external_keys_are_stable_and_typed(algo: HashAlgo) -> None:
    ns = dataclasses.replace(NS, hash_algo=algo)
    hashes: list[bytes | int] = [0, 1, 255, 256, 2**64 - 1, b"", b"\x00\x00", b"abc"]
    keys = external_keys(ns, hashes)
    assert keys == external_keys(ns, hashes)
    assert all(type(key) is ChunkKey and len(key) == KEY_BYTES for key in keys)
    assert len(set(keys)) == len(keys)
    assert external_keys(ns, []) == []


@pytest.mark.parametrize("algo", ALGOS)
def test_external_int_equals_its_minimal_big_endian_bytes(algo: HashAlgo) -> None:
    ns = dataclasses.replace(NS, hash_algo=algo)
    assert external_keys(ns, [0]) == external_keys(ns, [b"\x00"])
    assert external_keys(ns, [258]) == external_keys(ns, [b"\x01\x02"])
    assert external_keys(ns, [bytearray(b"\x01\x02")]) == external_keys(ns, [b"\x01\x02"])
    assert external_keys(ns, [memoryview(b"\x01\x02")]) == external_keys(ns, [b"\x01\x02"])
    # Leading zero bytes are part of a bytes hash; the length prefix keeps them apart.
    assert external_keys(ns, [b"\x00\x01"]) != external_keys(ns, [1])
    assert external_keys(ns, [b""]) != external_keys(ns, [b"\x00"])


def test_external_keys_are_separated_by_namespace() -> None:
    hashes: list[bytes | int] = [12345, b"engine-hash"]
    seen = {tuple(external_keys(ns, hashes)) for ns in [BASE_NS, *NAMESPACE_VARIANTS.values()]}
    assert len(seen) == 1 + len(NAMESPACE_VARIANTS)


def test_external_keys_never_equal_chunk_keys() -> None:
    tokens = toks(2 * CHUNK)
    keys = chunk_keys(NS, tokens)
    assert set(external_keys(NS, keys)).isdisjoint(keys)


@pytest.mark.parametrize("bad", [-1, 1.5, "abc", None, [1]])
def test_external_keys_reject_bad_hashes(bad: object) -> None:
    with pytest.raises(LayoutMismatch):
        external_keys(NS, [bad])  # type: ignore[list-item]


# --- stability: the documented formula, goldens, and across processes -------------------


def _spec_digest(ns: Namespace) -> bytes:
    """The namespace digest recomputed from the module docstring, independently."""
    canonical = {
        "v": 1,
        "model": ns.model,
        "layout": {
            "name": ns.layout.name,
            "num_layers": ns.layout.num_layers,
            "num_kv_heads": ns.layout.num_kv_heads,
            "head_dim": ns.layout.head_dim,
            "dtype": ns.layout.dtype,
            "chunk_tokens": ns.layout.chunk_tokens,
            "page_tokens": ns.layout.page_tokens,
        },
        "tenant_salt": ns.tenant_salt,
        "hash_algo": ns.hash_algo.value,
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(text).digest()[:16]


def _spec_keys(ns: Namespace, tokens: list[int]) -> list[bytes]:
    """``key[i] = H(key[i-1] || digest || le_uint32(chunk i))``, from the docstring."""
    keys, prev = [], bytes(16)
    for start in range(0, len(tokens) - ns.chunk_tokens + 1, ns.chunk_tokens):
        chunk = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + ns.chunk_tokens])
        material = prev + ns.digest + chunk
        if ns.hash_algo is HashAlgo.XXH3_128:
            prev = xxhash.xxh3_128_digest(material)
        else:
            prev = hashlib.sha256(material).digest()[:16]
        keys.append(prev)
    return keys


@pytest.mark.parametrize("algo", ALGOS)
def test_keys_follow_the_documented_formula(algo: HashAlgo) -> None:
    ns = golden_ns(algo)
    assert ns.digest == _spec_digest(ns)
    tokens = GOLDEN_TOKENS + [7, 8, 9]
    assert chunk_keys(ns, tokens) == _spec_keys(ns, tokens)


@pytest.mark.parametrize("algo", ALGOS)
def test_golden_values(algo: HashAlgo) -> None:
    # Changing a golden value invalidates every cache already stored (see GOLDEN_KEYS).
    ns = golden_ns(algo)
    assert ns.digest.hex() == GOLDEN_DIGEST[algo]
    assert [key.hex() for key in chunk_keys(ns, GOLDEN_TOKENS)] == GOLDEN_KEYS[algo]
    external = external_keys(ns, GOLDEN_EXTERNAL_INPUT)
    assert [key.hex() for key in external] == GOLDEN_EXTERNAL[algo]


_SUBPROCESS_SCRIPT = """
from kvstore.keys import HashAlgo, KVLayout, Namespace, chunk_keys, external_keys
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
for algo in HashAlgo:
    ns = Namespace("golden-model", layout, tenant_salt="tenant-a", hash_algo=algo)
    print(algo.value, ns.digest.hex())
    print(" ".join(k.hex() for k in chunk_keys(ns, list(range(1000, 1048)))))
    print(" ".join(k.hex() for k in external_keys(ns, [0, 2**64 - 1, b"abc"])))
"""


def test_keys_are_identical_across_processes_and_hash_seeds() -> None:
    repo = REPO
    # Two interpreters at once (each imports torch through the package), with
    # different str-hash seeds: a key must not depend on Python's hash().
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _SUBPROCESS_SCRIPT],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "4242")
    ]
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        outputs.append(stdout)
    assert outputs[0] == outputs[1]
    expected = []
    for algo in HashAlgo:
        expected.append(f"{algo.value} {GOLDEN_DIGEST[algo]}")
        expected.append(" ".join(GOLDEN_KEYS[algo]))
        expected.append(" ".join(GOLDEN_EXTERNAL[algo]))
    assert outputs[0].splitlines() == expected


# --- properties ------------------------------------------------------------------------

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=8 * 8)

NS_PAIRS: dict[str, tuple[Any, Any]] = {
    "model": ("m", "m2"),
    "salt": (None, ""),
    "salt_value": ("a", "b"),
    "algo": (HashAlgo.XXH3_128, HashAlgo.SHA256),
    "dtype": ("float16", "bfloat16"),
    "num_layers": (2, 3),
    "num_kv_heads": (2, 1),
    "head_dim": (8, 4),
    "chunk_tokens": (8, 4),
    "name": ("LKTHD", "LTKHD"),
    "page_tokens": (None, 4),
}
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=8)


def _pair(field: str) -> tuple[Namespace, Namespace]:
    """Two namespaces equal but for ``field``; the first always has ``SMALL``'s layout."""

    def make(value: Any) -> Namespace:
        if field == "model":
            return Namespace(value, SMALL)
        if field.startswith("salt"):
            return Namespace("m", SMALL, tenant_salt=value)
        if field == "algo":
            return Namespace("m", SMALL, hash_algo=value)
        return Namespace("m", dataclasses.replace(SMALL, **{field: value}))

    first, second = NS_PAIRS[field]
    return make(first), make(second)


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(sorted(NS_PAIRS)),
    tokens_a=token_lists,
    tokens_b=token_lists,
)
def test_property_no_key_collides_across_namespaces(
    field: str, tokens_a: list[int], tokens_b: list[int]
) -> None:
    ns_a, ns_b = _pair(field)
    keys_a = chunk_keys(ns_a, tokens_a)
    keys_b = chunk_keys(ns_b, tokens_b)
    assert set(keys_a).isdisjoint(keys_b)
    # Within one namespace, keys are equal exactly where the token prefixes are equal.
    same_ns_b = chunk_keys(ns_a, tokens_b)
    for i, (key_a, key_b) in enumerate(zip(keys_a, same_ns_b, strict=False)):
        prefix_equal = tokens_a[: (i + 1) * 8] == tokens_b[: (i + 1) * 8]
        assert (key_a == key_b) == prefix_equal


@settings(max_examples=150, deadline=None)
@given(tokens=token_lists, cut=st.integers(min_value=0, max_value=8 * 8))
def test_property_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], cut: int) -> None:
    ns = Namespace("m", SMALL)
    keys = chunk_keys(ns, tokens)
    prefix_keys = chunk_keys(ns, tokens[:cut])
    assert len(keys) == len(tokens) // 8
    assert len(prefix_keys) == min(cut, len(tokens)) // 8
    assert keys[: len(prefix_keys)] == prefix_keys
    assert len(set(keys)) == len(keys)

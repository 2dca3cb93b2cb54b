"""The page format and block plans both connector sides share (no vLLM needed)."""

from __future__ import annotations

import hashlib

import pytest

from kvstore.client.vllm.pages import BlockTransfer, PageFormat
from kvstore.errors import ConfigError
from kvstore.keys import HashAlgo


def pages(**changes: object) -> PageFormat:
    fields: dict[str, object] = {
        "model": "/models/tiny@main",
        "layer_names": ("layers.0.attn", "layers.1.attn", "layers.2.attn"),
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": "bfloat16",
        "block_size": 32,
    }
    return PageFormat(**{**fields, **changes})  # type: ignore[arg-type]


def test_a_chunk_is_one_page_of_every_layer() -> None:
    fmt = pages()
    assert fmt.page_bytes == 2 * 32 * 2 * 64 * 2  # heads x tokens x (K|V) x head x bf16
    assert fmt.layout.chunk_nbytes == fmt.block_bytes == fmt.num_layers * fmt.page_bytes
    assert fmt.layout.name == "vllm-page"
    assert fmt.namespace(None).hash_algo is HashAlgo.SHA256


def test_an_mla_page_is_one_latent_a_token_and_a_namespace_of_its_own() -> None:
    mla = pages(num_kv_heads=1, head_size=576, head_size_v=0)  # DeepSeek-V2: 512 + 64
    assert mla.page_bytes == 32 * 576 * 2  # tokens x latent x bf16, no V
    assert mla.layout.chunk_nbytes == mla.block_bytes
    assert mla.layout.name == "vllm-page:k576v0"
    # The same bytes a page as a model with K and V of 288: never the same keys.
    hashes = [hashlib.sha256(b"x").digest()]
    twin = pages(num_kv_heads=1, head_size=288, model=mla.model)
    assert twin.block_bytes == mla.block_bytes and twin.keys(None, hashes) != mla.keys(None, hashes)
    with pytest.raises(ConfigError, match="odd width"):
        pages(num_kv_heads=1, head_size=577, head_size_v=0)


def test_salt_rank_and_shape_each_change_every_key() -> None:
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    base = pages().keys(None, hashes)
    others = [
        pages().keys("tenant-a", hashes),
        pages(tp_rank=1, tp_size=2).keys(None, hashes),
        pages(block_size=64).keys(None, hashes),
        pages(dtype="float32").keys(None, hashes),
        pages(model="/models/other@main").keys(None, hashes),
    ]
    for keys in others:
        assert not set(keys) & set(base)
    assert pages().keys(None, hashes) == base  # a pure function of its inputs


def test_bad_formats_and_plans_are_refused() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        pages(dtype="int4")
    with pytest.raises(ConfigError, match="block ids"):
        BlockTransfer("req", None, 1, (b"b", b"c"), block_ids=(7,))
    with pytest.raises(ConfigError, match="block ids"):
        BlockTransfer("req", None, -1, (b"b",), block_ids=(7,))
    assert BlockTransfer("req", None, 1, (b"b",), block_ids=(7,), parent=b"a").first == 1

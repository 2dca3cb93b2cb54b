"""Which models share chunks (none), what is refused, and the block layout round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import hf_models
from support.hf_models import CHUNK

from kvstore import ConfigError, LayoutMismatch
from kvstore.client.buffers import BufferPool
from kvstore.client.hf import HFKVStore
from kvstore.client.hf.packing import (
    HF_LAYOUT,
    block_shape,
    cache_tensors,
    model_namespace,
    pack_chunks,
    staging_buffer,
    unpack,
)


def warm(kv: HFKVStore, ids: torch.Tensor) -> int:
    """Prefill and save ``ids``; return how many tokens the prefill loaded."""
    result = kv.prefill(ids)
    kv.save(ids, result.cache)
    return result.report.loaded_tokens


def test_namespace_binds_architecture_config_weights_dtype_chunk_and_salt() -> None:
    llama = hf_models.model("llama", seed=0)
    digests = {
        model_namespace(llama, chunk_tokens=CHUNK).digest,
        model_namespace(llama, chunk_tokens=2 * CHUNK).digest,
        model_namespace(llama, chunk_tokens=CHUNK, tenant_salt="a").digest,
        model_namespace(llama, chunk_tokens=CHUNK, tenant_salt="b").digest,
        model_namespace(hf_models.model("llama", seed=1), chunk_tokens=CHUNK).digest,
        model_namespace(hf_models.model("qwen2"), chunk_tokens=CHUNK).digest,
        model_namespace(hf_models.model("llama").to(torch.bfloat16), chunk_tokens=CHUNK).digest,
    }
    assert len(digests) == 7
    # ...and is a pure function of them: the same model built twice agrees.
    again = model_namespace(hf_models.model("llama", seed=0), chunk_tokens=CHUNK)
    assert again == model_namespace(llama, chunk_tokens=CHUNK)
    layout = again.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 2, 16)
    assert (layout.dtype, layout.chunk_tokens) == ("float32", CHUNK)


def test_two_models_never_share_chunks(tmp_path: Path) -> None:
    ids = hf_models.prompt(3 * CHUNK + 4)
    with hf_models.embedded(tmp_path) as client:
        first = HFKVStore(hf_models.model("llama", seed=0), client, chunk_tokens=CHUNK)
        assert warm(first, ids) == 0
        assert warm(first, ids) == 3 * CHUNK
        # Same config, other weights; then another architecture of the same shape.
        for other in (hf_models.model("llama", seed=1), hf_models.model("qwen2")):
            kv = HFKVStore(other, client, chunk_tokens=CHUNK)
            assert warm(kv, ids) == 0
            # Its own KV, loaded, against one forward of the whole prompt: equal to the
            # last float32 ulps (attention over 48 loaded + 4 new tokens sums in another
            # order than over 52 at once); another model's chunks would be off by ~0.1.
            torch.testing.assert_close(
                kv.prefill(ids).logits,
                hf_models.full_logits(other, ids)[:, 48:],
                rtol=0,
                atol=1e-6,
            )


def test_two_tenant_salts_never_share_chunks(tmp_path: Path) -> None:
    model = hf_models.model("llama")
    ids = hf_models.prompt(2 * CHUNK + 4)
    with hf_models.embedded(tmp_path) as client:
        alice = HFKVStore(model, client, chunk_tokens=CHUNK, tenant_salt="alice")
        bob = HFKVStore(model, client, chunk_tokens=CHUNK, tenant_salt="bob")
        assert warm(alice, ids) == 0
        assert warm(bob, ids) == 0
        assert warm(alice, ids) == 2 * CHUNK
        assert warm(bob, ids) == 2 * CHUNK


def test_unsupported_models_and_inputs_are_refused_clearly(tmp_path: Path) -> None:
    with hf_models.embedded(tmp_path) as client:
        chunked = hf_models.model("llama")
        chunked.config.attention_chunk_size = 8
        with pytest.raises(ConfigError, match="chunked attention"):
            HFKVStore(chunked, client, chunk_tokens=CHUNK)
        linear = hf_models.model("llama")
        linear.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
        with pytest.raises(ConfigError, match="linear_attention"):
            HFKVStore(linear, client, chunk_tokens=CHUNK)

        kv = HFKVStore(hf_models.model("llama"), client, chunk_tokens=CHUNK)
        with pytest.raises(LayoutMismatch, match="one sequence"):
            kv.generate(hf_models.prompt(20).repeat(2, 1), max_new_tokens=2)
        with pytest.raises(LayoutMismatch, match="empty"):
            kv.prefill(torch.zeros((1, 0), dtype=torch.long))
        assert client.stats().chunks_stored == 0  # nothing was stored on the way


def test_block_payload_round_trips_every_layer_and_head() -> None:
    model = hf_models.model("llama")
    layout = model_namespace(model, chunk_tokens=4).layout
    generator = torch.Generator().manual_seed(3)
    shape = (1, layout.num_kv_heads, 3 * 4 + 2, layout.head_dim)
    layers = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(layout.num_layers)
    ]
    chunks = pack_chunks(layers, layout, 1, 3)
    assert [chunk.nbytes for chunk in chunks] == [layout.chunk_nbytes] * 2
    assert layout.name == HF_LAYOUT == "LKHTD"
    # LKHTD: chunk[layer, k|v, head, token] is the cache's [0, head, chunk*T + token].
    as_blocks = [torch.from_numpy(c).view(torch.float32).view(block_shape(layout)) for c in chunks]
    assert torch.equal(as_blocks[1][2, 1, 1, 3], layers[2][1][0, 1, 2 * 4 + 3])
    staged = staging_buffer(layout, 2, pool=BufferPool(1 << 20))
    for row, block in zip(staged, as_blocks, strict=True):
        row.copy_(block)
    for seq in (8, 7, 4, 3):  # whole chunks, and cut inside the first and the second
        block = cache_tensors(layout, seq, torch.device("cpu"), BufferPool(1 << 20))
        unpack(staged, block)
        one_layer = cache_tensors(layout, seq, torch.device("cpu"))
        unpack(staged, one_layer, slice(1, 2))
        assert torch.equal(one_layer[1], block[1])
        for index, (keys, values) in enumerate(layers):
            assert block[index, 0].is_contiguous()
            assert torch.equal(block[index, 0], keys[:, :, 4 : 4 + seq])
            assert torch.equal(block[index, 1], values[:, :, 4 : 4 + seq])
    with pytest.raises(LayoutMismatch, match="shape"):
        pack_chunks([(k[:, :1], v[:, :1]) for k, v in layers], layout, 0, 1)

"""Reload instead of recompute with real transformers models: same logits, same tokens.

Exactness, and where it stops: the loaded KV is always bit-identical to a
full recompute's (asserted). The logits of the uncached suffix are then
bit-identical too whenever the suffix is a multiple of 4 tokens; for other
lengths MKL's GEMM blocks rows differently, so ``x[:m] @ W`` differs from
``(x @ W)[:m]`` in the last bit for *any* two forwards of different lengths,
kvstore or not. Those cases assert tight closeness and identical greedy tokens.

On a CUDA device in bfloat16 (the GPU check runs it) the loaded KV is still
bit-identical, but cuBLAS and SDPA pick kernels by shape, so the suffix's
forward over a cache may round differently from the full forward's rows: the
logits are asserted within 4 bfloat16 steps of the largest logit (these models'
logits stay under 1, where a step is at most 2**-8), far below what a wrong or
shifted block moves them, and the greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import hf_models
from support.hf_models import CHUNK
from transformers import DynamicCache

from kvstore.client.hf import HFKVStore
from kvstore.client.hf.loading import load_cache


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("arch", sorted(hf_models.ARCHITECTURES))
def test_reloaded_prefix_gives_bit_identical_kv_and_logits(arch: str, tmp_path: Path) -> None:
    model = hf_models.model(arch)
    ids = hf_models.prompt(3 * CHUNK + 8)
    expected = hf_models.full_logits(model, ids)
    with hf_models.embedded(tmp_path) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        first = kv.prefill(ids)
        assert first.report.loaded_tokens == 0
        assert torch.equal(first.logits, expected)
        assert kv.save(ids, first.cache) == 3

        for layerwise in (False, True):
            again = kv.prefill(ids, layerwise=layerwise)
            assert again.report.loaded_tokens == 3 * CHUNK
            assert again.report.recomputed_tokens == 8
            assert again.report.layerwise is layerwise
            assert torch.equal(again.logits, expected[:, 3 * CHUNK :])
            for loaded, computed in zip(again.cache.layers, first.cache.layers, strict=True):
                assert torch.equal(loaded.keys, computed.keys)
                assert torch.equal(loaded.values, computed.values)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", sorted(hf_models.ARCHITECTURES))
def test_on_cuda_in_bf16_a_reload_gives_the_recomputed_kv_logits_and_tokens(
    arch: str, tmp_path: Path
) -> None:
    model = hf_models.model(arch).to("cuda", torch.bfloat16)
    ids = hf_models.prompt(3 * CHUNK + 8).to("cuda")
    expected = hf_models.full_logits(model, ids)
    reference = hf_models.greedy(model, ids, 8)
    with hf_models.embedded(tmp_path) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        first = kv.prefill(ids)
        assert kv.save(ids, first.cache) == 3
        for layerwise in (False, True):
            again = kv.prefill(ids, layerwise=layerwise)
            assert again.report.loaded_tokens == 3 * CHUNK
            assert again.logits.device.type == "cuda" and again.logits.dtype == torch.bfloat16
            for loaded, computed in zip(again.cache.layers, first.cache.layers, strict=True):
                assert torch.equal(loaded.keys[:, :, : 3 * CHUNK], computed.keys[:, :, : 3 * CHUNK])
                assert torch.equal(
                    loaded.values[:, :, : 3 * CHUNK], computed.values[:, :, : 3 * CHUNK]
                )
            bf16_close(again.logits, expected[:, 3 * CHUNK :])
            generated = kv.generate(ids, max_new_tokens=8, do_sample=False, layerwise=layerwise)
            assert torch.equal(generated.sequences, reference)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generate_matches_plain_generate_and_saves_prompt_and_output(
    arch: str, tmp_path: Path
) -> None:
    model = hf_models.model(arch)
    ids = hf_models.prompt(2 * CHUNK + 5)
    reference = hf_models.greedy(model, ids, 20)
    with hf_models.embedded(tmp_path) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        cold = kv.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(cold.sequences, reference)
        # 37 prompt + 20 output tokens; the cache holds 56 of them: 3 full chunks.
        assert (cold.report.saved_chunks, cold.report.output_tokens) == (3, 20)
        warm = kv.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(warm.sequences, reference)
        assert (warm.report.loaded_tokens, warm.report.recomputed_tokens) == (2 * CHUNK, 5)
        assert warm.report.saved_chunks == 0  # everything it computed was already stored
        layerwise = kv.generate(ids, max_new_tokens=20, do_sample=False, layerwise=True)
        assert torch.equal(layerwise.sequences, reference)
        assert layerwise.report.loaded_tokens == 2 * CHUNK


@pytest.mark.parametrize(
    ("length", "loaded"),
    [
        (CHUNK - 6, 0),  # shorter than a chunk: nothing to key
        # Exactly on a boundary: both chunks load, and the last token is dropped from
        # the cache to be computed (the model needs its logits).
        (2 * CHUNK, 2 * CHUNK - 1),
        (2 * CHUNK + 1, 2 * CHUNK),  # one past: all full chunks load, one token computed
    ],
)
def test_chunk_boundaries(length: int, loaded: int, tmp_path: Path) -> None:
    model = hf_models.model("llama")
    ids = hf_models.prompt(length)
    expected = hf_models.full_logits(model, ids)
    reference = hf_models.greedy(model, ids, 6)
    with hf_models.embedded(tmp_path) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        first = kv.prefill(ids)
        kv.save(ids, first.cache)
        for layerwise in (False, True):
            again = kv.prefill(ids, layerwise=layerwise)
            assert again.report.loaded_tokens == loaded
            assert again.report.recomputed_tokens == length - loaded >= 1
            close(again.logits, expected[:, loaded:])
            generated = kv.generate(ids, max_new_tokens=6, do_sample=False, layerwise=layerwise)
            assert torch.equal(generated.sequences, reference)
            assert generated.report.loaded_tokens == loaded


def test_multi_turn_conversation_reuses_the_growing_prefix(tmp_path: Path) -> None:
    model = hf_models.model("qwen2")
    conversation = hf_models.prompt(CHUNK + 9, seed=10)
    expected_loaded = [0]
    with hf_models.embedded(tmp_path) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        for turn in range(4):
            reference = hf_models.greedy(model, conversation, 10)
            result = kv.generate(
                conversation, max_new_tokens=10, do_sample=False, layerwise=turn % 2 == 1
            )
            assert torch.equal(result.sequences, reference)
            assert result.report.loaded_tokens == expected_loaded[-1]
            # The next turn can load every full chunk this one's cache held, the
            # generated tokens included (their KV is the decode's, stored as computed).
            held = result.sequences.shape[1] - 1
            expected_loaded.append(held // CHUNK * CHUNK)
            user = hf_models.prompt(7 + turn, seed=20 + turn)
            conversation = torch.cat([result.sequences, user], dim=1)
    assert expected_loaded[1:] == sorted(expected_loaded[1:]) and expected_loaded[-1] >= 4 * CHUNK


def test_loads_reuse_pooled_memory_but_never_that_of_a_live_cache(tmp_path: Path) -> None:
    model = hf_models.model("llama")
    ids = hf_models.prompt(3 * CHUNK + 4)
    cpu, limit = torch.device("cpu"), ids.shape[1] - 1
    with hf_models.embedded(tmp_path) as client:
        kv = HFKVStore(model, client, chunk_tokens=CHUNK)
        computed = kv.prefill(ids).cache
        kv.save(ids, computed)
        keys = kv.plan(ids)
        run_bytes = len(keys) * kv.namespace.layout.chunk_nbytes  # staging, and the cache block

        def load() -> DynamicCache:
            cache, good, _ = load_cache(client, kv.namespace, keys, cpu, limit, kv.buffers)
            assert good == len(keys)
            for loaded, expected in zip(cache.layers, computed.layers, strict=True):
                assert torch.equal(loaded.keys, expected.keys[:, :, : 3 * CHUNK])
                assert torch.equal(loaded.values, expected.values[:, :, : 3 * CHUNK])
            return cache

        first = load()
        assert kv.buffers.held_bytes == run_bytes  # the staging buffer came back
        second = load()  # reuses that staging buffer; its cache is new memory
        assert kv.buffers.held_bytes == run_bytes
        first_pointer = first.layers[0].keys.data_ptr()
        assert second.layers[0].keys.data_ptr() != first_pointer
        del first  # a finished request: its cache's memory goes back to the pool
        assert kv.buffers.held_bytes == 2 * run_bytes
        third = load()
        assert kv.buffers.held_bytes == run_bytes  # both its buffers came from the pool
        assert third.layers[0].keys.data_ptr() != second.layers[0].keys.data_ptr()
        for again, other in zip(second.layers, third.layers, strict=True):
            assert torch.equal(again.keys, other.keys)

"""vLLM's CPU build over a real daemon, as the connector's end-to-end tests run it.

A random two-layer Llama saved with ``save_pretrained`` (``save_model``), an
offline ``LLM`` with ``KVStoreConnector`` (``start_llm``, stopped by
``stop_llm``), greedy generation that says where vLLM's prefill started
(``generate``), the daemon's keys of a prompt computed outside the engine
(``vllm_keys``), and the daemon's counters once the worker's saves, put by a
thread of its own after a request returns, have landed (``stats_once_stored``).

Imports vLLM: only the modules that ``importorskip("vllm")`` import this.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

import kvstore
from kvstore.client.vllm.pages import PageFormat
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.store.stats import StoreStats
from support.daemon import Daemon
from support.lmdb_blocks import damage_block

BLOCK = 32  # the CPU backend needs a multiple of 32
PROMPT_TOKENS = 100  # three full blocks and a partial one
FULL_BLOCKS = PROMPT_TOKENS // BLOCK
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def save_model(path: Path, **config: Any) -> Path:
    """A random-weight Llama (two layers, one KV head of 64; ``config`` changes or adds
    fields of its ``LlamaConfig``) saved at ``path``."""
    fields: dict[str, Any] = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 256,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**fields, **config})).save_pretrained(path)
    return path


def start_llm(
    model_dir: Path,
    extra_config: dict[str, Any],
    *,
    block_size: int = BLOCK,
    **engine: Any,
) -> Any:
    """An offline ``LLM`` on the CPU build with the connector and ``extra_config``."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the workers inherit it
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=block_size,
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.client.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra_config,
        ),
        **engine,
    )


def stop_llm(engine: Any) -> None:
    core = engine.llm_engine.engine_core
    core.shutdown()
    core.ctx.destroy(linger=0)  # vLLM's sync client leaves its zmq context to the GC


def prompt(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 500, PROMPT_TOKENS)]


def generate(
    llm: Any, tokens: list[int], kv_transfer_params: dict[str, Any] | None = None
) -> tuple[list[int], int]:
    """Greedy output tokens and the tokens vLLM did not compute (its prefill start)."""
    params = GREEDY
    if kv_transfer_params is not None:
        params = GREEDY.clone()
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return list(output.outputs[0].token_ids), int(output.num_cached_tokens or 0)


@dataclass(frozen=True)
class Reload:
    """A prompt generated, vLLM's own cache reset, the same prompt generated again
    (``reload``): the outputs, the tokens vLLM did not compute each time, and the
    daemon's stats before, once the first run's blocks were stored, and after."""

    first: list[int]
    second: list[int]
    cached_first: int
    cached_second: int
    before: StoreStats
    stored: StoreStats
    after: StoreStats

    @property
    def ssd_hits(self) -> int:
        """Blocks the daemon served from LMDB to the second run."""
        return self.after.tiers[TierKind.SSD].hits - self.stored.tiers[TierKind.SSD].hits


def reload(llm: Any, daemon: Daemon, tokens: list[int], chunks: int = FULL_BLOCKS) -> Reload:
    """Generate ``tokens``, wait for its ``chunks`` to be stored (a full block's, a KV
    cache group), reset vLLM's own prefix cache and generate them again."""
    before = stats(daemon)
    first, cached_first = generate(llm, tokens)
    stored = stats_once_stored(daemon, before.chunks_stored + chunks)
    assert llm.reset_prefix_cache()
    second, cached_second = generate(llm, tokens)
    return Reload(first, second, cached_first, cached_second, before, stored, stats(daemon))


def stats(daemon: Daemon) -> StoreStats:
    with kvstore.connect(daemon.url, timeout_s=10.0) as client:
        return client.stats()


def stats_once_stored(daemon: Daemon, chunks_stored: int) -> StoreStats:
    """The daemon's stats once it has stored ``chunks_stored`` chunks in all: saves are
    put by the worker's own thread, after the request that made them has returned."""
    deadline = time.monotonic() + 20.0
    while (now := stats(daemon)).chunks_stored < chunks_stored:
        assert time.monotonic() < deadline, (now.chunks_stored, chunks_stored)
        time.sleep(0.02)
    return now


def generate_stored(
    llm: Any, daemon: Daemon, model_dir: Path, tokens: list[int]
) -> tuple[list[int], Namespace, list[ChunkKey]]:
    """Generate ``tokens`` and wait until the daemon has stored its full blocks: the
    greedy output, and the namespace and keys the daemon holds those blocks under."""
    start = stats(daemon)
    output, _ = generate(llm, tokens)
    stats_once_stored(daemon, start.chunks_stored + FULL_BLOCKS)
    return (output, *vllm_keys(model_dir, tokens))


def vllm_keys(model_dir: Path, tokens: list[int]) -> tuple[Namespace, list[ChunkKey]]:
    """The daemon's keys of ``tokens``' full blocks, from vLLM's block hashing run here,
    outside the engine: SHA-256 chained over ``(parent, block tokens, extra keys)``."""
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hashes: list[bytes] = []
    parent = None
    for start in range(0, FULL_BLOCKS * BLOCK, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK])
        hashes.append(bytes(parent))
    pages = PageFormat(
        model=f"{model_dir}@main",
        layer_names=LAYERS,
        num_kv_heads=1,
        head_size=64,
        dtype="float32",
        block_size=BLOCK,
    )
    return pages.namespace(None), pages.keys(None, hashes)


def damage_stored_block(daemon: Daemon, namespace: Namespace, key: ChunkKey) -> None:
    """Flip one payload bit of ``key``'s block, with the daemon stopped (as a disk
    would), then start the daemon again."""
    daemon.stop()
    damage_block(daemon.data_dir / "lmdb", namespace, key, offset=777)
    daemon.start()

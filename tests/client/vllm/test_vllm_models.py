"""Attention beyond plain full attention, through the connector on vLLM's CPU build.

* **MLA**: a DeepSeek-V2-Lite-shaped model (two dense layers, random weights,
  DeepSeek-V2's 512-wide latent plus 64 of rope a token, no V) on vLLM's
  ``CPU_MLA`` backend, whose KV cache is one latent vector a token.
* **Sliding window + full attention**: a Llama whose first layer attends to a
  48-token window, through vLLM's hybrid KV cache manager (the connector
  declares ``SupportsHMA``): two KV cache groups, each stored in a namespace
  of its own, the sliding one loaded only where vLLM gives it pages (the last
  two blocks before the first computed token), its other blocks vLLM's null
  block.

For each: a prompt's blocks are saved, vLLM's own cache is reset, and the same
prompt loads every full block back from the daemon (and a sliding window's)
and gives the same greedy output. Run by ``make test-vllm``; skipped where
vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these")

import torch  # noqa: E402
from support.daemon import Daemon, running_daemon  # noqa: E402
from support.vllm_engine import (  # noqa: E402
    PROMPT_TOKENS,
    prompt,
    reload,
    save_model,
    start_llm,
    stop_llm,
)
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    r"ignore:::(torch|vllm|transformers|triton|numba|pydantic)(\.|$)"
)
SSD_ONLY = """\
data_dir = "{data_dir}"

[tiers.ssd]
capacity = "256MiB"
"""


def save_deepseek_v2(path: Path) -> None:
    config = DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        kv_lora_rank=512,  # the latent: 512 + 64 of rope, as vLLM's CPU kernels require
        q_lora_rank=None,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,  # both layers dense: MLA without the experts
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).save_pretrained(path)


def save_sliding_and_full_llama(path: Path) -> None:
    save_model(path, layer_types=["sliding_attention", "full_attention"], sliding_window=48)


@dataclass(frozen=True)
class Kind:
    """A model, vLLM's block size for it, its engine options, and the chunks a prompt of
    ``PROMPT_TOKENS`` stores and loads back: one a full block a group, but a sliding
    window's group loads only the blocks in its window."""

    save: Callable[[Path], None]
    block_size: int
    engine_options: dict[str, Any]
    stored: int
    loaded: int


# CPU_MLA is named: vLLM prefers AMX_MLA where the CPU has AMX, which takes other
# blocks and dtypes, and the reference backend runs on every x86-64 CPU.
KINDS = {
    "mla": Kind(save_deepseek_v2, 16, {"attention_config": {"backend": "CPU_MLA"}}, 6, 6),
    # 3 full blocks of 32 in each of two groups; the 48-token window before token 96
    # spans blocks 1 and 2, so the sliding group loads those two.
    "sliding+full": Kind(save_sliding_and_full_llama, 32, {}, 6, 3 + 2),
}


@pytest.fixture(scope="module")
def store_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("kvstore"), config_text=SSD_ONLY) as daemon:
        yield daemon


@pytest.fixture(scope="module", params=list(KINDS))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, store_daemon: Daemon
) -> Iterator[tuple[Any, int]]:
    kind = KINDS[request.param]
    model_dir = tmp_path_factory.mktemp(request.param.replace("+", "-"))
    kind.save(model_dir)
    connector = {"url": store_daemon.url, "session_events": False}
    llm = start_llm(model_dir, connector, block_size=kind.block_size, **kind.engine_options)
    try:
        yield llm, kind
    finally:
        stop_llm(llm)


def test_a_reset_engine_loads_every_full_block_and_gives_the_same_output(
    engine: tuple[Any, Kind], store_daemon: Daemon
) -> None:
    llm, kind = engine
    full_blocks = PROMPT_TOKENS // kind.block_size  # the block of the last token is computed
    run = reload(llm, store_daemon, prompt(21), kind.stored)
    assert run.second == run.first
    assert run.cached_second == full_blocks * kind.block_size
    assert run.ssd_hits == kind.loaded
    assert run.after.get_misses == run.stored.get_misses
